"""Runs the agents' rollouts in a background thread and hands over each group when it is done.

The trainer's main thread trains groups while this thread keeps generating (the engines are
in other processes, or release the GIL in torch ops). One step of rollouts is either
  * "pipeline" (MarsRL): one stage of every open trajectory plus the Solver stage of the new
    problems; the inputs the step selects for the next stages are kept (`pending`) and are part
    of the checkpoint, or
  * "sync": whole trajectories of the new problems.
Work arrives through `next_unit()` in completion order, one unit per problem: the groups of
one (problem, stage) in pipeline mode, of one whole trajectory in sync mode. Every built-in
advantage estimator pools within a problem, so a unit can be trained as soon as it arrives.
`None` marks the end of the step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence

from megatron_marsrl.agents.rollout import GroupedRollout, PendingStage
from megatron_marsrl.data_types import Group, Problem, Sample

_DONE = object()


class StepGate:
    """Where segmented generation waits for the next step (segment rollout).

    Each sample being generated is `enter`ed while it runs; one that used up its per-step
    token budget without finishing calls `wait()` and resumes when the next step opens, so its
    next segment comes from the weights that step trains. The driver ends a step when no
    sample is running (`active == 0`) and the stage tasks left are all parked here.
    Lives on the rollout thread's event loop."""

    def __init__(self) -> None:
        self.active = 0
        self.parked = 0
        self._event: asyncio.Event | None = None

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1

    async def wait(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        self.leave()
        self.parked += 1
        try:
            await event.wait()
        finally:
            self.enter()

    def open_step(self) -> None:
        """Release everything parked in the previous step; count afresh."""
        event, self._event, self.parked = self._event, asyncio.Event(), 0
        if event is not None:
            event.set()


class RolloutDriver:
    """Background generation of one RL step at a time."""

    def __init__(self, rollout: GroupedRollout, *, mode: str, gate: StepGate | None = None):
        if mode not in ("pipeline", "sync"):
            raise ValueError(f"rollout mode {mode!r}: use 'pipeline' or 'sync'")
        self.rollout, self.mode = rollout, mode
        self._pending: list[PendingStage] = []
        self.gate = gate or StepGate()
        self._queue: queue.Queue = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="marsrl-rollout", daemon=True)
        self._thread.start()
        self._future = None
        self._inflight: dict[asyncio.Task, PendingStage] = {}
        self.finished_at = 0.0
        """perf_counter() when the last step's rollouts ended (before the trainer heard of it)."""

    @property
    def pending(self) -> list[PendingStage]:
        """Stage inputs waiting for the next step (pipeline mode)."""
        return self._pending

    def start_step(self, step: int, problems: Sequence[Problem]) -> None:
        """Start generating step `step` in the background."""
        if self._future is not None:
            try:  # its _DONE is queued a moment before the future completes
                self._future.result(timeout=30)
            except Exception:  # noqa: BLE001 - a failed step was already reported via next_unit
                pass
        self.rollout.salt = f"s{step}."
        self._future = asyncio.run_coroutine_threadsafe(self._step(list(problems)), self._loop)

    async def _step(self, problems: list[Problem]) -> None:
        try:
            if self.mode == "pipeline":
                await self._pipeline_step(problems)
            else:
                await self.rollout.rollout(problems, on_done=self._queue.put)
        except BaseException as exc:  # surfaced in the trainer's thread by next_unit()
            self._queue.put(exc)
            raise
        finally:
            self.finished_at = time.perf_counter()
            self._queue.put(_DONE)

    async def _pipeline_step(self, problems: list[Problem]) -> None:
        """One stage of every open trajectory. A stage whose samples are parked at the gate
        (segment rollout) stays in flight and finishes in a later step; the step ends when
        everything not parked is done."""
        work = [PendingStage(problem=p, turn=0, inputs=[]) for p in problems]
        work += sorted(self._pending, key=lambda w: (w.problem.id, w.turn))
        self._pending = []
        self.gate.open_step()
        for w in work:
            self._inflight[asyncio.create_task(self._stage(w))] = w
        while True:
            active = [t for t in self._inflight if not t.done()]
            failed = [t for t in self._inflight if t.done() and not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            for t in [t for t in self._inflight if t.done()]:
                del self._inflight[t]
            if not active or await self._only_parked_left():
                return
            await asyncio.wait(active, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)

    async def _only_parked_left(self) -> bool:
        """No sample is generating and some are parked. Checked twice, a moment apart, so
        that stage tasks created this step have reached their generation calls."""
        for _ in range(2):
            if self.gate.active or not self.gate.parked:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _stage(self, w: PendingStage) -> None:
        groups = await self.rollout.stage(w.problem, w.turn, w.inputs)
        self._queue.put(groups)
        nxt = self.rollout.next_stage(w.problem, w.turn, groups)
        if nxt is not None:
            self._pending.append(nxt)

    def next_unit(self, timeout: float | None = None) -> list[Group] | None:
        """The next finished unit of the running step; None once the step is complete.
        Re-raises a rollout failure (after the engines' own retries gave up)."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            self._queue.get()  # the _DONE that follows
            raise RuntimeError(f"rollout failed: {type(item).__name__}: {item}") from item
        return None if item is _DONE else item

    def run_eval(self, coro):
        """Run a coroutine (e.g. an evaluation) on the rollout thread's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def call_soon(self, fn) -> None:
        """Run `fn()` on the rollout thread (asyncio objects are not thread-safe)."""
        self._loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:  # segment rollout leaves samples parked for a next step that never comes
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """Stage inputs for the next step. Stages still in flight (segment rollout) cannot be
        saved half-generated: they are saved as inputs and regenerated from their start."""
        work = list(self.pending) + [w for t, w in self._inflight.items() if not t.done()]
        return {"pending": [{"problem": dataclasses.asdict(p.problem), "turn": p.turn,
                             "inputs": [_sample_to_dict(s) for s in p.inputs]} for p in work]}

    def load_state_dict(self, state: dict) -> None:
        self._pending = [PendingStage(problem=Problem(**p["problem"]), turn=p["turn"],
                                      inputs=[_sample_from_dict(s) for s in p["inputs"]])
                         for p in state.get("pending", [])]


def _sample_to_dict(sample: Sample) -> dict:
    # routing records are tensors only the trainer of this step needs; stage inputs keep text
    sample = dataclasses.replace(sample, metadata={k: v for k, v in sample.metadata.items() if k != "routed_experts"})
    d = dataclasses.asdict(sample)
    d["parse_status"] = sample.parse_status.value
    return d


def _sample_from_dict(d: dict) -> Sample:
    from megatron_marsrl.data_types import ParseStatus

    return Sample(**{**d, "parse_status": ParseStatus(d["parse_status"])})
