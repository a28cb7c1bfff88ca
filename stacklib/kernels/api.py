"""One function per op, several implementations behind it: tokamax's API.

    import tokamax                       # the real library
    import stacklib.kernels as tokamax   # ours, for the calls below

    out = tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="xla_chunked")
    y = tokamax.layer_norm(x, scale, offset)
    h = tokamax.gated_linear_unit(x, w, activation=jax.nn.swish)

Each function (mirroring `tokamax/_src/ops/*/api.py`):

1. checks its arguments — ranks, shapes, head counts, dtypes — and raises an error that
   names the argument, the shapes and the fix, before any kernel is traced;
2. turns `implementation` into the list to try: a name, a sequence of names (the first
   that can serve the call wins) or None (the registry's default order for this backend);
3. asks each implementation in turn whether it can serve the call (`why_not`); the first
   that can gets its config from the autotuning cache or the miss policy
   (`stacklib.kernels.autotuning`) and runs; when none can, `NoImplementationError` lists
   every implementation's reason.

The registries `ATTENTION`, `LAYER_NORM`, `GATED_LINEAR_UNIT` and `PAGED_ATTENTION` declare
what each implementation supports; print one to see it. `ragged_paged_attention` (the
inference engine's attention over a paged KV cache) is ours, after vLLM TPU's kernel:
tokamax has no paged op.

Differences from tokamax: no `precision` or `q_sharding` for attention, no quantized
inputs, no Triton/Mosaic GPU kernels; our `'pallas'` is chapter 09's flash attention
(native on TPU, interpreted elsewhere) and joins the default order only on TPU; `'cudnn'`
is `jax.nn.dot_product_attention(implementation='cudnn')`, on GPU only, as in tokamax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stacklib.kernels import autotuning
from stacklib.kernels.gated_linear_unit import xla_gated_linear_unit
from stacklib.kernels.normalization import xla_layer_norm
from stacklib.kernels.paged_attention import paged_attention_pallas, paged_attention_xla
from stacklib.kernels.registry import BoundCall, Implementation, NoImplementationError, Registry, bind
from stacklib.kernels.xla_attention import xla_attention
from stacklib.kernels.xla_chunked import AttentionConfig, xla_chunked_attention

ALL_BACKENDS = ("cpu", "gpu", "tpu")
ATTENTION_OPTIONS = frozenset({"bias", "mask", "is_causal", "query_seq_lengths", "key_value_seq_lengths",
                               "local_window_size", "logits_soft_cap"})

# ---------------------------------------------------------------- attention implementations

ATTENTION = Registry("dot_product_attention",
                     default_order={"tpu": ("pallas", "xla"), "gpu": ("cudnn", "xla"), "cpu": ("xla",)})

ATTENTION.register(Implementation(
    "xla", xla_attention, backends=ALL_BACKENDS, dtypes=("float32", "bfloat16", "float16"),
    options=ATTENTION_OPTIONS))


def _block_choices(length: int, sizes: tuple[int, ...]) -> list[int]:
    """The block sizes worth trying along an axis of `length`: `sizes`, capped at the length."""
    return sorted({min(size, length) for size in sizes})


def _chunked_heuristic(call: BoundCall) -> AttentionConfig:
    # tokamax's fixed chunk (512 query rows, 1024 keys), shrunk to short sequences.
    T, S = call.array("query").shape[-3], call.array("key").shape[-3]
    return AttentionConfig(min(512, T), min(1024, S))


def _chunked_candidates(call: BoundCall) -> list[AttentionConfig]:
    T, S = call.array("query").shape[-3], call.array("key").shape[-3]
    return [AttentionConfig(bq, bk) for bq in _block_choices(T, (256, 512, 1024))
            for bk in _block_choices(S, (512, 1024, 2048))]


def _static_shapes(call: BoundCall) -> str | None:
    # Blocked implementations cut the sequence into tiles at trace time; a symbolic length (jax.export
    # with a symbolic batch or sequence dim) leaves that to 'xla'.
    symbolic = [name for name, spec in call.arrays if spec is not None
                and not all(isinstance(d, int) for d in spec.shape)]
    if symbolic:
        return f"needs static shapes to cut tiles, got symbolic dims in {', '.join(symbolic)}"
    return None


ATTENTION.register(Implementation(
    "xla_chunked", xla_chunked_attention, backends=ALL_BACKENDS, dtypes=("float32", "bfloat16", "float16"),
    options=ATTENTION_OPTIONS, check=_static_shapes, heuristic_config=_chunked_heuristic,
    candidate_configs=_chunked_candidates))


def _single_batch_dim_same_head_dims(call: BoundCall) -> str | None:
    query, value = call.array("query"), call.array("value")
    if len(query.shape) != 4:
        return f"needs exactly one batch dim (query [B, T, N, H]), got query of shape {query.shape}"
    if value.shape[-1] != query.shape[-1]:
        return f"needs value's head dim equal to query's, got {value.shape[-1]} and {query.shape[-1]}"
    return None


def _cudnn_attention(query, key, value, bias=None, mask=None, query_seq_lengths=None,
                     key_value_seq_lengths=None, *, scale, is_causal=False, local_window_size=None,
                     logits_soft_cap=None, config=None):
    del logits_soft_cap, config  # declined by the declaration; nothing to tune
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="cudnn")


ATTENTION.register(Implementation(
    "cudnn", _cudnn_attention, backends=("gpu",), dtypes=("bfloat16", "float16"),
    options=ATTENTION_OPTIONS - {"logits_soft_cap"}, check=_single_batch_dim_same_head_dims))

try:  # chapter 09's flash attention, when this copy of stacklib has it (tokamax does the same)
    from stacklib.kernels.flash_attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, flash_attention
except ImportError:
    flash_attention = None

if flash_attention is not None:

    def _pallas_attention(query, key, value, bias=None, mask=None, query_seq_lengths=None,
                          key_value_seq_lengths=None, *, scale, is_causal=False, local_window_size=None,
                          logits_soft_cap=None, config: AttentionConfig):
        del bias, mask, query_seq_lengths, local_window_size, logits_soft_cap  # declined by the declaration
        return flash_attention(query, key, value, is_causal=is_causal, scale=scale,
                               key_value_seq_lengths=key_value_seq_lengths,
                               block_q=config.block_q, block_k=config.block_k)

    def _pallas_heuristic(call: BoundCall) -> AttentionConfig:
        return AttentionConfig(DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K)

    def _pallas_candidates(call: BoundCall) -> list[AttentionConfig]:
        # Multiples of 8 (the TPU's sublane tile); the kernel shrinks a block to the 8-rounded sequence.
        T, S = call.array("query").shape[-3], call.array("key").shape[-3]
        return [AttentionConfig(bq, bk) for bq in _block_choices(-(-T // 8) * 8, (64, 128, 256))
                for bk in _block_choices(-(-S // 8) * 8, (64, 128, 256))]

    # A row that sees no key at all (a zero key length) gives 0 here, the mean of the values in 'xla'.
    ATTENTION.register(Implementation(
        "pallas", _pallas_attention, backends=ALL_BACKENDS, dtypes=("float32", "bfloat16"),
        options=frozenset({"is_causal", "key_value_seq_lengths"}),
        check=lambda call: _static_shapes(call) or _single_batch_dim_same_head_dims(call),
        heuristic_config=_pallas_heuristic, candidate_configs=_pallas_candidates))

# ---------------------------------------------------------------- the other ops

LAYER_NORM = Registry("layer_norm", default_order=dict.fromkeys(ALL_BACKENDS, ("xla",)))
LAYER_NORM.register(Implementation("xla", xla_layer_norm, backends=ALL_BACKENDS,
                                   dtypes=("float32", "bfloat16", "float16"),
                                   options=frozenset({"scale", "offset"})))

GATED_LINEAR_UNIT = Registry("gated_linear_unit", default_order=dict.fromkeys(ALL_BACKENDS, ("xla",)))
GATED_LINEAR_UNIT.register(Implementation("xla", xla_gated_linear_unit, backends=ALL_BACKENDS,
                                          dtypes=("float32", "bfloat16", "float16")))

# Ragged paged attention (paged_attention.py): the Pallas kernel leads only where it compiles natively.
PAGED_ATTENTION = Registry("ragged_paged_attention",
                           default_order={"tpu": ("pallas", "xla"), "gpu": ("xla",), "cpu": ("xla",)})
PAGED_ATTENTION.register(Implementation("xla", paged_attention_xla, backends=ALL_BACKENDS,
                                        dtypes=("float32", "bfloat16", "float16")))
PAGED_ATTENTION.register(Implementation("pallas", paged_attention_pallas, backends=ALL_BACKENDS,
                                        dtypes=("float32", "bfloat16")))

# ---------------------------------------------------------------- dispatch


def _dispatch(registry: Registry, call: BoundCall, used_options: Sequence[str], args: Sequence[Any],
              static: dict[str, Any], implementation: str | Sequence[str] | None) -> Any:
    """Run the first implementation that can serve the call; else raise with every reason."""
    reasons = {}
    for impl in registry.resolve(implementation, call.backend):
        reason = impl.why_not(call, used_options)
        if reason is None:
            try:
                return impl.run(*args, config=autotuning.get_config(impl, call), **static)
            except NotImplementedError as error:  # raised while tracing: a reason like any other
                reason = str(error)
        reasons[impl.name] = reason
    raise NoImplementationError(registry.op, call, reasons)


def _shape_error(message: str, **arrays: jax.Array | None) -> ValueError:
    shapes = ", ".join(f"{name} {tuple(jnp.shape(x))}" for name, x in arrays.items() if x is not None)
    return ValueError(f"{message} (got {shapes})")


def _check_attention(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                     local_window_size, logits_soft_cap) -> tuple[int, int] | None:
    """Raise a ValueError naming the argument and the fix; return the window as (before, after)."""
    qkv = dict(query=query, key=key, value=value)
    for name, x in qkv.items():
        if jnp.ndim(x) < 3:
            raise _shape_error(f"{name} must be [*B, T, N, H] (at least 3 dims); add a batch or head axis, "
                               f"e.g. {name}[None]", **qkv)
    if not key.ndim == value.ndim == query.ndim:
        raise _shape_error("query, key and value must have the same rank: [*B, T, N, H], [*B, S, K, H], "
                           "[*B, S, K, h]", **qkv)
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise _shape_error("query, key and value must have the same batch dims *B", **qkv)
    if key.shape[-1] != query.shape[-1]:
        raise _shape_error(f"key's head dim H must equal query's ({query.shape[-1]}), got {key.shape[-1]}",
                           **qkv)
    if key.shape[-3:-1] != value.shape[-3:-1]:
        raise _shape_error("key and value must have the same sequence length S and head count K", **qkv)
    N, K = query.shape[-2], key.shape[-2]
    if N % K:
        divisors = [d for d in range(1, N + 1) if N % d == 0]
        raise _shape_error(f"the query's head count N={N} must be a multiple of the key/value head count "
                           f"K={K} (grouped-query attention: each key/value head serves N/K query heads); "
                           f"e.g. repeat key and value heads, or use K in {divisors}", **qkv)
    if not query.dtype == key.dtype == value.dtype or not jnp.issubdtype(query.dtype, jnp.floating):
        raise ValueError(f"query, key and value must share one floating dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}; cast them, e.g. key.astype(query.dtype).")
    *batch, T, _, _ = query.shape
    S = key.shape[-3]
    full = (*batch, N, T, S)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        trailing = zip(x.shape[::-1], full[::-1], strict=False)  # broadcasting aligns the last dims
        if x.ndim > len(full) or any(d not in (1, f) for d, f in trailing):
            raise _shape_error(f"{name} must broadcast to [*B, N, T, S] = {list(full)}", **{name: x}, **qkv)
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got {mask.dtype}; "
                         f"pass mask.astype(bool).")
    lengths = (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths))
    for name, x in lengths:
        if x is not None and (tuple(x.shape) != tuple(batch) or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"{name} must be integers of shape *B = {tuple(batch)}, one length per example; "
                             f"got {x.dtype} of shape {tuple(x.shape)}.")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive (or None), got {logits_soft_cap!r}.")
    if local_window_size is None:
        return None
    window = (local_window_size,) * 2 if isinstance(local_window_size, int) else tuple(local_window_size)
    if len(window) != 2 or not all(isinstance(w, int) and w >= 0 for w in window):
        raise ValueError(f"local_window_size must be an int >= 0 or a pair (before, after) of them, "
                         f"got {local_window_size!r}.")
    return window


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                          scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths: jax.Array | None = None,
                          key_value_seq_lengths: jax.Array | None = None,
                          local_window_size: int | tuple[int, int] | None = None,
                          logits_soft_cap: float | None = None,
                          implementation: str | Sequence[str] | None = None) -> jax.Array:
    """Scaled dot-product attention, softmax(scale · q kᵀ + bias, masked) v, by the first able implementation.

    Args:
      query: [*B, T, N, H].
      key: [*B, S, K, H], with K dividing N (grouped-query attention).
      value: [*B, S, K, h].
      bias: added to the logits; broadcastable to [*B, N, T, S].
      mask: boolean, True where a query may attend a key; broadcastable to [*B, N, T, S].
      scale: multiplies q·k; default 1/sqrt(H).
      is_causal: query t attends only keys s <= t.
      query_seq_lengths: [*B] ints; rows t >= length attend to nothing (their output is the
        mean of the values, as in tokamax).
      key_value_seq_lengths: [*B] ints; keys s >= length are masked.
      local_window_size: w or (before, after): query t attends keys t - before .. t + after.
      logits_soft_cap: c: logits become c·tanh(logits / c) (after scale and bias).
      implementation: a name in `ATTENTION` ('xla', 'xla_chunked', 'pallas', 'cudnn'), a
        sequence of names (the first that can serve the call), or None (default order).

    Returns:
      [*B, T, N, h] in the query's dtype.

    Raises:
      ValueError: bad shapes, dtypes or options, or an unknown implementation name.
      NoImplementationError: no implementation in the list can serve the call (the message
        gives each one's reason).
    """
    window = _check_attention(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                              local_window_size, logits_soft_cap)
    arrays = dict(query=query, key=key, value=value, bias=bias, mask=mask,
                  query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
    static = dict(scale=float(1 / math.sqrt(query.shape[-1]) if scale is None else scale),
                  is_causal=bool(is_causal), local_window_size=window, logits_soft_cap=logits_soft_cap)
    used = [name for name, x in arrays.items() if x is not None and name not in ("query", "key", "value")]
    used += [name for name in ("is_causal", "local_window_size", "logits_soft_cap") if static[name]]
    call = bind("dot_product_attention", arrays, static)
    return _dispatch(ATTENTION, call, used, list(arrays.values()), static, implementation)


def layer_norm(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *, axis: int = -1,
               epsilon: float = 1e-6, scale_offset: float = 0.0, subtract_mean: bool = True,
               implementation: str | Sequence[str] | None = None) -> jax.Array:
    """LayerNorm (or RMSNorm with `subtract_mean=False`) along `axis`; see `normalization.py`.

    Args:
      x: the array to normalize.
      scale, offset: optional 1-D arrays of length `x.shape[axis]`.
      axis, epsilon, scale_offset, subtract_mean: as in `tokamax.layer_norm`.
      implementation: 'xla', a sequence of names, or None.

    Raises:
      ValueError: `axis` out of range, or `scale`/`offset` of the wrong shape.
    """
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of shape {tuple(x.shape)}; "
                         f"use -1 for the last axis.")
    for name, p in (("scale", scale), ("offset", offset)):
        if p is not None and tuple(p.shape) != (x.shape[axis],):
            raise ValueError(f"{name} must have shape ({x.shape[axis]},) = (x.shape[{axis}],) for x of shape "
                             f"{tuple(x.shape)}, got {tuple(p.shape)}.")
    static = dict(axis=axis, epsilon=epsilon, scale_offset=scale_offset, subtract_mean=subtract_mean)
    arrays = dict(x=x, scale=scale, offset=offset)
    used = [name for name in ("scale", "offset") if arrays[name] is not None]
    call = bind("layer_norm", arrays, static)
    return _dispatch(LAYER_NORM, call, used, [x, scale, offset], static, implementation)


def gated_linear_unit(x: jax.Array, weights: jax.Array | tuple[jax.Array, jax.Array], *,
                      activation: Callable[[jax.Array], jax.Array] | None = None,
                      precision: jax.lax.PrecisionLike = None,
                      implementation: str | Sequence[str] | None = None) -> jax.Array:
    """activation(x @ w_gate) * (x @ w_up); see `gated_linear_unit.py`.

    Args:
      x: [*B, M, K].
      weights: fused [K, 2, N] (gate, then up projection), or a pair of [K, N] arrays.
      activation: e.g. jax.nn.swish for SwiGLU; None for a bilinear unit.
      precision: of the matmuls, as in `jnp.matmul`.
      implementation: 'xla', a sequence of names, or None.

    Raises:
      ValueError: weights of the wrong shape for x.
    """
    K = x.shape[-1]
    if isinstance(weights, tuple | list):
        weights = tuple(weights)
        shapes = [tuple(w.shape) for w in weights]
        if len(weights) != 2 or any(len(s) != 2 or s[0] != K for s in shapes) or shapes[0] != shapes[1]:
            raise ValueError(f"unfused weights must be a pair (w_gate, w_up) of [K, N] arrays with K = "
                             f"x.shape[-1] = {K}, got shapes {shapes}.")
        arrays = dict(x=x, w_gate=weights[0], w_up=weights[1])
    else:
        if weights.ndim != 3 or weights.shape[0] != K or weights.shape[1] != 2:
            raise ValueError(f"fused weights must be [K, 2, N] with K = x.shape[-1] = {K} ([:, 0] the "
                             f"gate, [:, 1] the up projection), got {tuple(weights.shape)}; or pass "
                             f"(w_gate, w_up).")
        arrays = dict(x=x, weights=weights)
    static = dict(activation=activation, precision=precision)
    call = bind("gated_linear_unit", arrays, static)
    return _dispatch(GATED_LINEAR_UNIT, call, [], [x, weights], static, implementation)


def _concrete(x: jax.Array) -> np.ndarray | None:
    """The values of `x`, or None while tracing (value checks then wait for concrete inputs)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_paged_attention(queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc,
                           max_query_len) -> int:
    """Raise a ValueError naming the argument, the shapes and the fix; return max_query_len."""
    arrays = dict(queries=queries, key_cache=key_cache, value_cache=value_cache, kv_lens=kv_lens,
                  block_tables=block_tables, query_start_loc=query_start_loc)
    if jnp.ndim(queries) != 3:
        raise _shape_error("queries must be (T, H, D): the new tokens of every sequence, concatenated; "
                           "for a (B, T, H, D) batch pass queries.reshape(-1, H, D)", queries=queries)
    for name in ("key_cache", "value_cache"):
        if jnp.ndim(arrays[name]) != 4:
            raise _shape_error(f"{name} must be (num_blocks, block_size, K, D); a flat (slots, K, D) cache "
                               f"is {name}.reshape(-1, block_size, K, D)", **{name: arrays[name]})
    if key_cache.shape != value_cache.shape:
        raise _shape_error("key_cache and value_cache must have the same shape", key_cache=key_cache,
                           value_cache=value_cache)
    T, H, D = queries.shape
    num_blocks, block_size, K, Dk = key_cache.shape
    if Dk != D:
        raise _shape_error(f"the caches' head dim must equal the queries' D={D}, got {Dk}",
                           queries=queries, key_cache=key_cache)
    if H % K:
        divisors = [d for d in range(1, H + 1) if H % d == 0]
        raise _shape_error(f"the query head count H={H} must be a multiple of the cache's K={K} "
                           f"(grouped-query attention); use K in {divisors}",
                           queries=queries, key_cache=key_cache)
    floating = jnp.issubdtype(queries.dtype, jnp.floating)
    if not queries.dtype == key_cache.dtype == value_cache.dtype or not floating:
        raise ValueError(f"queries, key_cache and value_cache must share one floating dtype, got "
                         f"{queries.dtype}, {key_cache.dtype}, {value_cache.dtype}; cast the queries, e.g. "
                         f"queries.astype(key_cache.dtype).")
    if jnp.ndim(block_tables) != 2:
        raise _shape_error("block_tables must be (S, max_blocks_per_seq): one row of block ids per sequence",
                           block_tables=block_tables)
    S, M = block_tables.shape
    for name, shape in (("kv_lens", (S,)), ("block_tables", (S, M)), ("query_start_loc", (S + 1,))):
        x = arrays[name]
        if tuple(jnp.shape(x)) != shape or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"{name} must be integers of shape {shape} for S={S} sequences (block_tables "
                             f"{tuple(block_tables.shape)}), got {jnp.result_type(x)} of shape "
                             f"{tuple(jnp.shape(x))}.")
    if max_query_len is None:
        max_query_len = T
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len must be a positive int (the most new tokens any sequence has; "
                         f"1 when only decoding) or None for T={T}, got {max_query_len!r}.")
    tables, lens, starts = (_concrete(x) for x in (block_tables, kv_lens, query_start_loc))
    if tables is not None and tables.size and not ((tables >= 0) & (tables < num_blocks)).all():
        s, j = np.argwhere((tables < 0) | (tables >= num_blocks))[0]
        raise ValueError(f"block_tables[{s}, {j}] = {tables[s, j]} points outside the cache, which has "
                         f"num_blocks={num_blocks} (key_cache {tuple(key_cache.shape)}); fill unused "
                         f"entries with a valid block id such as 0.")
    if lens is not None and ((lens < 0) | (lens > M * block_size)).any():
        s = int(np.argmax((lens < 0) | (lens > M * block_size)))
        raise ValueError(f"kv_lens[{s}] = {lens[s]} is not within 0..{M * block_size}: block_tables "
                         f"{tuple(block_tables.shape)} covers at most {M} blocks of block_size={block_size}; "
                         f"give block_tables more columns (max_blocks_per_seq >= "
                         f"{-(-int(lens.max()) // block_size)}).")
    if starts is not None:
        q_lens = np.diff(starts)
        if starts[0] != 0 or (q_lens < 0).any() or starts[-1] > T:
            raise ValueError(f"query_start_loc must start at 0, never decrease, and end at most at the "
                             f"number of query tokens T={T} (sequence s owns tokens query_start_loc[s] "
                             f"to query_start_loc[s + 1]); got {starts.tolist()}.")
        if (q_lens > max_query_len).any():
            s = int(np.argmax(q_lens > max_query_len))
            raise ValueError(f"sequence {s} has q_len={q_lens[s]} query tokens (query_start_loc "
                             f"{starts.tolist()}), more than max_query_len={max_query_len}; pass "
                             f"max_query_len={int(q_lens.max())} or None.")
        if lens is not None and (q_lens > lens).any():
            s = int(np.argmax(q_lens > lens))
            raise ValueError(f"sequence {s} has q_len={q_lens[s]} query tokens but kv_lens[{s}] = {lens[s]}: "
                             f"kv_lens counts the new tokens too (write their keys to the cache first), so "
                             f"q_len <= kv_len.")
    return max_query_len


def ragged_paged_attention(queries: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                           kv_lens: jax.Array, block_tables: jax.Array, query_start_loc: jax.Array, *,
                           scale: float | None = None, max_query_len: int | None = None,
                           implementation: str | Sequence[str] | None = None) -> jax.Array:
    """Attention of a ragged batch of query tokens against a paged KV cache (decode and chunked prefill).

    Sequence s owns query tokens `query_start_loc[s] : query_start_loc[s + 1]` (q_len[s] of
    them; 1 to decode, more for a prefill chunk, 0 for a padding sequence) and has
    `kv_lens[s]` cached keys, the new tokens' included; its position p lives in block
    `block_tables[s, p // block_size]`, slot `p % block_size`. Query i of sequence s sits at
    position kv_lens[s] - q_len[s] + i and attends to positions <= its own:

        out[t] = Σ_p softmax_p(scale · q[t]·k[s, p]) v[s, p],   p <= kv_len[s] - q_len[s] + i

    Forward only (inference); see `paged_attention.py` for both implementations.

    Args:
      queries: (T, H, D), the new tokens of all sequences concatenated; tokens at or past
        `query_start_loc[S]` are padding and give 0.
      key_cache, value_cache: (num_blocks, block_size, K, D), H a multiple of K.
      kv_lens: (S,) ints, the keys each sequence has in the cache.
      block_tables: (S, max_blocks_per_seq) ints, each sequence's blocks in order.
      query_start_loc: (S + 1,) ints, cumulative query offsets, starting at 0.
      scale: multiplies q·k; default 1/sqrt(D).
      max_query_len: a static bound on every q_len (the queries are regrouped per sequence
        into this many rows); default T. Pass 1 for a decode-only batch.
      implementation: a name in `PAGED_ATTENTION` ('xla', 'pallas'), a sequence of names,
        or None (default order: 'pallas' then 'xla' on TPU, 'xla' elsewhere).

    Returns:
      (T, H, D) in the queries' dtype.

    Raises:
      ValueError: wrong ranks or shapes, H not a multiple of K, mismatched dtypes; and when
        the integer arguments are concrete (not traced): a block id outside the cache, a
        kv_len longer than the block table covers, query_start_loc not starting at 0,
        decreasing or past T, a q_len above kv_len or max_query_len.
      NoImplementationError: no implementation in the list can serve the call.

    Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving
    with PagedAttention", SOSP 2023; vLLM TPU's `ragged_paged_attention`.
    """
    max_query_len = _check_paged_attention(queries, key_cache, value_cache, kv_lens, block_tables,
                                           query_start_loc, max_query_len)
    arrays = dict(queries=queries, key_cache=key_cache, value_cache=value_cache, kv_lens=kv_lens,
                  block_tables=block_tables, query_start_loc=query_start_loc)
    static = dict(scale=float(1 / math.sqrt(queries.shape[-1]) if scale is None else scale),
                  max_query_len=max_query_len)
    call = bind("ragged_paged_attention", arrays, static)
    args = [jnp.asarray(x) for x in arrays.values()]
    return _dispatch(PAGED_ATTENTION, call, [], args, static, implementation)
