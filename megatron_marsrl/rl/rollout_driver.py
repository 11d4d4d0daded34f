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
from collections.abc import Sequence

from megatron_marsrl.agents.rollout import GroupedRollout, PendingStage, PipelinedRollout
from megatron_marsrl.data_types import Group, Problem, Sample

_DONE = object()


class RolloutDriver:
    """Background generation of one RL step at a time."""

    def __init__(self, rollout: GroupedRollout, *, mode: str):
        if mode not in ("pipeline", "sync"):
            raise ValueError(f"rollout mode {mode!r}: use 'pipeline' or 'sync'")
        self.rollout, self.mode = rollout, mode
        self.pipeline = PipelinedRollout(rollout)
        self._queue: queue.Queue = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="marsrl-rollout", daemon=True)
        self._thread.start()
        self._future = None

    @property
    def pending(self) -> list[PendingStage]:
        """Stage inputs waiting for the next step (pipeline mode)."""
        return self.pipeline.pending

    def start_step(self, step: int, problems: Sequence[Problem]) -> None:
        """Start generating step `step` in the background."""
        if self._future is not None and not self._future.done():
            raise RuntimeError("the previous rollout step is still running")
        self.rollout.salt = f"s{step}."
        self._future = asyncio.run_coroutine_threadsafe(self._step(list(problems)), self._loop)

    async def _step(self, problems: list[Problem]) -> None:
        try:
            if self.mode == "pipeline":
                await self.pipeline.step(problems, on_done=self._queue.put)
            else:
                await self.rollout.rollout(problems, on_done=self._queue.put)
        except BaseException as exc:  # surfaced in the trainer's thread by next_unit()
            self._queue.put(exc)
            raise
        finally:
            self._queue.put(_DONE)

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
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"pending": [{"problem": dataclasses.asdict(p.problem), "turn": p.turn,
                             "inputs": [_sample_to_dict(s) for s in p.inputs]} for p in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        self.pipeline.pending = [PendingStage(problem=Problem(**p["problem"]), turn=p["turn"],
                                              inputs=[_sample_from_dict(s) for s in p["inputs"]])
                                 for p in state.get("pending", [])]


def _sample_to_dict(sample: Sample) -> dict:
    d = dataclasses.asdict(sample)
    d["parse_status"] = sample.parse_status.value
    return d


def _sample_from_dict(d: dict) -> Sample:
    from megatron_marsrl.data_types import ParseStatus

    return Sample(**{**d, "parse_status": ParseStatus(d["parse_status"])})
