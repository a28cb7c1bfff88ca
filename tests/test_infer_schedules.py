"""The engine's one invariant, under any schedule: greedy tokens are `llm.generate`'s.

Whatever happened to the other requests (arriving mid-step, aborted mid-prefill, preempted
by a full cache and recomputed, sharing a prefix that another request cached), a request
that finishes has exactly the tokens chapter 12's plain generation gives its prompt alone.
Hypothesis draws the schedules: prompts cut from a few shared stems (so the prefix cache
hits, often on blocks another request is still filling), arrival and abort steps, and the
cache's block size; the engine runs with prefix caching on, a token budget of 7 (so prompts
are pre-filled in chunks that end mid-block) and a cache too small for its sequences (so it preempts). After
every step the block pool is checked: each block's reference count is the number of block
tables holding it, idle blocks and only they are free, and a block is named in the prefix
cache only once every one of its slots holds a computed key and value.

The reference runs the model on a fixed-length buffer (`llm.generate(use_cache=False)` to
`TOTAL` tokens): one compiled program for every prompt. `make test` tries `EXAMPLES`
schedules with a fixed seed (the same ones on every run); `make test-slow` tries many more.
"""

import collections
import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stacklib import llm
from stacklib.infer import EngineConfig, LLMEngine, SamplingParams
from stacklib.infer.block_pool import NULL_BLOCK

STEMS = ("import os\nimport sys\n\n\ndef main(", "class Foo:\n    def __init__(self",
         "for i in range(10):\n    ")
SUFFIX = "abc =()\n"
TOTAL = 64  # the engine's max_model_len, and the length every reference is generated to
MAX_TOKENS = 10
BUDGET = 7  # max_num_batched_tokens: prompts are pre-filled in chunks of up to 7, ending mid-block
MAX_NUM_SEQS = 4
MAX_STEPS = 600  # a schedule of 6 requests needs under 200; more means the engine is stuck

EXAMPLES = 300 if os.environ.get("STACKLIB_SLOW_TESTS") else 30
SCHEDULES = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclasses.dataclass(frozen=True)
class Arrival:
    prompt: str
    max_tokens: int
    step: int  # the engine step before which the request is added
    abort_step: int | None  # the step before which it is aborted, if it is still running


@st.composite
def schedules(draw) -> tuple[int, list[Arrival]]:
    block_size = draw(st.sampled_from([2, 4, 8]))
    arrivals = []
    for _ in range(draw(st.integers(1, 6))):
        stem = draw(st.sampled_from(STEMS))
        prompt = stem[:draw(st.integers(1, len(stem)))] + draw(st.text(SUFFIX, max_size=8))
        step = draw(st.integers(0, 8))
        abort = draw(st.none() | st.integers(step, step + 8))
        arrivals.append(Arrival(prompt, draw(st.integers(1, MAX_TOKENS)), step, abort))
    return block_size, arrivals


@pytest.fixture(scope="module")
def model():
    return llm.pretrained("stdlib-bytes")[0]


@pytest.fixture(scope="module")
def reference(model):
    """prompt -> its greedy continuation by chapter 12's `generate`, computed once per prompt."""
    tokenizer, memo = llm.ByteTokenizer(), {}

    def continuation(prompt: str) -> list[int]:
        if prompt not in memo:
            ids = tokenizer.encode(prompt)
            memo[prompt] = llm.generate(model, ids, TOTAL - len(ids), use_cache=False)[len(ids):].tolist()
        return memo[prompt]
    return continuation


def engine_config(block_size: int) -> EngineConfig:
    blocks_per_seq = TOTAL // block_size
    # Room for one and a half sequences of TOTAL tokens: four running sequences preempt each other.
    return EngineConfig(max_model_len=TOTAL, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET,
                        block_size=block_size, num_gpu_blocks_override=blocks_per_seq * 3 // 2 + 1,
                        enable_prefix_caching=True)


def check_block_pool(engine: LLMEngine) -> None:
    """The pool's bookkeeping agrees with the block tables; the prefix cache names only computed blocks."""
    scheduler = engine.scheduler
    manager, pool = scheduler.kv_cache, scheduler.kv_cache.pool
    assert set(manager.block_tables) == {seq.seq_id for seq in scheduler.running}, "a table without a runner"
    holders = collections.Counter(b for table in manager.block_tables.values() for b in table)
    assert NULL_BLOCK not in holders and NULL_BLOCK not in pool.free_queue
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]} tables")
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0), f"block {block.block_id}"
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash
    for seq in scheduler.running:
        for i, block_id in enumerate(manager.block_tables[seq.seq_id]):
            if pool.blocks[block_id].block_hash is not None:
                assert (i + 1) * manager.block_size <= seq.num_computed_tokens, (
                    f"{seq.seq_id}'s block {i} is in the prefix cache with only "
                    f"{seq.num_computed_tokens - i * manager.block_size} of its {manager.block_size} "
                    "slots computed")


def run_schedule(model, block_size: int, arrivals: list[Arrival]) -> tuple[dict, set, LLMEngine]:
    """Run the schedule; return the finished requests' outputs, the aborted ids, and the engine."""
    engine = LLMEngine(model, config=engine_config(block_size))
    finished, aborted = {}, set()
    for step in range(MAX_STEPS):
        for i, arrival in enumerate(arrivals):
            if arrival.step == step:
                engine.add_request(str(i), arrival.prompt, SamplingParams(
                    temperature=0.0, max_tokens=arrival.max_tokens, ignore_eos=True))
            if arrival.abort_step == step and str(i) in engine.requests:
                engine.abort_request(str(i))
                aborted.add(str(i))
        if step > max(a.step for a in arrivals) and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        check_block_pool(engine)
    else:
        raise AssertionError(f"unfinished after {MAX_STEPS} steps: {sorted(engine.requests)}")
    return finished, aborted, engine


@SCHEDULES
@given(schedule=schedules())
def test_every_finished_request_has_plain_generations_greedy_tokens_under_any_schedule(model, reference,
                                                                                        schedule):
    block_size, arrivals = schedule
    finished, aborted, engine = run_schedule(model, block_size, arrivals)
    assert set(finished) | aborted == {str(i) for i in range(len(arrivals))}
    for request_id, output in finished.items():
        arrival = arrivals[int(request_id)]
        assert output.outputs[0].token_ids == reference(arrival.prompt)[:arrival.max_tokens], (
            f"request {request_id} ({arrival}) under block_size={block_size}")
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # every block came back


def test_a_prompt_aborted_mid_prefill_leaves_no_half_written_block_in_the_prefix_cache(model, reference):
    # The first request's 32-token prompt is pre-filled 7 tokens a step; it is aborted after
    # one step, when block 0 (tokens 0-3) is written and block 1 holds 3 of its 4 tokens. The
    # second request shares the whole prompt: it may reuse block 0, and not block 1.
    prompt = STEMS[0]
    arrivals = [Arrival(prompt, 5, 0, 1), Arrival(prompt + "argv", 5, 2, None)]
    finished, aborted, engine = run_schedule(model, 4, arrivals)
    assert aborted == {"0"} and finished["1"].num_cached_tokens == 4
    assert finished["1"].outputs[0].token_ids == reference(prompt + "argv")[:5]
