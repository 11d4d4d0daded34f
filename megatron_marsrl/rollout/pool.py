"""Several rollout engines behind one async interface.

- Load balancing: each request goes to the usable engine with the fewest requests in flight.
- Failure: a request that fails on an engine (connection lost, engine error, timeout) is
  retried on another one, up to ``max_attempts``; it is never dropped silently: either it
  returns or :class:`RequestFailedError` names it with every attempt's error.
- Recovery: an engine whose process died is restarted in the background; it rejoins only
  once its weights are current again (its version equals the pool's, e.g. after the next
  :meth:`update_weights`), so no sample comes from stale weights.
- Bounded concurrency, per-request timeouts, and :meth:`abort` of everything in flight.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from megatron_marsrl.rollout.engine import EngineOutput, EngineRequest

log = logging.getLogger(__name__)

RETRYABLE = (ConnectionError, TimeoutError, OSError, RuntimeError)


class RequestFailedError(RuntimeError):
    """A request failed on every attempt."""


@dataclasses.dataclass
class _Slot:
    engine: object
    inflight: int = 0
    restarting: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class EnginePool:
    def __init__(self, engines: list, *, max_concurrency: int = 64, request_timeout: float = 600.0,
                 max_attempts: int = 3, wait_for_engine: float = 600.0):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self._slots = [_Slot(e) for e in engines]
        self._sem = asyncio.Semaphore(max_concurrency)
        self.request_timeout = request_timeout
        self.max_attempts = max_attempts
        self.wait_for_engine = wait_for_engine
        self.version = 0
        self.failures: list[dict] = []
        self._tasks: set[asyncio.Task] = set()

    # ---- routing -----------------------------------------------------------------------
    def _usable(self, slot: _Slot) -> bool:
        alive = getattr(slot.engine, "alive", lambda: True)()
        return alive and not slot.restarting and slot.engine.weight_version == self.version

    async def _pick(self, avoid: set[int]) -> int:
        deadline = asyncio.get_running_loop().time() + self.wait_for_engine
        while True:
            usable = [i for i, s in enumerate(self._slots) if self._usable(s)]
            preferred = [i for i in usable if i not in avoid] or usable
            if preferred:
                return min(preferred, key=lambda i: self._slots[i].inflight)
            if asyncio.get_running_loop().time() > deadline:
                raise RequestFailedError(f"no usable engine for {self.wait_for_engine:.0f} s")
            await asyncio.sleep(0.2)

    def _call(self, slot: _Slot, request: EngineRequest) -> EngineOutput:
        with slot.lock:  # engines are not thread-safe; one call per engine at a time
            return slot.engine.generate([request])[0]

    async def generate(self, request: EngineRequest) -> EngineOutput:
        task = asyncio.current_task()
        self._tasks.add(task)  # so that abort() cancels direct callers too
        try:
            return await self._generate(request)
        finally:
            self._tasks.discard(task)

    async def _generate(self, request: EngineRequest) -> EngineOutput:
        async with self._sem:
            errors, tried = [], set()
            for attempt in range(self.max_attempts):
                idx = await self._pick(tried)
                slot = self._slots[idx]
                slot.inflight += 1
                try:
                    return await asyncio.wait_for(asyncio.to_thread(self._call, slot, request), self.request_timeout)
                except (*RETRYABLE, asyncio.TimeoutError) as exc:
                    errors.append(f"engine {idx}: {type(exc).__name__}: {exc}")
                    self.failures.append({"rid": request.rid, "engine": idx, "attempt": attempt, "error": str(exc)})
                    tried.add(idx)
                    self._recover(idx)
                finally:
                    slot.inflight -= 1
            raise RequestFailedError(f"request {request.rid!r} failed {self.max_attempts} times: " + "; ".join(errors))

    async def generate_many(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        tasks = [asyncio.create_task(self.generate(r)) for r in requests]
        self._tasks.update(tasks)
        try:
            return await asyncio.gather(*tasks)
        finally:
            self._tasks.difference_update(tasks)

    def abort(self) -> int:
        """Cancel every request in flight, here and on the engines that support it
        (``abort_all``); returns how many requests were cancelled."""
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        for slot in self._slots:
            if hasattr(slot.engine, "abort_all"):
                slot.engine.abort_all()
        return len(pending)

    # ---- recovery and weights ----------------------------------------------------------
    def _recover(self, idx: int) -> None:
        slot = self._slots[idx]
        engine = slot.engine
        if slot.restarting or getattr(engine, "alive", lambda: True)() or not hasattr(engine, "restart"):
            return
        slot.restarting = True
        log.warning("engine %d died; restarting it in the background", idx)

        def restart():
            try:
                engine.restart()
            finally:
                slot.restarting = False

        threading.Thread(target=restart, daemon=True).start()

    def update_weights(self, buckets, *, version: int) -> int:
        """Apply each bucket to every live engine; bumps the pool's version."""
        live = [s for s in self._slots if getattr(s.engine, "alive", lambda: True)() and not s.restarting]
        applied = 0
        for bucket in buckets:
            for slot in live:
                with slot.lock:
                    applied += slot.engine.update_weights([bucket], version=version)
        self.version = version
        return applied

    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of tokens[1:] from the first usable engine (the weight-sync probe)."""
        usable = [s for s in self._slots if self._usable(s)]
        if not usable:
            raise RequestFailedError("no usable engine to score the probe")
        with usable[0].lock:
            return usable[0].engine.score(sequences, temperature=temperature)

    def shutdown(self) -> None:
        for slot in self._slots:
            slot.engine.shutdown()
