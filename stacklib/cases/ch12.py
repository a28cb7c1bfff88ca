"""Chapter 12 exercises: RoPE, grouped-query causal attention, the FLOPs of a training step,
packing documents into sequences, and goodput from a log.

Every expected answer comes from `stacklib.llm` (or is written out here) and is computed
before the learner's code runs; arrays and lists are handed over as copies
(`call_on_copies`), so an answer that changes its input in place is named as such. No
case compiles a model: each runs in well under a second.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import stacklib.kernels as kernels
from stacklib.grading import Exercise, call_on_copies, expect, expect_close, expect_equal
from stacklib.llm import flops, kv_cache, model
from stacklib.llm.config import Config


def _random(seed: int, shape) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


# ---------------------------------------------------------------- 12.rope

rope = Exercise("12.rope", "Rotary position embeddings")


def _reference_rope(x, positions, theta):
    cos, sin = model.rope_angles(jnp.asarray(positions), x.shape[-1], theta)
    return np.asarray(model.apply_rope(jnp.asarray(x), cos, sin))


@rope.case(points=3, hint="The rotated features differ from the model's. Check which features form a "
                          "pair (the exercise's halves, not neighbours), the angle each pair turns by, and "
                          "that every sequence uses its own row of positions. See 'The model' (RoPE).")
def matches_the_model_at_any_positions(rope_fn):
    x = _random(0, (2, 5, 3, 8))
    positions = np.array([[0, 1, 2, 3, 4], [7, 9, 20, 21, 100]], np.int32)  # not arange in row 1
    expected = _reference_rope(x, positions, 10_000.0)
    got = call_on_copies(rope_fn, x, positions, 10_000.0, what="apply_rope")
    expect_close(got, expected, rtol=1e-5, atol=1e-5, what="apply_rope(x, positions, 10000)")


@rope.case(hint="At position 0 every angle is 0, so the vector must come back unchanged; yours changed.")
def position_zero_is_the_identity(rope_fn):
    x = _random(1, (1, 4, 2, 6))
    got = call_on_copies(rope_fn, x, np.zeros((1, 4), np.int32), 500.0, what="apply_rope")
    expect_close(got, x, atol=1e-6, what="apply_rope at position 0")


@rope.case(hint="A query-key score must depend on the distance between their positions and on nothing "
                "else: see the demo of rotated scores in 'The model'.")
def scores_depend_on_the_offset_only(rope_fn):
    q, k = _random(2, (1, 1, 1, 16)), _random(3, (1, 1, 1, 16))

    def score(i, j):
        rq = rope_fn(q.copy(), np.array([[i]], np.int32), 10_000.0)
        rk = rope_fn(k.copy(), np.array([[j]], np.int32), 10_000.0)
        return float(np.sum(np.asarray(rq) * np.asarray(rk)))

    expect_close(score(13, 10), score(3, 0), rtol=1e-4, atol=1e-4, what="score at offset 3, shifted by 10")
    expect(abs(score(5, 0) - score(3, 0)) > 1e-3,
           "the score at offset 5 equals the one at offset 3: the positions do not change the result")


@rope.case(points=2, hint="This case passes theta=100, not 10000: the angles must come from the theta "
                          "argument.")
def theta_is_the_argument(rope_fn):
    x = _random(4, (2, 5, 3, 8))  # the first case's shapes: nothing new to compile
    positions = np.array([[3, 17, 40, 41, 42], [1, 2, 250, 251, 300]], np.int32)
    expected = _reference_rope(x, positions, 100.0)
    got = call_on_copies(rope_fn, x, positions, 100.0, what="apply_rope")
    expect_close(got, expected, rtol=1e-5, atol=1e-5, what="apply_rope(x, positions, theta=100)")


# ---------------------------------------------------------------- 12.gqa_attention

gqa_attention = Exercise("12.gqa_attention", "Causal attention with grouped key/value heads")


def _reference_attention(q, k, v, q_positions, k_positions):
    mask = kv_cache.causal_mask(jnp.asarray(q_positions), jnp.asarray(k_positions))[:, None]  # (B, 1, T, S)
    return np.asarray(kernels.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=mask,
                                                    implementation="xla"))


def _check_attention(attention_fn, seed, B, T, S, H, K, D, q_positions, k_positions, what):
    q, k, v = _random(seed, (B, T, H, D)), _random(seed + 1, (B, S, K, D)), _random(seed + 2, (B, S, K, D))
    expected = _reference_attention(q, k, v, q_positions, k_positions)
    got = call_on_copies(attention_fn, q, k, v, q_positions, k_positions, what="gqa_attention")
    expect_close(got, expected, rtol=1e-4, atol=1e-5, what=what)


@gqa_attention.case(hint="Plain causal attention, one key/value head per query head, already differs: "
                         "check the scale of the scores, the axis of the softmax (the keys), and that a "
                         "query sees the key at its own position. See 'The model'.")
def one_kv_head_per_query_head(attention_fn):
    pos = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6)).copy()
    _check_attention(attention_fn, 10, 2, 6, 6, 4, 4, 8, pos, pos, "multi-head causal attention (K == H)")


@gqa_attention.case(points=3, hint="With H=6 query heads and K=2 key/value heads, query heads were paired "
                                   "with the wrong key/value heads: the exercise says which query heads "
                                   "form a group. See grouped-query attention in 'The model'.")
def query_heads_share_kv_heads_in_consecutive_groups(attention_fn):
    pos = np.broadcast_to(np.arange(5, dtype=np.int32), (1, 5)).copy()
    _check_attention(attention_fn, 20, 1, 5, 5, 6, 2, 4, pos, pos, "grouped-query attention, H=6, K=2")


@gqa_attention.case(points=2, hint="A decoded token (T=1) attended to cache slots after its position, or "
                                   "missed some before it: the mask must come from each sequence's "
                                   "q_positions and k_positions, not from the arrays' shapes. See the "
                                   "note on causal_mask in 'The model'.")
def a_decoded_token_sees_the_cache_up_to_its_position(attention_fn):
    q_pos = np.array([[5], [2]], np.int32)  # one new token per sequence, each at its own position
    k_pos = np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8)).copy()  # a cache of 8 slots
    # K == H, so that only the mask is tested here (the grouping has its own case).
    _check_attention(attention_fn, 30, 2, 1, 8, 4, 4, 8, q_pos, k_pos, "one-token decode against a cache")


# ---------------------------------------------------------------- 12.flops_per_token

flops_per_token = Exercise("12.flops_per_token", "The FLOPs of a training step, per token")

_SIZES = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "seq_len")


def _expected_flops(causal: bool, **sizes) -> float:
    config = Config(**sizes, max_seq_len=sizes["seq_len"], batch_size=1,
                    tensor_parallelism=1, fsdp_parallelism=1, data_parallelism=1)
    return flops.training_flops(config, causal=causal).per_token


def _check_flops(flops_fn, causal, what, **sizes):
    expected = _expected_flops(causal, **sizes)
    got = flops_fn(**sizes, causal=causal)
    expect(isinstance(got, int | float | np.floating | np.integer),
           f"expected a number of FLOPs, got {type(got).__name__}")
    expect_close(float(got), expected, rtol=1e-9, what=what)


_MHA = dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=384, vocab_size=256,
            seq_len=128)
_GQA = dict(d_model=256, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=32, d_ff=768, vocab_size=1000,
            seq_len=512)


@flops_per_token.case(points=2, hint="The count for a small multi-head model already differs: check which "
                                     "weights take part in a matmul (the exercise's list), the FLOPs per "
                                     "weight for forward plus backward, and the attention term. See 'How "
                                     "many FLOPs is a step?'.")
def whole_attention_matrix(flops_fn):
    _check_flops(flops_fn, False, "FLOPs per token, counting the whole T x T score matrix", **_MHA)


@flops_per_token.case(points=2, hint="With fewer key/value heads than query heads the count differs: check "
                                     "the sizes of k_proj and v_proj against q_proj and o_proj, and which "
                                     "head count the attention term uses.")
def grouped_query_projections(flops_fn):
    _check_flops(flops_fn, False, "FLOPs per token with 8 query and 2 key/value heads", **_GQA)


@flops_per_token.case(points=2, hint="Counting only the causal scores: count how many keys query t sees "
                                     "(itself included) and average over t; the exercise states the "
                                     "result.")
def causal_half(flops_fn):
    _check_flops(flops_fn, True, "FLOPs per token counting only the causal scores", **_MHA)


_WIDE_HEADS = dict(d_model=192, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=512, vocab_size=300,
                   seq_len=64)  # n_heads * head_dim = 256, wider than d_model, as in Gemma


@flops_per_token.case(points=2, hint="Here n_heads * head_dim (256) is not d_model (192): the projections "
                                     "and the attention term must use the head sizes, not d_model.")
def heads_wider_than_the_model(flops_fn):
    _check_flops(flops_fn, False, "FLOPs per token when n_heads * head_dim != d_model", **_WIDE_HEADS)


# ---------------------------------------------------------------- 12.pack

pack = Exercise("12.pack", "Pack documents into fixed-length training records")


def _expected_pack(documents, seq_len, eos_id):
    stream = np.concatenate([np.append(np.asarray(d), eos_id) for d in documents]).astype(np.int32)
    count = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(count)]) if count \
        else np.zeros((0, seq_len + 1), np.int32)


def _check_pack(pack_fn, documents, seq_len, eos_id, what):
    expected = _expected_pack(documents, seq_len, eos_id)
    got = call_on_copies(pack_fn, documents, seq_len, eos_id, what="pack")
    got = np.asarray(got)
    expect(got.ndim == 2 and got.shape[1:] == (seq_len + 1,),
           f"{what}: expected shape (records, {seq_len + 1}), got {got.shape}")
    expect_equal(got, expected, what=what)


@pack.case(points=2, hint="The records differ from the packed stream's. Write out the stream by hand "
                          "for this small input and compare: where the end-of-document tokens go, the "
                          "order of the documents, and how consecutive records overlap. See 'The data'.")
def three_documents(pack_fn):
    documents = [np.array([7, 5, 6]), np.array([9, 8]), np.array([12, 10, 13, 11])]
    _check_pack(pack_fn, documents, 3, 0, "pack([[7,5,6],[9,8],[12,10,13,11]], seq_len=3, eos_id=0)")


@pack.case(hint="On a longer corpus some tokens are lost or repeated: every token after the first "
                "must be a target exactly once. See the overlap in 'The data'.")
def every_token_is_a_target_once(pack_fn):
    rng = np.random.default_rng(0)
    documents = [rng.integers(1, 256, size=n) for n in (50, 7, 120, 33)]
    _check_pack(pack_fn, documents, 16, 0, "pack of four random documents, seq_len=16")


@pack.case(hint="A corpus shorter than one record gives no records, and still a 2-D array: the "
                "exercise states its shape.")
def too_short_gives_no_records(pack_fn):
    _check_pack(pack_fn, [np.array([2, 1])], 8, 0, "pack of 3 tokens with seq_len=8")


@pack.case(points=2, hint="Here the stream ends exactly at a record's end, so the last record's last "
                          "token is the last document's end-of-document token: every document, the last "
                          "included, is followed by eos_id.")
def the_last_document_is_terminated_too(pack_fn):
    documents = [np.array([4, 2, 9]), np.array([8, 1, 3, 3, 6]), np.array([5, 2])]  # 13 tokens with eos
    _check_pack(pack_fn, documents, 4, 0, "pack([[4,2,9],[8,1,3,3,6],[5,2]], seq_len=4, eos_id=0)")


@pack.case(points=2, hint="This case passes eos_id=50256, not 0: the separator must be the eos_id argument.")
def eos_id_is_the_argument(pack_fn):
    documents = [np.array([30, 11, 27, 4, 19]), np.array([3, 8]), np.array([15, 6, 22, 9])]
    _check_pack(pack_fn, documents, 5, 50256, "pack(..., seq_len=5, eos_id=50256)")


# ---------------------------------------------------------------- 12.goodput

goodput = Exercise("12.goodput", "Goodput from a training log, with a restart")


def _expected_goodput(log):
    wall = sum(e["time"] for e in log if e["event"] == "end") - sum(
        e["time"] for e in log if e["event"] == "start")
    last_run = {}
    for index, e in enumerate(log):
        if e["event"] == "step":
            last_run[e["step"]] = index
    productive = sum(log[i]["seconds"] for i in last_run.values())
    steps = sum(e["seconds"] for e in log if e["event"] == "step")
    result = {kind: sum(e["seconds"] for e in log if e["event"] == kind)
              for kind in ("compile", "checkpoint", "input")}
    result.update(productive=productive, lost=steps - productive)
    result["other"] = wall - sum(result.values())
    result["goodput"] = productive / wall
    return result


def _job(start, steps, step_seconds, checkpoint_every, compile_seconds=2.0):
    log, t = [{"event": "start", "time": start}], start
    log.append({"event": "compile", "seconds": compile_seconds})
    t += compile_seconds + 0.5  # plus half a second of setup nobody timed
    for step in steps:
        log.append({"event": "input", "seconds": 0.01})
        log.append({"event": "step", "step": step, "seconds": step_seconds})
        t += 0.01 + step_seconds
        if step % checkpoint_every == 0:
            log.append({"event": "checkpoint", "seconds": 0.05})
            t += 0.05
    log.append({"event": "end", "time": t})
    return log


def _check_goodput(goodput_fn, log, what):
    expected = _expected_goodput(log)
    got = call_on_copies(goodput_fn, log, what="goodput")
    expect(isinstance(got, dict), f"expected a dict, got {type(got).__name__}")
    missing = sorted(set(expected) - set(got))
    expect(not missing, f"{what}: the result has no {missing}")
    expect_close({k: float(got[k]) for k in expected}, expected, rtol=1e-9, atol=1e-9, what=what)


@goodput.case(points=2, hint="Even one job without a restart comes out wrong: check the wall time (each "
                             "job from its start to its end), that goodput is a fraction of it, and "
                             "that 'other' is what no category explains. See 'MFU and goodput'.")
def one_uninterrupted_job(goodput_fn):
    _check_goodput(goodput_fn, _job(100.0, range(1, 21), 0.25, 10), "one job of 20 steps")


@goodput.case(points=2, hint="With a restart, some step numbers run twice: only the last run of a step "
                             "is productive, the earlier ones are 'lost'; and the pause between the jobs "
                             "is not wall time of either.")
def a_restart_loses_the_steps_after_the_last_checkpoint(goodput_fn):
    crashed = _job(0.0, range(1, 16), 0.3, 10)  # killed after step 15; step 10 was saved
    crashed[-1]["time"] += 1.0  # the time until the job was found dead
    resumed = _job(crashed[-1]["time"] + 30.0, range(11, 26), 0.2, 10, compile_seconds=3.0)
    _check_goodput(goodput_fn, crashed + resumed, "a job killed after step 15 and resumed from step 10")


@goodput.case(hint="The categories (productive, lost, compile, checkpoint, input, other) must add up to "
                   "the wall time: 'other' is what is left of it.")
def the_categories_add_up_to_the_wall_time(goodput_fn):
    first, second = _job(5.0, range(1, 9), 0.1, 4), _job(50.0, range(5, 13), 0.1, 4)
    wall = (first[-1]["time"] - first[0]["time"]) + (second[-1]["time"] - second[0]["time"])
    got = call_on_copies(goodput_fn, first + second, what="goodput")
    parts = sum(float(got[k]) for k in ("productive", "lost", "compile", "checkpoint", "input", "other"))
    expect(math.isclose(parts, wall, rel_tol=1e-9), f"the categories add up to {parts:.4f}s, the wall time "
                                                    f"is {wall:.4f}s")


@goodput.case(points=2, hint="Here steps run up to three times, and the last job restarted from an older "
                             "checkpoint than the latest: whatever the checkpoints say, only the last run "
                             "of each step number is productive and every earlier run is lost.")
def steps_run_three_times(goodput_fn):
    first = _job(0.0, range(1, 15), 0.3, 5)  # saved steps 5 and 10, killed after step 14
    second = _job(first[-1]["time"] + 20.0, range(11, 14), 0.25, 5)  # from step 10; killed after 13
    third = _job(second[-1]["time"] + 20.0, range(6, 21), 0.2, 5)  # step 10's save was bad: from step 5
    _check_goodput(goodput_fn, first + second + third, "three jobs, steps 11-13 run three times")
