"""Continuous batching: which sequences run in the next step.

Each step the scheduler
  1. gives every running sequence a slot for its next token; when the pool has no free
     block, it *preempts* the most recently admitted running sequence: frees its blocks
     and puts it back at the front of the queue, to be recomputed later from its prompt
     and the tokens it had generated (preemption by recomputation);
  2. admits waiting sequences, oldest first, while `max_num_seqs`, the step's token
     budget `max_num_batched_tokens` and the free blocks allow (none after a
     preemption in the same step: the pool is full).
Admitted sequences are pre-filled this step; the running ones decode one token. When the
engine reports a sequence's new token (`update_from_output`), the scheduler checks its stop
rules (end of text, a stop token, `max_tokens`, the context length; the engine checks stop
*strings*, which need the detokenized text) and a finished sequence leaves at once: its
slot is taken in the very next step, so the batch never waits for its longest member,
which is static batching's waste. The scheduler owns the KV-cache manager it allocates
from.

Mirrors vLLM's `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`,
`update_from_output`, FCFS policy, recompute preemption) and `check_stop` (`sched/utils.py`).
Differences: no chunked prefill (a prompt is pre-filled in one step, so
`max_num_batched_tokens` must be at least `max_model_len`); prefill and decode are separate
calls; no priorities, no speculative decoding.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

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
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work: prompts to pre-fill (with their cached token count) and sequences to decode."""

    prefills: list[tuple[Sequence, int]]
    decodes: list[Sequence]
    preempted: list[Sequence]


def check_stop(seq: Sequence, eos_id: int, max_model_len: int) -> tuple[str, int | None] | None:
    """Why `seq` stops after its latest token: ("stop", the stop token or None), ("length", None), or None."""
    params, token, n = seq.params, seq.output_token_ids[-1], len(seq.output_token_ids)
    if n >= params.min_tokens:
        if token == eos_id and not params.ignore_eos:
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
      eos_id: the tokenizer's end-of-text id (a stop rule).
    """

    def __init__(self, config: EngineConfig, eos_id: int):
        self.kv_cache = KVCacheManager(config.num_gpu_blocks_override, config.block_size,
                                       config.enable_prefix_caching)
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.max_model_len, self.eos_id = config.max_model_len, eos_id
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        queue, decodes, preempted = list(self.running), [], []
        while queue:
            seq = queue.pop(0)
            while not self.kv_cache.append_slot(seq.seq_id, seq.num_tokens):
                victim = queue.pop() if queue else seq  # the latest admitted goes back first
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                decodes.append(seq)
                budget -= 1
        self.running = list(decodes)
        prefills = []
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed = self.kv_cache.get_computed_blocks(seq.seq_id, seq.tokens)
            num_cached = len(computed) * self.kv_cache.block_size
            fits = self.kv_cache.can_allocate(seq.num_tokens, computed)
            if seq.num_tokens - num_cached > budget or not fits:
                break
            self.kv_cache.allocate(seq.seq_id, seq.num_tokens, computed)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append((seq, num_cached))
            budget -= seq.num_tokens - num_cached
        return SchedulerOutput(prefills, decodes, preempted)

    def update_from_output(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """Record `seq`'s new token; if a stop rule says so, finish it and return why (see `check_stop`)."""
        self.kv_cache.cache_blocks(seq.seq_id, seq.tokens)  # the computed full blocks become shareable
        seq.output_token_ids.append(token)  # its keys and values are written by the next step
        stop = check_stop(seq, self.eos_id, self.max_model_len)
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
