"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, and who holds which.

The KV cache is one big array of `num_blocks` blocks of `block_size` token slots each
(model_runner.py owns the array; this file owns only integers). A sequence holds a
*block table*, the list of its blocks in order, so its token at position p lives in
slot `p % block_size` of block `block_table[p // block_size]`. Blocks are allocated one
at a time as a sequence grows, so a sequence wastes less than one block, where a
contiguous cache reserves `max_model_len` slots for every sequence up front.

Prefix caching: a *full* block is named by a hash of its tokens and of the hash of
the block before it (so equal hashes mean equal prefixes, not just equal blocks). When
a new request's first full blocks have hashes the pool knows, it shares those blocks
(reference counts) instead of computing them again. A freed block keeps its hash and
its contents until the allocator hands it out again: freed blocks queue least recently
used first, so cached prefixes survive as long as the pool allows.

Block 0 is the *null block*: never handed out, it absorbs the writes of padding tokens
and fills the unused tail of every block table.

Mirrors vLLM's `vllm/v1/core/block_pool.py` and `kv_cache_manager.py` (`BlockPool`,
`KVCacheBlock`, `FreeKVCacheBlockQueue`, `hash_block_tokens`, the null block).
Differences: one KV cache group (no sliding window, no hybrid models); Python's `hash`
of a tuple instead of SHA-256 (collisions are possible in principle; vLLM offers
sha256 for that reason); no cache-hit metrics beyond two counters.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

NULL_BLOCK = 0


def hash_block_tokens(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """The name of a full block: its tokens and everything before them (via the parent's hash)."""
    return hash((parent_hash, tuple(int(t) for t in tokens)))


@dataclasses.dataclass
class KVCacheBlock:
    """One block of the pool: how many sequences use it, and its hash once it is full."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """`num_blocks` blocks (block 0 reserved), a free queue, and the prefix-cache map.

    Args:
      num_blocks: blocks in the pool, the null block included.
      enable_caching: keep full blocks findable by hash after they are freed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: the pool needs the null block and at least one more.")
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; an OrderedDict removes a cache hit in O(1).
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.hits = self.queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue, forgetting their cached contents."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} are free; the scheduler "
                             "should have checked num_free_blocks first.")
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict: its old contents are about to be overwritten
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding the full block named `block_hash`, if the pool still has it."""
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Share cached blocks with one more sequence (taking them off the free queue if idle)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def cache_full_block(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` is full and holds the tokens named `block_hash`."""
        if not self.enable_caching:
            return
        self.blocks[block_id].block_hash = block_hash
        self.cached.setdefault(block_hash, block_id)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; idle ones join the back of the free queue.

        Pass a sequence's blocks tail first (as `KVCacheManager.free` does): the tail of
        a sequence is the least likely to be shared, so it should be evicted first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None


class KVCacheManager:
    """Block tables of the running sequences, on top of a `BlockPool`.

    Args:
      num_blocks: blocks in the pool (the null block included).
      block_size: token slots per block.
      enable_caching: share full prompt blocks between requests by hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}  # hashes of each sequence's full blocks

    def _hashes(self, tokens: Sequence[int], known: list[int]) -> list[int]:
        """Hashes of the full blocks of `tokens`, extending the `known` ones."""
        hashes = list(known)
        for start in range(len(hashes) * self.block_size, len(tokens) - self.block_size + 1, self.block_size):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            tokens[start:start + self.block_size]))
        return hashes

    def get_computed_blocks(self, seq_id: str, tokens: Sequence[int]) -> list[int]:
        """The longest run of `tokens`' leading full blocks already in the pool.

        At least one token is always left to compute: its logits choose the next token.
        """
        hashes = self._hashes(tokens, self.block_hashes.get(seq_id, []))
        self.block_hashes[seq_id] = hashes
        hits = []
        for block_hash in hashes[: (len(tokens) - 1) // self.block_size]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.pool.queries += 1
        self.pool.hits += bool(hits)
        return hits

    def blocks_needed(self, num_tokens: int, num_computed_blocks: int = 0) -> int:
        """New blocks for a sequence of `num_tokens`, of which the first blocks are cached."""
        return -(-num_tokens // self.block_size) - num_computed_blocks

    def can_allocate(self, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        # Cache hits that sit idle in the free queue are taken from it too.
        idle_hits = sum(self.pool.blocks[b].ref_cnt == 0 for b in computed_blocks)
        return self.blocks_needed(num_tokens, len(computed_blocks)) + idle_hits <= self.pool.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> list[int]:
        """Give `seq_id` a block table for `num_tokens` tokens, reusing `computed_blocks`."""
        self.pool.touch(computed_blocks)
        new = self.pool.get_new_blocks(self.blocks_needed(num_tokens, len(computed_blocks)))
        self.block_tables[seq_id] = list(computed_blocks) + new
        return self.block_tables[seq_id]

    def append_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens of a sequence: all the blocks that takes, or none (False)."""
        table = self.block_tables[seq_id]
        needed = self.blocks_needed(num_tokens, len(table))
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.get_new_blocks(needed))
        return True

    def cache_blocks(self, seq_id: str, computed_tokens: Sequence[int]) -> None:
        """Name the sequence's blocks whose every slot holds a computed key and value.

        `computed_tokens` are the sequence's tokens whose keys and values are in the cache.
        The sequence may know the hashes of more full blocks (`get_computed_blocks` hashed its
        whole prompt), but a block a prefill chunk has only partly written must not be named:
        a request that finds it would start past tokens nobody computed, and if this sequence
        is aborted or preempted now, nobody ever will. (vLLM's `cache_full_blocks` rule.)
        """
        hashes = self._hashes(computed_tokens, self.block_hashes.get(seq_id, []))
        self.block_hashes[seq_id] = hashes
        num_full = len(computed_tokens) // self.block_size
        for block_id, block_hash in zip(self.block_tables[seq_id][:num_full], hashes[:num_full], strict=True):
            if self.pool.blocks[block_id].block_hash is None:
                self.pool.cache_full_block(block_id, block_hash)

    def free(self, seq_id: str) -> None:
        """Release a finished or preempted sequence's blocks, tail first."""
        self.pool.free_blocks(reversed(self.block_tables.pop(seq_id, [])))
        self.block_hashes.pop(seq_id, None)

    def num_used_slots(self) -> int:
        """Token slots held by running sequences (shared blocks counted once)."""
        used = {b for table in self.block_tables.values() for b in table}
        return len(used) * self.block_size
