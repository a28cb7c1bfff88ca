"""What a block costs: its VMEM footprint, and the HBM traffic and FLOPs of a blocked kernel.

A TPU core computes only on data in VMEM, a small on-chip memory (16 MiB scoped by default on
v4/v5e, 32 MiB on v6e, of 64-128 MiB physical). Pallas copies each operand's block from HBM
into VMEM, and *pipelines* the copies: while the kernel works on block i, the DMA engine
fetches block i + 1 into a second buffer (double buffering). So every input and output
block costs two buffers, scratch one:

    footprint = 2 * sum(block bytes of inputs and outputs) + sum(scratch bytes)

and a block's bytes are counted in whole (8, 128) tiles of 32-bit words: the last axis is
padded to a multiple of 128 lanes and the second-to-last to 8 sublanes (16 for 16-bit
types, which pack two to a word). A (128, 1) float32 block occupies 128 x 128 x 4 bytes.

The counts (`KernelCost`) are what a roofline needs: FLOPs, bytes moved between HBM and VMEM,
and their ratio, the arithmetic intensity. For blocked kernels the bytes depend on the
block sizes, because an operand is re-read once per block of the other operand: bigger
blocks, fewer re-reads, higher intensity, until the blocks no longer fit in VMEM.

Differences from Pallas: Pallas computes footprints inside Mosaic and reports "exceeds
scoped VMEM limit" at compile time; we count before any kernel runs, with the same rule,
so the error can name the block argument and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp

TPU_VMEM_BYTES = 16 * 2**20  # the default scoped VMEM limit on TPU v4 / v5e
LANES = 128
SUBLANES = 8


def tile_shape(shape: Sequence[int | None], dtype) -> tuple[int, ...]:
    """The shape a block occupies in VMEM: squeezed (None) axes dropped, the last two padded to tiles."""
    dims = [d for d in shape if d is not None]
    if not dims:
        return ()
    sublanes = SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)  # bf16: 16 rows per tile
    dims[-1] = -(-dims[-1] // LANES) * LANES
    if len(dims) >= 2:
        dims[-2] = -(-dims[-2] // sublanes) * sublanes
    return tuple(dims)


def block_bytes(shape: Sequence[int | None], dtype) -> int:
    """Bytes one buffer of this block occupies in VMEM (tile-padded)."""
    return math.prod(tile_shape(shape, dtype)) * jnp.dtype(dtype).itemsize


def vmem_footprint(blocks: Sequence[tuple[Sequence[int | None], object]],
                   scratch: Sequence[tuple[Sequence[int | None], object]] = (), *, buffers: int = 2) -> int:
    """VMEM bytes a kernel needs: `buffers` copies of each (shape, dtype) block, one of each scratch."""
    return (buffers * sum(block_bytes(shape, dtype) for shape, dtype in blocks)
            + sum(block_bytes(shape, dtype) for shape, dtype in scratch))


def check_fits_vmem(what: str, footprint: int, limit: int = TPU_VMEM_BYTES) -> None:
    """Raise a ValueError naming `what` (the block arguments) when `footprint` exceeds `limit`."""
    if footprint > limit:
        raise ValueError(
            f"{what} need {footprint / 2**20:.1f} MiB of VMEM (double-buffered blocks plus scratch), "
            f"more than the {limit / 2**20:.0f} MiB a TPU core gives a kernel. Use smaller blocks."
        )


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """FLOPs and HBM bytes of one kernel call; `intensity` is FLOPs per byte."""

    flops: float
    bytes_accessed: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_accessed


def matmul_cost(M: int, N: int, K: int, *, block_m: int, block_n: int, itemsize: int = 4) -> KernelCost:
    """A tiled [M, K] @ [K, N]: x is re-read for every column block, y for every row block.

    bytes = itemsize * (M*K * N/block_n + K*N * M/block_m + M*N); flops = 2*M*N*K.
    """
    reads = M * K * math.ceil(N / block_n) + K * N * math.ceil(M / block_m)
    return KernelCost(2.0 * M * N * K, float(itemsize * (reads + M * N)))


def rowwise_cost(rows: int, cols: int, *, flops_per_element: float, inputs: int = 1,
                 itemsize: int = 4) -> KernelCost:
    """A fused row-wise or elementwise kernel: each input read once, one output written once."""
    return KernelCost(flops_per_element * rows * cols, float(itemsize * rows * cols * (inputs + 1)))


def live_blocks(T: int, S: int, *, block_q: int, block_k: int, is_causal: bool) -> int:
    """How many (query block, key block) pairs flash attention computes (the rest are skipped)."""
    nq, nk = math.ceil(T / block_q), math.ceil(S / block_k)
    if not is_causal:
        return nq * nk
    # Key block j is live for query block i when j * block_k <= i * block_q + block_q - 1.
    return sum(min(nk, (i * block_q + block_q - 1) // block_k + 1) for i in range(nq))


def flash_attention_cost(B: int, T: int, S: int, N: int, K: int, H: int, *, block_q: int, block_k: int,
                         is_causal: bool = False, itemsize: int = 4) -> KernelCost:
    """The forward kernel: 4*H FLOPs per live logit (q k^T and p v); k, v re-read per query block.

    bytes = itemsize * (2*B*N*T*H  [q in, out]  + 2*B*N*live*block_k*H  [k, v per live block])
    """
    live = live_blocks(T, S, block_q=block_q, block_k=block_k, is_causal=is_causal)
    flops = 4.0 * B * N * live * block_q * block_k * H
    nbytes = itemsize * (2 * B * N * T * H + 2 * B * N * live * block_k * H)
    return KernelCost(flops, float(nbytes))
