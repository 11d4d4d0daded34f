"""A dynamic batcher for engines that generate one batch at a time (the embedded engine, the
in-process SGLang engine).

Callers submit requests from any thread and get a future. One worker thread runs batches:
whatever is waiting when a batch ends forms the next one, up to a token budget (a request
alone above the budget still runs, alone). When the engine is idle the first request waits a
few milliseconds for the ones sent right after it (the agents send a group's requests one by
one), so a group becomes one batch. Requests cancelled while queued are dropped. Weight
updates and scoring run between batches (:meth:`exclusive`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections import deque
from typing import Callable

from megatron_marsrl.rollout.engine import EngineOutput, EngineRequest, EngineUnavailableError


@dataclasses.dataclass
class _Job:
    requests: list[EngineRequest]
    future: concurrent.futures.Future
    on_start: Callable[[], None] | None

    @property
    def tokens(self) -> int:
        return sum(len(r.prompt_ids) + r.sampling.max_new_tokens for r in self.requests)


class DynamicBatcher:
    """Runs ``run_batch(requests) -> outputs`` on batches of the requests submitted."""

    def __init__(self, run_batch: Callable[[list[EngineRequest]], list[EngineOutput]], *, token_budget: int,
                 gather_s: float = 0.01, name: str = "engine"):
        if token_budget < 1:
            raise ValueError(f"token_budget={token_budget}: must be >= 1")
        self._run_batch, self.token_budget, self.gather_s = run_batch, token_budget, gather_s
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()  # a batch, a weight update or a score: one at a time
        self._closed = False
        self.batch_sizes: deque[int] = deque(maxlen=10000)
        """Requests per batch, for the latest batches (tests and benchmarks)."""
        self._worker = threading.Thread(target=self._loop, name=f"{name}-batcher", daemon=True)
        self._worker.start()

    def submit(self, requests: list[EngineRequest], *,
               on_start: Callable[[], None] | None = None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise EngineUnavailableError("the engine was shut down")
            self._queue.append(_Job(list(requests), future, on_start))
            self._cond.notify()
        return future

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the engine between batches (weight updates, scoring)."""
        with self._engine_lock:
            yield

    def close(self) -> None:
        """Stop the worker after its current batch; queued requests fail as unavailable."""
        with self._cond:
            self._closed = True
            left, self._queue = list(self._queue), deque()
            self._cond.notify()
        for job in left:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(EngineUnavailableError("the engine was shut down"))
        if self._worker is not threading.current_thread():
            self._worker.join(timeout=60)

    def _next_batch(self) -> list[_Job] | None:
        with self._cond:
            idle = not self._queue
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            if idle and self.gather_s:  # let the requests sent right after this one join it
                deadline = time.monotonic() + self.gather_s
                while (left := deadline - time.monotonic()) > 0 and not self._closed:
                    self._cond.wait(left)
            jobs, tokens = [], 0
            while self._queue and (not jobs or tokens + self._queue[0].tokens <= self.token_budget):
                job = self._queue.popleft()
                if job.future.set_running_or_notify_cancel():  # False: cancelled while queued
                    jobs.append(job)
                    tokens += job.tokens
            return jobs

    def _loop(self) -> None:
        while (jobs := self._next_batch()) is not None:
            if not jobs:
                continue
            for job in jobs:
                if job.on_start is not None:
                    job.on_start()
            requests = [r for job in jobs for r in job.requests]
            try:
                with self._engine_lock:
                    outputs = self._run_batch(requests)
            except Exception as exc:  # every caller of the batch gets the error
                for job in jobs:
                    job.future.set_exception(exc)
                continue
            self.batch_sizes.append(len(requests))
            start = 0
            for job in jobs:
                job.future.set_result(outputs[start: start + len(job.requests)])
                start += len(job.requests)


class BatchedEngine:
    """Base of the engines that run one batch at a time behind a :class:`DynamicBatcher`.
    Subclasses create ``self._batcher`` over their ``_run_batch`` and define
    ``_check_request`` (raises ValueError naming what is wrong with a request)."""

    _batcher: DynamicBatcher

    def _check_request(self, req: EngineRequest) -> None:
        raise NotImplementedError

    def submit(self, requests: list[EngineRequest], *,
               on_start: Callable[[], None] | None = None) -> concurrent.futures.Future:
        for req in requests:
            self._check_request(req)
        return self._batcher.submit(requests, on_start=on_start)

    def generate(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        return self.submit(requests).result()

    @property
    def batch_sizes(self) -> deque[int]:
        """Requests per batch of the latest batches."""
        return self._batcher.batch_sizes
