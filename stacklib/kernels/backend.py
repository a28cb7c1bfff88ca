"""How our Pallas kernels run here: natively, in the generic interpreter, or in TPU interpret mode.

Every kernel in `stacklib.kernels` takes `interpret=None | bool | pltpu.InterpretParams` and
hands it to `resolve_interpret`, the one switch:

* `None` (the default) asks `stacklib.hw` which backend this is. On a TPU the kernels are
  compiled natively by Mosaic. Everywhere else they run in Pallas's *generic interpreter*
  (`interpret=True`): the kernel body is evaluated as ordinary JAX operations, one grid
  step after another, which is exact and fast enough for tests.
* `True` / `False` force the interpreter / native compilation.
* a `pltpu.InterpretParams(...)` selects *TPU interpret mode*: it emulates VMEM, SMEM and
  the DMAs between them and HBM, and can detect races and out-of-bounds reads, at about
  12 ms a grid step on a laptop CPU. Tests use it on small grids.

Our kernels are TPU-style: they accumulate across a sequential ("arbitrary") grid axis in
scratch memory. GPU Pallas (Triton, Mosaic GPU) runs grid steps in parallel and has no such
scratch, so a GPU needs GPU-style variants (a loop over the reduction inside the kernel);
we have not written them, so on a GPU `None` also means the interpreter.

`pallas_call` here is `pl.pallas_call` plus a record of each call (name, grid, block
shapes) for whoever listens through `record_calls()`: that is how tests prove that the
block sizes a caller (or an autotuner) chose reach the backward pass as well as the forward.

Differences from Pallas: none in behaviour; the recording is ours (JAX has no such hook).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import stacklib.hw


def native_backend() -> str | None:
    """The backend on which our kernels compile natively ('tpu'), or None (interpret)."""
    backend = stacklib.hw.describe().backend
    return backend if backend == "tpu" else None


def resolve_interpret(interpret: Any = None) -> Any:
    """Turn a kernel's `interpret` argument into what `pl.pallas_call` expects.

    Raises:
      TypeError: `interpret` is not None, a bool or a `pltpu.InterpretParams`.
    """
    if interpret is None:
        return native_backend() is None
    if isinstance(interpret, bool | pltpu.InterpretParams):
        return interpret
    raise TypeError(
        f"interpret must be None (decide from stacklib.hw), True, False or a "
        f"pltpu.InterpretParams(), got {interpret!r}."
    )


def tpu_params(*dimension_semantics: str) -> pltpu.CompilerParams:
    """Mosaic's compiler parameters: which grid axes may run in parallel (megacore)."""
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One `pallas_call` as traced: its name, grid and the block shape of every operand."""

    name: str
    grid: tuple[int, ...]
    in_blocks: tuple[tuple | None, ...]
    out_blocks: tuple[tuple | None, ...]
    interpret: Any


_RECORDERS: list[list[KernelCall]] = []


@contextlib.contextmanager
def record_calls() -> Iterator[list[KernelCall]]:
    """Collect a `KernelCall` for every kernel traced inside the `with` block.

    Recording happens when a kernel is *traced*; a call that hits `jax.jit`'s cache is not
    traced again and so is not recorded.
    """
    calls: list[KernelCall] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def _block_shape(spec: Any) -> tuple | None:
    shape = getattr(spec, "block_shape", None)
    return None if shape is None else tuple(shape)


def pallas_call(kernel: Callable, *, name: str, out_shape: Any, grid: tuple[int, ...],
                in_specs: Sequence[pl.BlockSpec], out_specs: Any,
                scratch_shapes: Sequence[Any] = (), dimension_semantics: Sequence[str] | None = None,
                interpret: Any = None) -> Callable:
    """`pl.pallas_call` with our interpret switch, Mosaic's grid semantics, and a record."""
    interpret = resolve_interpret(interpret)
    outs = out_specs if isinstance(out_specs, list | tuple) else [out_specs]
    call = KernelCall(name, tuple(grid), tuple(_block_shape(s) for s in in_specs),
                      tuple(_block_shape(s) for s in outs), interpret)
    for calls in _RECORDERS:
        calls.append(call)
    params = tpu_params(*dimension_semantics) if dimension_semantics else None
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=list(in_specs), out_specs=out_specs,
        scratch_shapes=list(scratch_shapes), compiler_params=params, interpret=interpret, name=name,
    )


def check_block(name: str, block: Any, *, multiple_of: int = 8) -> int:
    """Validate a block-size argument: a positive int, a multiple of `multiple_of`.

    TPU vector registers hold (8, 128) tiles of 32-bit values, so a block's second-to-last
    dimension must be a multiple of 8 (and its last a multiple of 128, or the full axis).

    Raises:
      ValueError: naming the argument and the fix.
    """
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % multiple_of:
        raise ValueError(
            f"{name} must be a positive multiple of {multiple_of} (the TPU's sublane tile), "
            f"got {block!r}. Pass e.g. {name}={max(multiple_of, 128)}."
        )
    return block


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def check_dtype(name: str, x: jax.Array, allowed: Sequence[Any]) -> None:
    """Raise a ValueError naming `name`, its dtype and the supported ones."""
    if x.dtype not in [jax.numpy.dtype(d) for d in allowed]:
        names = ", ".join(jax.numpy.dtype(d).name for d in allowed)
        raise ValueError(
            f"{name} has dtype {x.dtype.name} (shape {tuple(x.shape)}); this kernel supports "
            f"{names}. Cast it first, e.g. {name}.astype(jnp.float32)."
        )
