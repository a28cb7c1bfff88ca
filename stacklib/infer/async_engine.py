"""The bridge between the server's event loop and the engine: one thread steps, requests await.

`LLMEngine` is synchronous and not thread-safe, and a step is milliseconds of work that
must not stall the event loop serving every client. So one thread runs `step()` in a
loop (asleep while there is nothing to do), every call into the engine, from that thread
or from a request's task, holds one lock, and each step's outputs reach their request's
`asyncio.Queue` through `call_soon_threadsafe`, the safe way into an event loop from
another thread.

`add_requests` queues all the prompts of an HTTP request (a batch of prompts; `n`
completions are already one engine request) under one hold of the lock, so they enter the
same engine step and share every step after it. It is all or none
(`LLMEngine.add_requests`): when the engine refuses one prompt, the ones queued before it
are taken out before the lock is let go, and the loop never runs them.

Mirrors vLLM's `vllm/v1/engine/async_llm.py` (`AsyncLLM`: outputs as an async iterator of
`RequestOutput`s; leaving the iterator early aborts the request). Differences: a thread,
not an engine-core process behind ZeroMQ; the outputs are cumulative (vLLM's
`RequestOutputKind.CUMULATIVE`), and the server computes what is new.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator

from stacklib.infer.engine import LLMEngine
from stacklib.infer.outputs import RequestOutput
from stacklib.infer.sampling_params import SamplingParams


class AsyncEngine:
    """One thread stepping an `LLMEngine`; requests from any asyncio task join its batch.

    Attributes:
      engine: the engine; touch it only while holding the lock (`add_requests` does).
      error: the exception a step raised, if one did (every waiting request was told).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock, self._wakeup = threading.Lock(), threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-loop")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs = self.engine.step() if busy else []
                except Exception as error:  # noqa: BLE001 - every waiting client must hear of it
                    self.error = error
                    outputs = [error]
                for output in outputs:  # under the lock: a request may be leaving meanwhile
                    targets = list(self._queues) if isinstance(output, Exception) else [output.request_id]
                    for request_id in targets:
                        if request_id in self._queues:
                            loop, queue = self._queues[request_id]
                            loop.call_soon_threadsafe(queue.put_nowait, output)
                            if not isinstance(output, Exception) and output.finished:
                                del self._queues[request_id]  # delivered, even if nobody reads it
            if not busy:
                self._wakeup.wait(0.5)
                self._wakeup.clear()

    def add_requests(self, prompts: list[str | list[int]], params: SamplingParams,
                     ) -> list[AsyncIterator[RequestOutput]]:
        """Queue every prompt at once; return each one's outputs, step by step.

        Closing an iterator before its request finished aborts the request.

        Raises:
          InvalidRequestError: the engine refused a prompt; none of the prompts stays queued.
        """
        loop = asyncio.get_running_loop()
        with self._lock:  # the loop cannot step between two of them
            ids = [f"req-{next(self._ids)}" for _ in prompts]
            self.engine.add_requests([(request_id, prompt, params)
                                      for request_id, prompt in zip(ids, prompts, strict=True)])
            queues = {request_id: asyncio.Queue() for request_id in ids}
            self._queues.update({request_id: (loop, queue) for request_id, queue in queues.items()})
        self._wakeup.set()
        return [self._outputs(request_id, queue) for request_id, queue in queues.items()]

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise RuntimeError(f"the engine failed: {type(output).__name__}: {output}")
                finished = output.finished
                yield output
        finally:
            if not finished:  # the client went away, or the engine failed
                with self._lock:
                    self._queues.pop(request_id, None)
                    self.engine.abort_request(request_id)

    def close(self) -> None:
        """Stop the loop (the server is shutting down)."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(10)
