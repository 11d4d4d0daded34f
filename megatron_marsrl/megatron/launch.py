"""Run a function on N local ranks (one process each), torchrun-style, for tools and tests.

    results = launch("pkg.module:function", world_size=2, kwargs={...})

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in its environment,
calls ``function(**kwargs)`` and its JSON-serialisable return value comes back in rank order.
On a GPU node each rank uses the CUDA device its LOCAL_RANK names (``parallel.init_parallel``),
so world_size may not exceed the visible devices.
If any rank fails, the others are killed and :class:`LaunchError` carries the failing rank's
output tail. When already inside a torchrun job, call the function directly instead.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_marsrl.net import free_port


class LaunchError(RuntimeError):
    """A rank of a launched job failed."""


def launch(target: str, world_size: int, kwargs: dict | None = None, *, timeout: float = 900,
           stream_rank0: bool = False, env: dict | None = None) -> list:
    # The kwargs, rank logs and results live in a temporary directory removed on every exit.
    with tempfile.TemporaryDirectory(prefix="marsrl-launch-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        (workdir / "kwargs.json").write_text(json.dumps(kwargs or {}))
        port = free_port()
        procs, logs = [], []
        try:
            for rank in range(world_size):
                rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                log = open(workdir / f"rank{rank}.log", "w+")
                logs.append(log)
                out = None if (stream_rank0 and rank == 0) else log
                procs.append(subprocess.Popen([sys.executable, "-m", __name__, target, str(workdir)], env=rank_env,
                                              stdout=out, stderr=subprocess.STDOUT if out else None))
            _wait_all(procs, logs, time.monotonic() + timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        return [json.loads((workdir / f"result{r}.json").read_text()) for r in range(world_size)]


def _wait_all(procs, logs, deadline) -> None:
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = failed[0]
            logs[rank].flush()
            logs[rank].seek(0)
            tail = logs[rank].read()[-6000:]
            raise LaunchError(f"rank {rank} exited with code {codes[rank]}; its output ends with:\n{tail}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise LaunchError("launched job timed out")
        time.sleep(0.05)


def _worker(target: str, workdir: str) -> None:
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    kwargs = json.loads(Path(workdir, "kwargs.json").read_text())
    result = func(**kwargs)
    Path(workdir, f"result{os.environ['RANK']}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
