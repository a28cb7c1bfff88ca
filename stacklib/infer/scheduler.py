"""Continuous batching with chunked prefill: which tokens of which sequences run in the next step.

A step has a budget of `max_num_batched_tokens` tokens. Each step the scheduler
  1. gives every running sequence its next tokens: one to decode, or the next chunk of a
     prompt still being pre-filled (as many as the budget has left). When the pool has no
     free block for them, it *preempts* the most recently admitted running sequence:
     frees its blocks and puts it back at the front of the queue, to be recomputed later
     from its prompt and the tokens it had generated (preemption by recomputation);
  2. admits waiting sequences, oldest first, while `max_num_seqs`, the budget and the free
     blocks allow (none after a preemption in the same step: the pool is full), each with
     as much of its prompt as the budget has left, after the blocks a prefix cache hit
     already holds.
So one step mixes decodes and prefill chunks, and a long prompt is pre-filled over several
steps without holding up the sequences that are decoding. When the engine reports what a
step computed (`update_from_output`), the scheduler advances each sequence; a sequence
whose tokens are all computed gets its sampled token, and the scheduler checks its stop
rules (end of text, a stop token, `max_tokens`, the context length; the engine checks stop
*strings*, which need the detokenized text). A finished sequence leaves at once: its slot
is taken in the very next step, so the batch never waits for its longest member, which is
static batching's waste. The scheduler owns the KV-cache manager it allocates from.

Mirrors vLLM's `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule` with its token
budget and `num_computed_tokens`, `update_from_output`, FCFS policy, recompute
preemption) and `check_stop` (`sched/utils.py`). Differences: no priorities, no
speculative decoding, no limit on how many long prompts are chunked at once.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Collection

import numpy as np

from stacklib.infer.block_pool import KVCacheManager
from stacklib.infer.config import EngineConfig
from stacklib.infer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """One completion being generated: its tokens and its place in the engine."""

    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache on admission
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work: each scheduled sequence with its number of new tokens, and who was preempted.

    Sequence `seq` runs its tokens `num_computed_tokens .. num_computed_tokens + n - 1`;
    it samples a token only if that reaches its last token (a prefill chunk that does not
    finish the prompt samples nothing).
    """

    scheduled: list[tuple[Sequence, int]]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def check_stop(seq: Sequence, eos_token_ids: Collection[int], max_model_len: int,
               ) -> tuple[str, int | None] | None:
    """Why `seq` stops after its latest token: ("stop", the stop token or None), ("length", None), or None.

    Any of `eos_token_ids` is an end of text (stop reason None, as vLLM reports EOS).
    """
    params, token, n = seq.params, seq.output_token_ids[-1], len(seq.output_token_ids)
    if n >= params.min_tokens:
        if token in eos_token_ids and not params.ignore_eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
    if n == params.max_tokens or seq.num_tokens >= max_model_len:
        return "length", None
    return None


class Scheduler:
    """First come, first served continuous batching over the `KVCacheManager` it owns.

    Args:
      config: the engine's settings, resolved for the model (`EngineConfig.resolve`).
      eos_token_ids: the tokenizer's end-of-text ids (a stop rule: any of them ends a sequence).
    """

    def __init__(self, config: EngineConfig, eos_token_ids: Collection[int]):
        self.kv_cache = KVCacheManager(config.num_gpu_blocks_override, config.block_size,
                                       config.enable_prefix_caching)
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.max_model_len, self.eos_token_ids = config.max_model_len, frozenset(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq.seq_id)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        queue, running, scheduled, preempted = list(self.running), [], [], []
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)  # 1 to decode; else a prompt chunk
            while not self.kv_cache.append_slots(seq.seq_id, seq.num_computed_tokens + n):
                victim = queue.pop() if queue else seq  # the latest admitted goes back first
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                running.append(seq)
                scheduled.append((seq, n))
                budget -= n
        self.running = running + queue  # the budget ran out before these: they wait a step
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            computed = self.kv_cache.get_computed_blocks(seq.seq_id, seq.tokens)
            num_cached = len(computed) * self.kv_cache.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.kv_cache.can_allocate(num_cached + n, computed):
                break
            self.kv_cache.allocate(seq.seq_id, num_cached + n, computed)
            self.waiting.popleft()
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def update_from_output(self, seq: Sequence, num_new: int,
                           token: int | None) -> tuple[str, int | None] | None:
        """Record that `num_new` of seq's tokens were computed, and its sampled `token` if it has one.

        Returns why seq stopped (see `check_stop`), having finished it, or None.
        """
        seq.num_computed_tokens += num_new
        # The computed full blocks become shareable prefixes.
        self.kv_cache.cache_blocks(seq.seq_id, seq.tokens[:seq.num_computed_tokens])
        if token is None:  # a prompt chunk: more of the prompt to go
            return None
        seq.output_token_ids.append(token)  # its keys and values are written by the next step
        stop = check_stop(seq, self.eos_token_ids, self.max_model_len)
        if stop is not None:
            self.finish(seq)
        return stop

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        self.kv_cache.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
