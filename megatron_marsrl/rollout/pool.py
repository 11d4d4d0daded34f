"""Several rollout engines behind one async interface.

- Concurrency: requests go to the engines as they come, many at a time; engines batch them
  (SGLang's continuous batching, our dynamic batcher for the one-batch-at-a-time engines).
- Load balancing: each request goes to the usable engine with the fewest requests in flight.
- Failure: a request whose engine is gone (connection lost, process died) or that timed out
  is retried on another one, up to ``max_attempts`` (on the same one after a pause, where no
  other is usable); it is never dropped silently: either it returns or
  :class:`RequestFailedError` names it with every attempt's error. An error the
  engine raised while working on the request (a programming or model error) is not retried:
  it would fail the same way everywhere.
- Timeouts (:class:`GenerationTimeout`) scale with ``max_new_tokens`` and count from the moment
  the engine starts the request: waiting for the engine's capacity does not count.
- Recovery: an engine whose process died is restarted in the background; it rejoins only
  once its weights are current again (its version equals the pool's, e.g. after the next
  :meth:`update_weights`), so no sample comes from stale weights. When every engine is dead
  or restarting after the first update, no engine can serve the current weights before the
  next update (a restart brings back the initial weights): requests fail at once instead of
  waiting ``wait_for_engine``, so the trainer aborts the step and a resume redoes it.
- Bounded concurrency, per-request timeouts, and :meth:`abort` of everything in flight.
- Weights: an engine next to the trainer rank that exports them takes each bucket from it
  directly (shared memory / CUDA IPC); engines on other GPUs or nodes (another node's engines,
  the split placement) receive it by broadcast over a process group with that rank
  (rollout/weight_sync.py; NCCL on GPU, gloo on CPU).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading

from megatron_marsrl.rollout.engine import EngineOutput, EngineRequest, EngineUnavailableError, GenerationTimeout

log = logging.getLogger(__name__)

RETRYABLE = (ConnectionError, TimeoutError)
"""The engine is gone or too slow; anything else the engine raised is about the request."""


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What SGLang's memory saver releases and resumes (release/resume_memory_occupation tags)."""


class RequestFailedError(RuntimeError):
    """A request failed on every attempt."""


@dataclasses.dataclass
class _Slot:
    engine: object
    by_broadcast: bool = False
    """Weights reach it by broadcast (an SGLang server away from the exporting rank)."""
    inflight: int = 0
    restarting: bool = False
    served: int = 0
    """Requests it answered."""


# Seconds before a retry that can only go back to an engine that already failed the request
# (doubled at each attempt): a server killed mid-request refuses connections a moment before
# its process is seen to exit (measured on a loaded 2-core machine: three refusals in a row),
# and retrying at once would spend every attempt on it before the pool notices and restarts it.
RETRY_PAUSE = 0.5


class EnginePool:
    def __init__(self, engines: list, *, max_concurrency: int = 1024, timeout: GenerationTimeout | None = None,
                 max_attempts: int = 3, wait_for_engine: float = 600.0, by_broadcast: bool = False):
        """``max_concurrency``: requests in flight over all engines (the engines batch them;
        `add_engines` raises it in proportion).
        ``wait_for_engine``: how long a request may wait for a usable engine (all dead or
        restarting). ``by_broadcast``: these engines receive weights by broadcast (SGLang servers)."""
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self._slots = [_Slot(e, by_broadcast=by_broadcast) for e in engines]
        self._per_engine = max(1, max_concurrency // len(engines))
        self._sem = asyncio.Semaphore(max_concurrency)
        self._sender = None  # the broadcast group, built on the first update that needs it
        self._groups = itertools.count()  # a new name for every broadcast group built
        self.timeout = timeout or GenerationTimeout()
        self.max_attempts = max_attempts
        self.wait_for_engine = wait_for_engine
        self.version = 0
        self.failures: list[dict] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def engines(self) -> list:
        return [slot.engine for slot in self._slots]

    def served(self) -> list[int]:
        """Requests each engine answered so far, in pool order."""
        return [slot.served for slot in self._slots]

    def add_engines(self, engines: list, *, by_broadcast: bool) -> None:
        """Engines that joined after the pool was built (other nodes' servers); before the first
        request (the concurrency limit is replaced). They take part from the next weight update."""
        self._slots += [_Slot(e, by_broadcast=by_broadcast) for e in engines]
        self._sem = asyncio.Semaphore(self._per_engine * len(self._slots))

    # ---- routing -----------------------------------------------------------------------
    def _usable(self, slot: _Slot) -> bool:
        return not self._gone(slot) and slot.engine.weight_version == self.version

    @staticmethod
    def _alive(engine) -> bool:
        """The engine's process runs (engines without `alive`, in-process ones, always do)."""
        return getattr(engine, "alive", lambda: True)()

    def _gone(self, slot: _Slot) -> bool:
        return slot.restarting or not self._alive(slot.engine)

    def _untried_usable(self, tried: set[int]) -> bool:
        return any(self._usable(s) for i, s in enumerate(self._slots) if i not in tried)

    async def _pick(self, avoid: set[int]) -> int:
        deadline = asyncio.get_running_loop().time() + self.wait_for_engine
        while True:
            usable = [i for i, s in enumerate(self._slots) if self._usable(s)]
            preferred = [i for i in usable if i not in avoid] or usable
            if preferred:
                return min(preferred, key=lambda i: self._slots[i].inflight)
            if self.version > 0 and all(self._gone(s) for s in self._slots):
                raise RequestFailedError(f"every engine died or is restarting, and a restarted engine holds the "
                                         f"initial weights, not version {self.version}: none can serve this step")
            if asyncio.get_running_loop().time() > deadline:
                raise RequestFailedError(f"no usable engine for {self.wait_for_engine:.0f} s")
            await asyncio.sleep(0.2)

    async def _attempt(self, slot: _Slot, request: EngineRequest) -> EngineOutput:
        """One try on one engine: no limit while queued there (as long as the engine is alive),
        then the generation timeout."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def on_start():  # called from the engine's thread
            loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))

        future = asyncio.wrap_future(slot.engine.submit([request], on_start=on_start))
        try:
            while not (started.done() or future.done()):
                await asyncio.wait({started, future}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
                if not self._alive(slot.engine):
                    raise EngineUnavailableError("the engine died while the request was queued")
            return (await asyncio.wait_for(future, self.timeout.seconds([request])))[0]
        finally:
            started.cancel()
            future.cancel()  # drops the request if it is still queued in the engine

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
                try:
                    idx = await self._pick(tried)
                except RequestFailedError as exc:
                    raise RequestFailedError(f"request {request.rid!r}: {exc}" + "".join(f"; {e}" for e in errors)) from None
                slot = self._slots[idx]
                slot.inflight += 1
                try:
                    output = await self._attempt(slot, request)
                    slot.served += 1
                    return output
                except Exception as exc:
                    alive = self._alive(slot.engine)
                    if not isinstance(exc, (*RETRYABLE, asyncio.TimeoutError)) and alive:
                        raise  # the engine's own answer about this request: the same everywhere
                    errors.append(f"engine {idx}: {type(exc).__name__}: {exc}")
                    self.failures.append({"rid": request.rid, "engine": idx, "attempt": attempt, "error": str(exc)})
                    tried.add(idx)
                    self._recover(idx)
                finally:
                    slot.inflight -= 1
                if attempt + 1 < self.max_attempts and not self._untried_usable(tried):
                    await asyncio.sleep(RETRY_PAUSE * 2 ** attempt)
                    self._recover(idx)  # its exit may show only now
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
        if slot.restarting or self._alive(engine) or not hasattr(engine, "restart"):
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
        """Apply each bucket to every live engine (directly, or by broadcast); bumps the pool's
        version. Returns the tensors applied, summed over the engines."""
        live = [s for s in self._slots if not self._gone(s)]
        direct = [s.engine for s in live if not s.by_broadcast]
        sender = self._broadcast_sender([s.engine for s in live if s.by_broadcast])
        applied = 0
        for bucket in buckets:  # engines apply updates between their batches
            for engine in direct:
                applied += engine.update_weights([bucket], version=version)
            if sender is not None:
                sender.send([bucket], version=version)
                applied += len(bucket) * len(sender.servers)
        self.version = version
        return applied

    def _broadcast_sender(self, servers: list):
        """The weight-broadcast group over ``servers``, rebuilt when they changed (an engine
        restarted on a new port, or one lost, makes a new group; the old one is freed on this
        rank and on its servers still here)."""
        from megatron_marsrl.rollout.weight_sync import DistributedWeightSender

        if not servers:
            return None
        if self._sender is None or [s.url for s in self._sender.servers] != [s.url for s in servers]:
            self._close_sender(still_here=servers)
            self._sender = DistributedWeightSender(servers, group_name=f"marsrl_weights_{id(self)}_{next(self._groups)}")
        return self._sender

    def _close_sender(self, still_here: list) -> None:
        """Free the broadcast group, if any; a failure is logged (an idle group costs memory, not
        correctness)."""
        sender, self._sender = self._sender, None
        if sender is None:
            return
        kept = {s.url for s in still_here}
        try:
            sender.close([s for s in sender.servers if s.url in kept])
        except Exception as exc:  # noqa: BLE001 - never stop training over an idle group
            log.warning("could not free the old weight-broadcast group %s: %s", sender.group_name, exc)

    def release_memory(self, tags: tuple[str, ...]) -> int:
        """Every engine that can (SGLang with its memory saver) frees the GPU memory of ``tags``
        (of MEMORY_TAGS); returns how many did."""
        return self._each_engine("release_memory", tags)

    def resume_memory(self, tags: tuple[str, ...]) -> int:
        """Every engine that released memory re-allocates ``tags``; returns how many did."""
        return self._each_engine("resume_memory", tags)

    def _each_engine(self, method: str, tags: tuple[str, ...]) -> int:
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"memory tags {sorted(unknown)}: use {MEMORY_TAGS}")
        done = 0
        for slot in self._slots:
            fn = getattr(slot.engine, method, None)
            if fn is not None:
                fn(tags)
                done += 1
        return done

    def score_each(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[list[float]]]:
        """Log-probs of tokens[1:] from every usable engine, in pool order (the weight-sync probe
        of every engine, however its weights arrived)."""
        usable = [s.engine for s in self._slots if self._usable(s)]
        if not usable:
            raise RequestFailedError("no usable engine to score the probe")
        return [engine.score(sequences, temperature=temperature) for engine in usable]

    def read_weights(self, names: list[str], rows: int) -> dict:
        """The first rows of HF-named tensors from the first usable engine (the sync check)."""
        return self._first_usable("read weights from").read_weights(names, rows)

    def _first_usable(self, purpose: str):
        usable = [s for s in self._slots if self._usable(s)]
        if not usable:
            raise RequestFailedError(f"no usable engine to {purpose}")
        return usable[0].engine

    def shutdown(self) -> None:
        self._close_sender(still_here=[])  # the servers' side goes with them
        for slot in self._slots:
            slot.engine.shutdown()
