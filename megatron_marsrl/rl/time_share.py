"""Time-shared colocation (`pipeline.time_shared`): the trainer and the SGLang engines take turns
on the same GPUs, each holding the whole memory in its phase (as slime runs colocated).

The order in every step, each phase logged to train.log as "time-shared step N: ...":
  rollout       the engines hold their weights, KV cache and CUDA graphs; the trainer's
                parameters and state are in host memory
  to_training   (after the rollout) the engines release weights, KV cache and CUDA graphs;
                every rank brings its parameters, gradient buffers and optimizer state back
  train, optimizer step
  to_sync       gradients (freed) and optimizer state leave the GPU; the engines get their
                weights' memory back
  weight sync   the trainer's parameters, still on the GPU, go to the engines
  to_rollout    the parameters leave the GPU; the engines get their KV cache and CUDA graphs
Before the engines start (`start`) the trainer's parameters and state leave the GPU, so that
SGLang sizes its KV pool for the GPU it has to itself while generating. A resume brings the
trainer back as after a rollout (`to_training`), loads the checkpoint and syncs the weights as
a step does. Checkpoints bring the trainer back while they are written (`trainer_resident`).

The moves are GPU-only: SGLang's memory saver needs CUDA, and on CPU there is no device memory
to free. Without a GPU every phase still runs in this order, with the same barriers, and logs
that it moved nothing (the engines' and the trainer's side are megatron/offload.py,
rollout/pool.py release_memory/resume_memory).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_marsrl.rollout.pool import MEMORY_TAGS

log = logging.getLogger(__name__)

GIB = 2**30


class TimeShare:
    """The phase changes of one rank; rank 0 also drives the engines (`pools`)."""

    def __init__(self, actors: dict, pools: dict | None, *, group, moves: bool | None = None):
        self.actors = actors
        self.pools = pools
        """Rank 0's engine pools per policy, set once they started (after `start`); None on the
        other ranks."""
        self.group = group
        """The control process group the phases synchronise on (gloo)."""
        self.moves = torch.cuda.is_available() if moves is None else moves
        """Whether memory really moves (GPU); False: the phases only run and log."""
        self.step = 0
        self._out: set[str] = set()
        """Trainer parts ("params", "state") currently in host memory."""
        if not self.moves:
            log.info("time-shared: no GPU, so the trainer's offload and SGLang's memory release are skipped; "
                     "the phases below run in a GPU run's order and move nothing")

    def start(self) -> None:
        """Before the first rollout: the trainer's parameters and state leave the GPU."""
        self._trainer("offload", ("state", "params"))
        self._log("start", "trainer parameters and state to host memory")

    def to_training(self) -> None:
        """After the rollout: the engines free their memory, then the trainer comes back."""
        self._engines("release_memory", MEMORY_TAGS)
        dist.barrier(group=self.group)  # every engine of the run has let go before anyone loads
        self._trainer("onload", ("params", "state"))
        self._log("to_training", "engines released weights, KV cache, CUDA graphs; trainer back on the GPU")

    def to_sync(self) -> None:
        """After the optimizer step: gradients and optimizer state leave, engine weights return."""
        self._trainer("offload", ("state",))
        dist.barrier(group=self.group)
        self._engines("resume_memory", ("weights",))
        self._log("to_sync", "trainer gradients and optimizer state to host memory; engines resumed their weights")

    def to_rollout(self) -> None:
        """After the weight sync: the parameters leave, the engines get their KV cache back."""
        self._trainer("offload", ("params",))
        dist.barrier(group=self.group)
        self._engines("resume_memory", ("kv_cache", "cuda_graph"))
        self._log("to_rollout", "trainer parameters to host memory; engines resumed KV cache and CUDA graphs")
        self.step += 1

    @contextmanager
    def trainer_resident(self):
        """The trainer's parameters and state on the GPU for the duration (a checkpoint)."""
        out = tuple(sorted(self._out))
        self._trainer("onload", out)
        try:
            yield
        finally:
            self._trainer("offload", out)

    def _trainer(self, action: str, parts: tuple[str, ...]) -> None:
        moved = 0
        for part in parts:
            if (part in self._out) == (action == "offload"):
                continue  # already there
            if self.moves:
                moved += sum(getattr(actor, action)(part) for actor in self.actors.values())
            (self._out.add if action == "offload" else self._out.discard)(part)
        if moved:
            log.info("time-shared: trainer %s %s: %.2f GiB", action, "+".join(parts), moved / GIB)

    def _engines(self, action: str, tags: tuple[str, ...]) -> None:
        if self.pools is None or not self.moves:
            return
        for name, pool in self.pools.items():
            done = getattr(pool, action)(tags)
            log.info("time-shared: policy %s, %d engine(s) %s %s", name, done, action, "+".join(tags))

    def _log(self, phase: str, what: str) -> None:
        log.info("time-shared step %d: %s: %s%s", self.step, phase, what, "" if self.moves else " (no GPU: nothing moved)")
