"""stacklib.infer's engine: identical greedy tokens, paged cache bookkeeping, no recompiles.

The reference is chapter 12's plain generation (`stacklib.llm.generate`, a contiguous KV
cache, batch 1). Every engine variant must produce the same greedy tokens, token for
token: batch 1 and batch N, prefix caching on and off, with preemption.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.nn as nnx
import stacklib.quant as qwix
from stacklib import llm
from stacklib.compile.recompile import CompileWatcher
from stacklib.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from stacklib.infer.block_pool import NULL_BLOCK, BlockPool, KVCacheManager, hash_block_tokens
from stacklib.infer.quantization import quantize_weights, weight_bytes
from stacklib.infer.sampling_params import filter_probs
from stacklib.infer.scheduler import Scheduler, Sequence, SequenceStatus

SHARED = "import os\nimport sys\n\n\ndef main("  # 32 bytes: 8 full blocks of 4, shared by prompts 0, 2, 5
PROMPTS = [SHARED + "):\n", "def main(", SHARED + "argv", "class Foo:\n    def __init__(self",
           "# Copyright", SHARED + "", "for i in range(10):\n    ", "x = "]
MAX_TOKENS = [24, 8, 40, 16, 33, 5, 24, 12]
# A step budget of 64 tokens (the engine's default is 512): the batch's prompts are pre-filled in
# chunks, and the engines here compile 7 programs each instead of 10.
ENGINE = dict(max_num_seqs=8, block_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model():
    return llm.pretrained("stdlib-bytes")[0]


@pytest.fixture(scope="module")
def engine(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def reference(model):
    """Chapter 12's greedy continuation of each prompt, one at a time."""
    tokenizer = llm.ByteTokenizer()
    out = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        ids = tokenizer.encode(prompt)
        out.append(llm.generate(model, ids, n)[len(ids):].tolist())
    return out


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_greedy_batch_n_equals_plain_generation_token_for_token(engine, reference):
    outputs = engine.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("quantization, bits", [("int8", 8), ("int4", 4)])
def test_a_quantized_engine_runs_chapter_11s_weights_and_matches_plain_generation_of_them(
        model, quantization, bits):
    quantized = LLM(model, max_num_seqs=1, max_model_len=48, block_size=4, quantization=quantization)
    params = quantized.llm_engine.runner.params
    kernels = [leaf for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, qwix.QArray))
               if isinstance(leaf, qwix.QArray)]
    layers = model.config.n_layers
    assert len(kernels) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer; and lm_head
    assert {k.qvalue.dtype for k in kernels} == {jnp.dtype(quantization)}
    # Weight-only, per output channel: 32 bits -> `bits`, plus one float32 scale per column, which
    # costs at most 1/16 of the float column here (every kernel has >= 64 inputs).
    assert all(k.scale.size == k.qvalue.shape[-1] for k in kernels)
    floats = sum(k.qvalue.size * 4 for k in kernels)
    assert sum(k.nbytes for k in kernels) <= floats * (bits / 32 + 1 / 16)
    assert weight_bytes(params) < weight_bytes(nnx.state(model, nnx.Param))
    # The engine runs the quantized model's own forward pass: greedy tokens equal llm.generate's on it.
    reference_model = quantize_weights(model, quantization)
    tokenizer = llm.ByteTokenizer()
    ids = tokenizer.encode(PROMPTS[3])
    expected = llm.generate(reference_model, ids, 12)[len(ids):].tolist()
    assert quantized.generate(PROMPTS[3], _greedy(12))[0].outputs[0].token_ids == expected


def test_an_unknown_quantization_is_refused_naming_the_choices(model):
    with pytest.raises(ValueError, match="quantization='int3' is not one of int8, int4"):
        LLM(model, quantization="int3")


def test_greedy_batch_1_equals_plain_generation(engine, reference):
    for prompt, n, expected in zip(PROMPTS, MAX_TOKENS, reference, strict=True):
        assert engine.generate(prompt, _greedy(n))[0].outputs[0].token_ids == expected


def test_prefix_caching_reuses_blocks_and_changes_no_token(model, reference):
    cached = LLM(model, **ENGINE, enable_prefix_caching=True)
    uncached = LLM(model, **ENGINE, enable_prefix_caching=False)
    for llm_ in (cached, uncached):
        llm_.generate(PROMPTS[0], _greedy(4))  # leaves SHARED's blocks in the pool
        outputs = llm_.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])
        assert [o.outputs[0].token_ids for o in outputs] == reference
        hits = [o.num_cached_tokens for o in outputs]
        if llm_ is cached:
            assert hits[2] == len(SHARED) == 32 and hits[0] == 32 and hits[1] == 0
        else:
            assert hits == [0] * len(PROMPTS)


def test_a_step_mixes_decodes_with_a_prompt_chunk_under_the_token_budget():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=4).resolve(128)
    scheduler = Scheduler(config, eos_token_ids={0})
    params = SamplingParams(max_tokens=4)
    short, long = (Sequence(name, name, 0, list(range(1, n + 1)), params, np.random.default_rng(0))
                   for name, n in (("short", 3), ("long", 20)))
    scheduler.add(short)
    assert [(s.seq_id, n) for s, n in scheduler.schedule().scheduled] == [("short", 3)]
    scheduler.update_from_output(short, 3, 7)  # its prompt done: a token sampled
    scheduler.add(long)
    steps = []
    while long.num_computed_tokens < len(long.prompt_token_ids):
        work = scheduler.schedule()
        steps.append([(s.seq_id, n) for s, n in work.scheduled])
        for seq, n in work.scheduled:
            done = seq.num_computed_tokens + n == seq.num_tokens
            scheduler.update_from_output(seq, n, 7 if done else None)
    # One decode token for the short sequence, the rest of the budget for the long prompt's chunks.
    assert steps == [[("short", 1), ("long", 7)], [("short", 1), ("long", 7)], [("short", 1), ("long", 6)]]
    assert short.status is SequenceStatus.FINISHED  # max_tokens=4 reached at the third step


def test_chunked_prefill_gives_the_same_greedy_tokens(model, reference):
    chunked = LLM(model, max_num_seqs=8, block_size=4, max_num_batched_tokens=8)
    outputs = chunked.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_preemption_by_recomputation_finishes_every_request(model, reference):
    # 39 blocks of 4 slots cannot hold 8 sequences of up to 76 tokens at once.
    small = LLM(model, **ENGINE, num_gpu_blocks_override=40, enable_prefix_caching=False)
    outputs = small.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [len(o.outputs[0].token_ids) for o in outputs] == MAX_TOKENS
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert small.llm_engine.scheduler.kv_cache.pool.num_free_blocks == 39  # every block came back


def test_a_model_folder_in_the_zoo_format_loads_the_same_weights(engine):
    from stacklib.llm import zoo

    folder = LLM(str(zoo.cache_dir() / "stdlib-bytes"), **ENGINE)
    assert folder.model_name == "stdlib-bytes"
    params = _greedy(12)
    ours, theirs = (llm_.generate("def ", params)[0].outputs[0].token_ids for llm_ in (folder, engine))
    assert ours == theirs


def test_no_recompilation_after_warmup_for_any_prompt_length_or_batch(engine):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 90, 13)
    prompts = [{"prompt_token_ids": rng.integers(32, 127, size=int(k)).tolist()} for k in lengths]
    with CompileWatcher() as watcher:
        engine.generate(prompts, SamplingParams(temperature=0.7, max_tokens=20, seed=1))
        engine.generate(prompts[:3], _greedy(3))
    assert watcher.count() == 0, watcher.events


def test_kv_waste_is_under_one_block_per_sequence_and_4_percent(model):
    engine = LLM(model, **ENGINE, enable_prefix_caching=False).llm_engine
    rng = np.random.default_rng(1)
    for i in range(12):
        ids = rng.integers(32, 127, size=int(rng.integers(20, 60))).tolist()
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=int(rng.integers(20, 60)),
                                                       ignore_eos=True))
    slots = tokens = 0
    while engine.has_unfinished_requests():
        engine.step()
        usage = engine.kv_cache_usage()
        assert 0 <= usage["slots"] - usage["tokens"] < 4 * max(usage["sequences"], 1)
        slots, tokens = slots + usage["slots"], tokens + usage["tokens"]
    waste = 1 - tokens / slots
    assert waste <= 0.04, waste


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=7, n=2)
    alone = engine.generate("def ", params)[0]
    crowded = engine.generate(["x = 1", "def ", "import "], [SamplingParams(temperature=1.0, max_tokens=30),
                                                             params, SamplingParams(temperature=0.5)])[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowded.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # n=2 draws two completions


def test_stop_strings_stop_tokens_logprobs_and_outputs_in_input_order(engine):
    greedy = engine.generate("class Foo:\n    def __init__(self", _greedy(30))[0].outputs[0]
    stop = greedy.text[5:8]
    out = engine.generate("class Foo:\n    def __init__(self",
                          SamplingParams(temperature=0, max_tokens=30, stop=stop, logprobs=2))[0].outputs[0]
    expected_text = greedy.text[:greedy.text.find(stop)]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, expected_text)
    assert len(out.logprobs) == len(out.token_ids) and all(len(lp) >= 2 for lp in out.logprobs)
    chosen = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(c.logprob for c in chosen))
    assert all(c.rank == 1 for c in chosen)  # greedy picks rank 1
    token = greedy.token_ids[3]
    out = engine.generate("class Foo:\n    def __init__(self",
                          SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[token]))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:greedy.token_ids.index(token) + 1] and out.stop_reason == token
    ids = [o.request_id for o in engine.generate(["a", "b", "c"], _greedy(2))]
    assert ids == sorted(ids, key=int)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(n=0), "n must"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_sampling_params_reject_bad_values_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompts_beyond_the_context_are_rejected_with_the_limit(engine):
    with pytest.raises(ValueError, match="maximum context length is 128"):
        engine.generate("x" * 100, SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="Shorten the prompt"):
        engine.generate("x" * 128, SamplingParams(max_tokens=1))


def test_decode_only_steps_lay_out_one_query_row_per_sequence_not_the_token_bucket(engine):
    runner = engine.llm_engine.runner
    runner.query_rows = dict.fromkeys(runner.query_rows, 0)
    engine.generate("def ", _greedy(5))  # a 4-token prefill (bucket 4), then 4 decode-only steps
    S, N = 8, 4  # max_num_seqs; the smallest token bucket
    assert runner.query_rows == {"computed": S * N + 4 * S * 1, "padded_to_token_bucket": 5 * S * N}


def test_a_refused_prompt_in_a_list_leaves_none_of_the_list_queued(engine):
    with pytest.raises(ValueError, match="maximum context length is 128"):
        engine.generate(["def ", "import os\n", "x" * 100], SamplingParams(max_tokens=40))
    assert not engine.llm_engine.has_unfinished_requests()
    assert not engine.llm_engine.scheduler.has_unfinished()
    (output,) = engine.generate("class ", _greedy(3))  # the next call runs its own prompt only
    assert output.prompt == "class " and len(output.outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size=0 must be a positive integer"),
    (dict(max_num_seqs=-1), "max_num_seqs=-1 must be a positive integer"),
    (dict(max_model_len=1.5), "max_model_len=1.5 must be a positive integer"),
    (dict(max_model_len=129), "exceeds the model's max_seq_len=128"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4),
     "max_num_batched_tokens=4 is smaller than max_num_seqs=8"),
])
def test_engine_settings_that_cannot_work_are_refused_by_name(model, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMEngine(model, config=EngineConfig(**kwargs))
    with pytest.raises(TypeError, match="Unknown engine setting.s. max_num_seq; the settings are max_"):
        LLM(model, max_num_seq=8)  # a typo names the known settings, before any model is loaded


def test_top_k_top_p_and_min_p_keep_the_right_tokens():
    probs = np.array([0.1, 0.4, 0.2, 0.3])
    np.testing.assert_allclose(filter_probs(probs, 2, 1.0, 0.0), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(filter_probs(probs, 0, 0.6, 0.0), [0, 4 / 7, 0, 3 / 7])  # 0.4 < 0.6 <= 0.7
    np.testing.assert_allclose(filter_probs(probs, 0, 0.4, 0.0), [0, 1, 0, 0])
    np.testing.assert_allclose(filter_probs(probs, 0, 1.0, 0.5), [0, 4 / 9, 2 / 9, 3 / 9])


def test_block_pool_free_queue_refcounts_and_lru_eviction():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    assert NULL_BLOCK not in a and pool.num_free_blocks == 2
    pool.cache_full_block(a[0], 111)
    pool.free_blocks(reversed(a))  # tail first: a[1] is evicted before a[0]
    assert list(pool.free_queue) == [3, 4, a[1], a[0]] and pool.get_cached_block(111) == a[0]
    pool.touch([a[0]])  # a cache hit takes the block back off the queue
    assert pool.blocks[a[0]].ref_cnt == 1 and a[0] not in pool.free_queue
    pool.free_blocks([a[0]])
    pool.get_new_blocks(4)  # reuses every block: the cached one is evicted
    assert pool.get_cached_block(111) is None
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)


def test_prefix_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(hash_block_tokens(None, [0, 0]), [1, 2])
    kv = KVCacheManager(num_blocks=10, block_size=2)
    table = kv.allocate("a", 5)
    kv.cache_blocks("a", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 9, 9]) == table[:2]
    assert kv.get_computed_blocks("c", [1, 2, 3, 4]) == table[:1]  # one token is always left to compute
    assert kv.get_computed_blocks("d", [7, 7, 3, 4, 9]) == []
