"""Ragged paged attention (stacklib.kernels.paged_attention) against gathering the cache by hand.

The expected output of each sequence is computed the slow, obvious way: read its blocks
through its block table into contiguous keys and values, put its q_len queries at the end
of a kv_len-long query array (so that `is_causal` aligns query i with position
kv_len - q_len + i), and call `reference_attention` (f32 einsum at HIGHEST precision).
Tolerance: atol 1e-6 in float32, as for flash attention (tests/test_kernels_flash.py):
both implementations keep f32 logits at HIGHEST precision and divide exactly, so only the
summation order differs (~1e-7 on O(1) outputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from stacklib.kernels import PAGED_ATTENTION, ragged_paged_attention, reference_attention, resolve_interpret
from stacklib.kernels.paged_attention import paged_attention_pallas

ATOL = 1e-6
IMPLEMENTATIONS = ("xla", "pallas")
S, T, NUM_BLOCKS = 3, 8, 16  # sequences, query tokens and cache blocks of every test batch


def _batch(q_lens, kv_lens, *, H=4, K=2, D=8, block_size=4, max_blocks=3, shuffle=True, seed=0):
    """Random queries and caches, and block tables drawn from the pool (shuffled, or in order).

    Like an engine padding to a bucket, every batch has S=3 sequences (q_len-0 ones added),
    T=8 tokens (the ones no sequence owns are padding) and 16 blocks, so that the cases
    share compiled programs.
    """
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = [*q_lens] + [0] * (S - len(q_lens)), [*kv_lens] + [0] * (S - len(kv_lens))
    needed = [-(-n // block_size) for n in kv_lens]
    ids = rng.permutation(np.arange(1, NUM_BLOCKS)) if shuffle else np.arange(1, NUM_BLOCKS)  # 0: null
    tables = np.zeros((S, max_blocks), np.int32)  # unused entries: the null block
    for s, n in enumerate(needed):
        tables[s, :n], ids = ids[:n], ids[n:]
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    return dict(queries=normal(T, H, D), key_cache=normal(NUM_BLOCKS, block_size, K, D),
                value_cache=normal(NUM_BLOCKS, block_size, K, D), kv_lens=jnp.array(kv_lens, jnp.int32),
                block_tables=jnp.asarray(tables), query_start_loc=jnp.asarray(query_start_loc))


def _gathered_reference(queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc):
    """Per sequence: contiguous K/V through the block table, then `reference_attention`.

    Sequence s's q_len queries go at rows kv_len - q_len .. kv_len - 1 of an L-row query
    array, so `is_causal` (row t sees keys <= t) and `key_value_seq_lengths` give exactly
    the end-aligned causal mask. All sequences run as one batch, padded to L rows.
    """
    T, H, D = queries.shape
    _, block_size, K, _ = key_cache.shape
    S, M = block_tables.shape
    L = M * block_size
    starts, lens = np.asarray(query_start_loc), np.asarray(kv_lens)
    keys = key_cache[block_tables].reshape(S, L, K, D)  # (S, L, K, D) in position order
    values = value_cache[block_tables].reshape(S, L, K, D)
    q = np.zeros((S, L, H, D), np.float32)
    for s in range(S):
        q_len = starts[s + 1] - starts[s]
        q[s, lens[s] - q_len:lens[s]] = queries[starts[s]:starts[s + 1]]
    out = np.asarray(reference_attention(jnp.asarray(q), keys, values, is_causal=True,
                                         key_value_seq_lengths=kv_lens))
    expected = np.zeros((T, H, D), np.float32)  # tokens no sequence owns stay 0
    for s in range(S):
        q_len = starts[s + 1] - starts[s]
        expected[starts[s]:starts[s + 1]] = out[s, lens[s] - q_len:lens[s]]
    return expected


CASES = {  # name: (q_lens, kv_lens, options); kv_lens count the new tokens too
    "decode-only": ((1, 1, 1), (5, 9, 1), dict(shuffle=False)),
    "chunked-prefill-only": ((4, 4), (4, 10), {}),  # a first chunk, and a chunk after 6 cached tokens
    "mixed-decode-and-prefill": ((1, 5, 1), (12, 7, 3), {}),
    "gqa-4-query-heads-per-kv-head": ((2, 1), (6, 11), dict(H=8, K=2)),
    "shuffled-non-contiguous-blocks": ((3, 1), (12, 10), dict(shuffle=True, seed=3)),
    "q-len-0-padding-sequence-and-padding-tokens": ((2, 0, 1), (2, 0, 6), {}),  # and 5 padding tokens
    "block-size-not-dividing-kv-len": ((3, 1), (7, 11), dict(block_size=8, max_blocks=2)),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_each_implementation_equals_gathering_the_cache_and_the_reference(case, implementation):
    q_lens, kv_lens, options = CASES[case]
    batch = _batch(q_lens, kv_lens, **options)
    out = ragged_paged_attention(**batch, implementation=implementation)
    np.testing.assert_allclose(out, _gathered_reference(**batch), rtol=0, atol=ATOL)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_decode_only_batch_with_max_query_len_1_equals_the_reference(implementation):
    # The engine passes max_query_len=1 when every sequence decodes one token: the Pallas kernel
    # then lays out one query row per sequence instead of the step's token bucket.
    q_lens, kv_lens, options = CASES["decode-only"]
    batch = _batch(q_lens, kv_lens, **options)
    out = ragged_paged_attention(**batch, max_query_len=1, implementation=implementation)
    np.testing.assert_allclose(out, _gathered_reference(**batch), rtol=0, atol=ATOL)


def test_repeat_calls_are_bitwise_equal_and_jit_with_traced_tables_agrees():
    batch = _batch((1, 5, 1), (12, 7, 3))
    for implementation in IMPLEMENTATIONS:
        first = ragged_paged_attention(**batch, implementation=implementation)
        np.testing.assert_array_equal(first, ragged_paged_attention(**batch, implementation=implementation))
        jitted = jax.jit(lambda b, i=implementation: ragged_paged_attention(**b, implementation=i))
        np.testing.assert_allclose(jitted(batch), first, rtol=0, atol=ATOL)


def test_the_registry_picks_xla_on_cpu_and_pallas_when_asked():
    assert PAGED_ATTENTION.default_order("cpu") == ("xla",)
    assert PAGED_ATTENTION.default_order("gpu") == ("xla",)
    assert PAGED_ATTENTION.default_order("tpu") == ("pallas", "xla")
    batch = _batch((1, 1), (3, 6))

    def traced(implementation):  # the program each choice traces: a pallas_call only for the kernel
        program = jax.make_jaxpr(lambda b: ragged_paged_attention(**b, implementation=implementation))
        return str(program(batch))

    assert ("pallas_call" in traced(None)) == (jax.default_backend() == "tpu")
    assert "pallas_call" in traced("pallas")
    assert "pallas_call" not in traced("xla")


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="interpret mode is what runs off TPU")
def test_pallas_runs_interpreted_on_cpu_and_in_tpu_interpret_mode():
    assert resolve_interpret(None) is True  # the generic interpreter: what implementation='pallas' uses here
    batch = _batch((2, 1), (5, 6), max_blocks=2)  # a (3, 2) grid: TPU interpret mode is ~12 ms a step
    expected = _gathered_reference(**batch)
    out = paged_attention_pallas(**batch, scale=1 / np.sqrt(8), max_query_len=2,
                                 interpret=pltpu.InterpretParams())  # emulates SMEM, VMEM and the DMAs
    np.testing.assert_allclose(out, expected, rtol=0, atol=ATOL)


def _bad(**changes):
    return changes


BAD = [  # (changes to a good batch, text the ValueError must contain)
    (_bad(queries=jnp.zeros((8, 32))), "queries must be (T, H, D)"),
    (_bad(key_cache=jnp.zeros((64, 2, 8))), "key_cache must be (num_blocks, block_size, K, D)"),
    (_bad(queries=jnp.zeros((8, 3, 8))), "H=3 must be a multiple of the cache's K=2"),
    (_bad(block_tables=jnp.array([[99, 0, 0], [1, 2, 0], [0, 0, 0]], jnp.int32)),
     "block_tables[0, 0] = 99 points outside"),
    (_bad(kv_lens=jnp.array([3, 13, 0], jnp.int32)), "kv_lens[1] = 13 is not within 0..12"),
    (_bad(query_start_loc=jnp.array([0, 3, 1, 4], jnp.int32)), "must start at 0, never decrease"),
    (_bad(query_start_loc=jnp.array([0, 1, 4, 9], jnp.int32)), "end at most at the number of query tokens"),
    (_bad(query_start_loc=jnp.array([0, 1], jnp.int32)), "query_start_loc must be integers of shape (4,)"),
    (_bad(kv_lens=jnp.array([0, 3, 0], jnp.int32)), "q_len=1 query tokens but kv_lens[0] = 0"),
    (_bad(max_query_len=2), "more than max_query_len=2"),
]


@pytest.mark.parametrize("changes, message", BAD, ids=[m[:28] for _, m in BAD])
def test_bad_inputs_raise_a_value_error_naming_the_argument_and_fix(changes, message):
    batch = _batch((1, 3), (3, 6))  # S=3, T=8, H=4, K=2, D=8, block_size=4, 3 blocks per sequence
    batch.update(changes)
    with pytest.raises(ValueError) as error:
        ragged_paged_attention(**batch, implementation="xla")
    assert message in str(error.value)
