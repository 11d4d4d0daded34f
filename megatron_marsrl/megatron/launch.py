"""Run a function on N local ranks (one process each), torchrun-style, for tools and tests.

    results = launch("pkg.module:function", world_size=2, kwargs={...})

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in its environment,
calls ``function(**kwargs)`` and its JSON-serialisable return value comes back in rank order.
On a GPU node each rank uses the CUDA device its LOCAL_RANK names (``parallel.init_parallel``),
so world_size may not exceed the visible devices.
If any rank fails, the others are killed and :class:`LaunchError` carries the failing rank's
output tail. When already inside a torchrun job, call the function directly instead.

Each rank is a new interpreter, which spends most of a small job importing torch and
megatron.core (~7 s per rank on 2 CPU cores). Inside :func:`fork_server`, ranks are forked
instead from a process that imported them once (what the test suite and `marsrl selfcheck` do;
the job itself runs the same code): only for calls whose environment is the one the server
started with, and without `stream_rank0`; any other call starts interpreters as above.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_marsrl.net import free_port


# The environment the tools give their ranks on CPU: one OpenMP thread each, a rank per core.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


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
            base_env = {**os.environ, **(env or {})}
            server = _server if _server is not None and not stream_rank0 and _server.serves(base_env) else None
            for rank in range(world_size):
                rank_env = {**base_env, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                log = open(workdir / f"rank{rank}.log", "w+")
                logs.append(log)
                if server is not None:
                    procs.append(server.fork(target, workdir, rank, rank_env))
                    continue
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


class _ForkedRank:
    """A rank forked by the fork server, with the part of Popen's interface `launch` uses (it is
    not our child: the server reaps it and writes its exit code to `exit<rank>` in the workdir)."""

    def __init__(self, pid: int, exit_file: Path):
        self.pid, self._exit_file, self.returncode = pid, exit_file, None

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_file.is_file():
            text = self._exit_file.read_text()
            if text.endswith("\n"):  # written completely
                self.returncode = int(text)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 60.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.returncode


class _ForkServer:
    """A process that imported `preload` once and forks one rank per request (stdin/stdout JSON
    lines). Single-threaded: it reaps its children between requests."""

    def __init__(self, preload: tuple[str, ...], env: dict | None = None):
        self.env = {**os.environ, **(env or {})}
        self._log = tempfile.TemporaryFile("w+")  # the imports' warnings, shown if it fails to start
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, "--fork-server", *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=self.env)
        self._ready = False  # it imports in the background until the first fork waits for it

    def _wait_ready(self) -> None:
        if not self._ready:
            said = self.proc.stdout.readline()
            if said.strip() != "ready":
                self._log.seek(0)
                raise LaunchError(f"the launch fork server did not start:\n{self._log.read()[-3000:]}")
            self._ready = True

    def serves(self, env: dict) -> bool:
        """Whether a rank with `env` may be forked here: the environment the server imported
        its modules under, apart from pytest's note of the running test."""
        def relevant(e: dict) -> dict:
            return {k: v for k, v in e.items() if k != "PYTEST_CURRENT_TEST"}

        return relevant(env) == relevant(self.env)

    def fork(self, target: str, workdir: Path, rank: int, env: dict) -> _ForkedRank:
        self._wait_ready()
        request = {"target": target, "workdir": str(workdir), "rank": rank, "env": env, "cwd": os.getcwd()}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except BrokenPipeError:
            answer = ""
        if not answer:  # e.g. killed by a library that stops every process below the launching one
            raise LaunchError(f"the launch fork server (pid {self.proc.pid}) exited with {self.proc.wait()}")
        return _ForkedRank(json.loads(answer)["pid"], workdir / f"exit{rank}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


_server: _ForkServer | None = None


@contextlib.contextmanager
def fork_server(preload: tuple[str, ...] = ("torch", "megatron.core", "transformers"), *, env: dict | None = None):
    """Within the block, `launch` forks its ranks from one process that imported `preload`
    under this environment plus ``env``: the calls that pass the same ``env`` to `launch`."""
    global _server
    if _server is not None:
        raise RuntimeError("a launch fork server is already running")
    _server = _ForkServer(preload, env)
    try:
        yield _server
    finally:
        server, _server = _server, None
        server.close()


def _serve(preload: list[str]) -> None:
    """The fork server's loop: import `preload`, then fork a rank per request line."""
    for name in preload:
        importlib.import_module(name)
    out = sys.stdout
    print("ready", file=out, flush=True)
    exit_files: dict[int, Path] = {}
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.1)
        _reap(exit_files)
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:  # the launching process closed the pipe (or died)
            break
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                log = os.open(Path(request["workdir"], f"rank{request['rank']}.log"), os.O_WRONLY | os.O_APPEND)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(0)
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                _worker(request["target"], request["workdir"])
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                import atexit

                atexit._run_exitfuncs()  # what the interpreter's exit would run
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        exit_files[pid] = Path(request["workdir"], f"exit{request['rank']}")
        print(json.dumps({"pid": pid}), file=out, flush=True)
    while exit_files:  # wait for the ranks still running before leaving
        _reap(exit_files, block=True)


def _reap(exit_files: dict[int, Path], block: bool = False) -> None:
    while exit_files:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            exit_files.clear()
            return
        if pid == 0:
            return
        path = exit_files.pop(pid, None)
        if path is not None:
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):  # the workdir may be gone (the launch gave up)
                path.write_text(f"{code}\n")
        if block:
            return


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        _serve(sys.argv[2:])
    else:
        _worker(sys.argv[1], sys.argv[2])
