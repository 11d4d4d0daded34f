"""SGLang as a separate server process: start, readiness, health, shutdown, restart, and an
HTTP client for generation and weight updates.

Each server is one `python -m sglang.launch_server` process group bound to 127.0.0.1 (unless
configured otherwise), logging to a file whose tail goes into every start-up error. The
server dies with the trainer: it gets SIGTERM when its parent exits (PR_SET_PDEATHSIG) and
an atexit hook stops every server this process started.

Weight updates travel as pickled tensors: whoever can reach the port can run code in the
server. A server bound to anything but loopback therefore needs an API key (SGLang's
``--api-key``), which every request of ours carries as ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from megatron_marsrl.net import free_port, is_loopback
from megatron_marsrl.procs import set_parent_death_signal
from megatron_marsrl.rollout.engine import EngineOutput, EngineRequest, GenerationTimeout
from megatron_marsrl.rollout.sglang_cpu_shim.marsrl_sglang_cpu import FORK_ENV
from megatron_marsrl.rollout.sglang_engine import CPU_ARGS, SHIM_DIR, EngineError, sglang_dtype

_RUNNING: set["SGLangServer"] = set()


class EngineStartError(RuntimeError):
    """The server did not become ready; the message carries its log tail."""


@dataclasses.dataclass(kw_only=True)
class SGLangServerConfig:
    """One SGLang server."""

    model_path: str
    """Local HF checkpoint directory."""
    host: str = "127.0.0.1"
    """Bind address: loopback unless the engines must be reached from other nodes (then
    ``api_key`` is required)."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Passed to SGLang as ``--api-key`` and sent with every request; required off loopback."""
    port: int = 0
    """0 picks a free port."""
    max_total_tokens: int = 16384
    """KV-cache capacity in tokens (SGLang's CPU default would reserve ~6 GB)."""
    dtype: str = "auto"
    """"auto" is float32 on CPU (exact parity) and the checkpoint dtype on GPU (`sglang_dtype`)."""
    tp_size: int = 1
    """Tensor-parallel size of the engine (GPUs it spans)."""
    ep_size: int = 1
    """Expert-parallel size inside the engine (MoE); must divide tp_size."""
    dp_size: int = 1
    """Data-parallel attention replicas inside the engine."""
    base_gpu_id: int = 0
    """First GPU of this engine's group on its node."""
    mem_fraction_static: float | None = None
    enable_return_routed_experts: bool = False
    """Record each token's routed experts (MoE) so requests with ``return_routed_experts``
    get them back for routing replay in the trainer."""
    startup_timeout: float = 300.0
    generation_timeout: GenerationTimeout = dataclasses.field(default_factory=GenerationTimeout)
    """HTTP limit of a generate call (the server's own queueing counts against it)."""
    max_inflight: int = 512
    """Generate calls sent concurrently (the server batches them continuously)."""
    deterministic: bool = False
    """``--enable-deterministic-inference``: per-request seeds are honoured (GPU attention backends
    only; SGLang 0.5.23 refuses CPU's torch_native)."""
    seed: int = 0
    openai_api: bool = False
    """Load the model's tokenizer so the server's OpenAI-compatible text endpoints
    (/v1/chat/completions, with the checkpoint's chat template) work, for `marsrl eval --serve`;
    the trainer sends token ids and leaves the tokenizer out (``--skip-tokenizer-init``)."""
    quantization: str | None = None
    """None or "fp8": FP8 weights, re-quantized on every weight update (GPU only; rollout/fp8.py)."""
    memory_saver: bool = False
    """``--enable-memory-saver``: the server can release and resume its weights, KV cache and
    CUDA graphs (`release_memory` / `resume_memory`; GPU only)."""
    log_dir: str | None = None
    """Where server logs go (default: a temp dir)."""

    def __post_init__(self):
        if not (Path(self.model_path) / "config.json").is_file():
            raise FileNotFoundError(f"model path {self.model_path}: no config.json (need a local HF checkpoint directory)")
        if self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens={self.max_total_tokens}: too small")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"host={self.host!r} exposes the server beyond this machine and weight updates are "
                             f"pickled: give an api_key (the trainer reads ${API_KEY_ENV}) or bind 127.0.0.1")


API_KEY_ENV = "MARSRL_SGLANG_API_KEY"


def _flags(args: dict) -> list[str]:
    """SGLang Engine keyword arguments as `sglang.launch_server` flags (True: the bare flag)."""
    out = []
    for key, value in args.items():
        out += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def _die_with_parent() -> None:
    os.setsid()
    set_parent_death_signal(signal.SIGTERM)


class _Spawner:
    """Starts every server from one long-lived thread. PR_SET_PDEATHSIG fires when the
    *thread* that forked the child exits, not the process: a server started from a worker
    thread (a background restart, a parallel start) would be killed as soon as that thread
    returned. This thread lives as long as the process, so servers die exactly with it."""

    def __init__(self):
        import queue

        self._jobs: "queue.Queue" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        import concurrent.futures

        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sglang-spawner", daemon=True)
                self._thread.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((args, kwargs, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            args, kwargs, done = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as exc:  # hand the error to the caller's thread
                done.set_exception(exc)


_SPAWNER = _Spawner()


class SGLangServer:
    def __init__(self, config: SGLangServerConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log_path = Path(config.log_dir or os.environ.get("TMPDIR", "/tmp")) / f"sglang-{os.getpid()}-{id(self)}.log"
        self.weight_version = 0
        self.attached = False
        """A server another process started and owns (`attach`): this object only talks to it."""
        self._lost = False
        """An attached server stopped answering (it is not restarted from here)."""
        self._senders = None  # a thread per concurrent HTTP generate call, created on first use

    @classmethod
    def attach(cls, config: SGLangServerConfig, url: str) -> "SGLangServer":
        """A client of a running server that another process (another node's trainer rank)
        started with ``config``: it generates and takes weight updates, but never stops or
        restarts the process (its owner does); it counts as alive until a request cannot
        reach it."""
        server = cls(config)
        server.url, server.attached = url.rstrip("/"), True
        if not server.healthy(timeout=60.0):
            raise EngineStartError(f"the SGLang server at {server.url} does not answer /health_generate: check that "
                                   f"this node can reach it and that {API_KEY_ENV} is the same on every node")
        return server

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> "SGLangServer":
        from megatron_marsrl.rollout.fp8 import check_start, sglang_args

        cfg = self.config
        check_start(cfg.quantization, kind="sglang_server", model_dir=cfg.model_path)  # before spawning
        port = cfg.port or free_port(cfg.host)
        self.url = f"http://{cfg.host}:{port}"
        on_cpu = not torch.cuda.is_available()
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
               "--port", str(port), "--max-total-tokens", str(cfg.max_total_tokens),
               "--tp-size", str(cfg.tp_size), "--ep-size", str(cfg.ep_size), "--dp-size", str(cfg.dp_size),
               "--random-seed", str(cfg.seed), "--log-level", "warning",
               "--dtype", sglang_dtype(cfg.dtype)]
        env = dict(os.environ)
        if on_cpu:
            cmd += _flags(CPU_ARGS)
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env[FORK_ENV] = "1"  # its scheduler and detokenizer forked, not spawned (the shim's plugin)
            env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        else:
            cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
        if not cfg.openai_api:
            cmd += ["--skip-tokenizer-init"]
        if cfg.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        if cfg.enable_return_routed_experts:
            cmd += ["--enable-return-routed-experts"]
        if cfg.deterministic:
            cmd += ["--enable-deterministic-inference"]
        if cfg.memory_saver:
            cmd += ["--enable-memory-saver"]
        if cfg.api_key:  # visible in this machine's process list; keeps other machines out
            cmd += ["--api-key", cfg.api_key]
        cmd += _flags(sglang_args(cfg.quantization))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = _SPAWNER.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        log.close()
        _RUNNING.add(self)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(f"SGLang server exited with code {self.proc.returncode} during start-up; "
                                       f"log {self.log_path} ends with:\n{self.log_tail()}")
            if self.healthy(timeout=2.0):
                return
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(f"SGLang server not ready after {self.config.startup_timeout:.0f} s; "
                               f"log {self.log_path} ends with:\n{self.log_tail()}")

    def healthy(self, timeout: float = 30.0) -> bool:
        """True when the server answers a tiny generation (/health_generate) within
        ``timeout``; generous by default because a loaded CPU machine answers slowly."""
        try:
            req = urllib.request.Request(f"{self.url}/health_generate", headers=self._headers())
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def alive(self) -> bool:
        """The process runs; an attached server, until a request could not reach it (from then
        on the pool leaves it out of requests and weight syncs)."""
        if self.attached:
            return not self._lost
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Kill the server's process group at once. A server we stop has nothing to save (its
        requests are answered or given up, its weights come from the trainer), and SIGTERM buys
        nothing: SGLang takes its scheduler's death as a crash and sleeps 5 s for crash
        diagnostics before exiting (6.0 s per stop measured, 0.1 s killed; both leave the same
        /dev/shm and /tmp files behind)."""
        self.kill()
        _RUNNING.discard(self)

    def kill(self) -> None:
        """Kill the whole server process group at once; without `stop`'s bookkeeping, this is
        what a crash looks like to the pool (which restarts the server)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> "SGLangServer":
        self.stop()
        self.weight_version = 0
        return self.start()

    # ---- requests -----------------------------------------------------------------------
    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _post(self, path: str, payload: dict, timeout: float) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(payload).encode(), headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            if 400 <= exc.code < 500:  # the request itself is wrong: retrying elsewhere cannot help
                raise ValueError(f"{self.url}{path}: HTTP {exc.code}: {detail}") from exc
            raise EngineError(f"{self.url}{path}: HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            slow = isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)
            self._lost = self._lost or (self.attached and not slow)  # unreachable, not merely slow
            raise ConnectionError(f"{self.url}{path}: {exc}") from exc
        try:
            return json.loads(body) if body else {}
        except json.JSONDecodeError:  # a few endpoints (flush_cache) answer in plain text
            return {"text": body.decode(errors="replace")}

    def submit(self, requests: list[EngineRequest], *, on_start=None):
        """Send the generate call from a sender thread (many at once: the server batches them)."""
        from concurrent.futures import ThreadPoolExecutor

        if self._senders is None:
            self._senders = ThreadPoolExecutor(self.config.max_inflight, thread_name_prefix="sglang-http")

        def send():
            if on_start is not None:
                on_start()
            return self.generate(requests)

        return self._senders.submit(send)

    def generate(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        from megatron_marsrl.rollout.routed_experts import experts_layout
        from megatron_marsrl.rollout.sglang_engine import _sampling_params, to_record

        outs = self._post("/generate", {"input_ids": [list(r.prompt_ids) for r in requests],
                                        "sampling_params": [_sampling_params(r) for r in requests],
                                        "return_logprob": True, "rid": [r.rid or f"r{i}" for i, r in enumerate(requests)],
                                        "return_routed_experts": any(r.return_routed_experts for r in requests)},
                          self.config.generation_timeout.seconds(requests))
        outs = outs if isinstance(outs, list) else [outs]
        layout = experts_layout(self.config.model_path) if any(r.return_routed_experts for r in requests) else None
        return [to_record(r, o, self.weight_version, experts_layout=layout) for r, o in zip(requests, outs)]

    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of tokens[1:] (SGLang reports prompt log-probs at temperature 1 only)."""
        if temperature != 1.0:
            raise ValueError("SGLang reports prompt log-probs at temperature 1 only; score with temperature=1.0")
        outs = self._post("/generate", {"input_ids": [list(s) for s in sequences],
                                        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                                        "return_logprob": True, "logprob_start_len": 0}, 600)
        outs = outs if isinstance(outs, list) else [outs]
        return [[lp[0] for lp in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]

    def read_weights(self, names: list[str], rows: int) -> dict[str, torch.Tensor | None]:
        """/get_weights_by_name (None for models SGLang cannot read back, e.g. Qwen2/Qwen3)."""
        from megatron_marsrl.rollout.sglang_engine import weights_or_none

        out = {}
        for name in names:
            try:
                answer = self._post("/get_weights_by_name", {"name": name, "truncate_size": rows}, 60)
            except (ValueError, EngineError):  # the server answers an error for unsupported models
                answer = None
            out[name] = weights_or_none(answer if isinstance(answer, list) else None)
        return out

    def update_weights(self, buckets, *, version: int) -> int:
        """Send HF-named tensors over HTTP (tensors travel through shared memory files, which
        needs the file_system sharing strategy in this process). Generation is paused for the
        update (in-flight requests are retracted and resumed on the new weights)."""
        from megatron_marsrl.rollout.sglang_engine import serialize_per_rank

        torch.multiprocessing.set_sharing_strategy("file_system")
        applied = 0
        self._post("/pause_generation", {"mode": "retract"}, 60)
        self._ok(self._post("/begin_weight_update", {}, 60), "begin_weight_update")
        try:
            for bucket in buckets:
                payload = serialize_per_rank(bucket, self.config.tp_size, output_str=True)
                self._ok(self._post("/update_weights_from_tensor", {"serialized_named_tensors": payload,
                                                                    "load_format": "flattened_bucket",
                                                                    "flush_cache": False,
                                                                    "weight_version": str(version)}, 600),
                         "update_weights_from_tensor")
                applied += len(bucket)
        finally:
            self._ok(self._post("/end_weight_update", {}, 60), "end_weight_update")
            self._post("/flush_cache", {}, 60)
            self._post("/continue_generation", {}, 60)
        self.weight_version = version
        return applied

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Free the GPU memory of ``tags`` (of MEMORY_TAGS); needs ``memory_saver``."""
        self._ok(self._post("/release_memory_occupation", {"tags": list(tags)}, timeout=600.0), "release memory")

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Re-allocate what `release_memory` freed (weights come back as they were released;
        the trainer's weight sync follows)."""
        self._ok(self._post("/resume_memory_occupation", {"tags": list(tags)}, timeout=600.0), "resume memory")

    def abort_all(self) -> None:
        """Abort every request the server is working on (cancelling our side alone would leave
        them running there)."""
        try:
            self._post("/abort_request", {"rid": "", "abort_all": True}, 30)
        except (ConnectionError, ValueError, EngineError):
            pass  # a dead server has nothing left to abort

    # ---- disaggregated weight updates ---------------------------------------------------
    def init_weights_group(self, master_address: str, master_port: int, *, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> None:
        """Join the trainer's weight-broadcast group (blocks until every member has joined)."""
        self._ok(self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, 600), "init_weights_update_group")

    def destroy_weights_group(self, group_name: str) -> None:
        """Leave (and free) a weight-broadcast group this server joined."""
        self._ok(self._post("/destroy_weights_update_group", {"group_name": group_name}, 60),
                 "destroy_weights_update_group")

    def receive_bucket(self, bucket, *, group_name: str, version: int) -> None:
        """Receive one bucket broadcast by the trainer (blocks until the broadcasts are done)."""
        self._ok(self._post("/update_weights_from_distributed", {
            "names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name, "flush_cache": False,
            "weight_version": str(version)}, 600), "update_weights_from_distributed")

    @staticmethod
    def _ok(result: dict, what: str) -> None:
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"SGLang {what} failed: {result.get('message')}")

    def shutdown(self) -> None:
        self.stop()
        if self._senders is not None:
            self._senders.shutdown(wait=False, cancel_futures=True)


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()
