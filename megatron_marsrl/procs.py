"""No orphans: every process a rank starts dies with the rank (Linux).

How each kind of child is tied to its rank:

* SGLang servers (rollout/sglang_server.py) and SGLang's own scheduler/detokenizer processes
  set PR_SET_PDEATHSIG, so the kernel signals them when the rank dies, by any signal.
* Megatron's torch_dist writer would start a multiprocessing Manager (a spawn-context server
  process plus a resource tracker, ~600 MB each per rank) that nothing ties to the rank; we save
  synchronously with an in-process queue instead (megatron/dist_checkpoint.py), so there is none.
* Anything else left in the rank's process tree is killed by :func:`kill_descendants` when the
  rank leaves without unwinding: :func:`exit_with_launcher` (the launcher was SIGKILLed).
  When the launcher is alive and a rank dies, torchrun kills each rank's process group.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children), from /proc; [] if it is gone."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread or the process ended meanwhile
            continue
    return out


def descendants(pid: int | None = None) -> list[int]:
    """Every process below ``pid`` (default: this process), parents before their children."""
    found, todo = [], [os.getpid() if pid is None else pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def kill_descendants(sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to every process below this one (children first stopped from forking more:
    a parent is signalled before its children); returns the pids signalled."""
    pids = descendants()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when the *thread* that forked it exits
    (PR_SET_PDEATHSIG; it survives exec). Call in a child (e.g. a Popen preexec_fn)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except OSError:  # not Linux / no glibc
        return False


def exit_with_launcher(poll_s: float = 1.0) -> None:
    """Exit (with everything this rank started) when the launcher disappears, e.g. torchrun
    killed with SIGKILL: torchrun starts ranks in their own sessions, so nothing else would
    stop them, and a rank that leaves with os._exit runs no finalizer that would stop its children."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("the launcher (pid %d) is gone; this rank exits", parent)
                kill_descendants()
                os._exit(1)

    threading.Thread(target=watch, name="marsrl-launcher-watch", daemon=True).start()


class StopSignals:
    """SIGTERM and SIGINT as a request to stop: the first sets :attr:`name` (the trainer finishes
    or aborts the running step, saves a checkpoint and exits); the same request again, more than
    ``repeat_after`` seconds later, stops at once (KeyboardInterrupt, no checkpoint). torchrun and
    Slurm forward a signal to every rank, often a second time right away: a repeat within
    ``repeat_after`` seconds is that echo and changes nothing."""

    def __init__(self, repeat_after: float = 5.0):
        self.repeat_after = repeat_after
        self.name: str | None = None
        """The first signal's name ("SIGTERM"), None until one arrived."""
        self._time = 0.0

    def install(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.name is not None:
            if time.monotonic() - self._time > self.repeat_after:
                raise KeyboardInterrupt
            return
        self.name, self._time = signal.Signals(signum).name, time.monotonic()
        log.warning("%s received: stopping the running step, saving a checkpoint, then exiting "
                    "(the step is redone on --resume; send the signal again to stop at once)", self.name)

