"""SGLang as a rollout engine (the engine of record on GPU; tested for real on CPU).

On CPU SGLang needs SGLANG_USE_CPU_ENGINE=1 and an import-only stand-in for its CUDA kernel
package (sglang_cpu_shim/sgl_kernel), put first on the path of SGLang's processes only. The
engine runs in-process (sglang.Engine, which spawns its scheduler); the weight update uses
SGLang's begin/update/end session, which 0.5.23 requires, with one flattened bucket per call.
``sglang.Engine.generate`` blocks its caller, so requests from many callers go through our
dynamic batcher (rollout/batcher.py): those waiting when a call ends form the next call, and
SGLang batches each call's requests itself.

Per-request seeds are sent as SGLang's ``sampling_seed``; SGLang honours them only when the
engine runs with ``enable_deterministic_inference`` (``deterministic=True``: GPU attention
backends fa3/flashinfer/triton; CPU's torch_native backend is refused by SGLang 0.5.23), and
otherwise samples from its own RNG.

Log-probs: SGLang reports output tokens under logits / temperature (as Megatron recomputes
them) but prompt tokens at temperature 1, so :meth:`score` only scores at temperature 1.

Routed experts (MoE routing replay): with ``enable_return_routed_experts=True`` SGLang's
scheduler records every token's top-k expert ids and requests with ``return_routed_experts``
get them back (rollout/routed_experts.py). On CPU this needs the plugin in sglang_cpu_shim/
(SGLang pins the capture buffer with cudaHostRegister, which has no driver there).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path
from typing import Iterable

import torch

from megatron_marsrl.procs import descendants
from megatron_marsrl.rollout.batcher import BatchedEngine, DynamicBatcher
from megatron_marsrl.rollout.engine import EngineOutput, EngineRequest
from megatron_marsrl.rollout.routed_experts import decode_sglang, experts_layout

SHIM_DIR = Path(__file__).resolve().parent / "sglang_cpu_shim"

# SGLang's arguments on a CPU machine (Engine keyword names; the server gets them as flags):
# the torch-native path, and sleep_on_idle because an idle scheduler otherwise polls for
# requests without pause and keeps a whole core busy (10.1 core-seconds in 10 idle seconds; with
# it 0.15 for a server, 0.13 for an in-process engine, measured here), the core the trainer's
# ranks need between rollouts; asleep it wakes on the next request's message.
CPU_ARGS = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True, "sleep_on_idle": True}


class EngineError(RuntimeError):
    """The engine refused or failed a request."""


def prepare_cpu_environment() -> None:
    """Make SGLang's CPU torch-native path importable in this process and its children.
    GPU runs never call this (see SGLangEngine)."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SHIM_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *paths])


def sglang_dtype(dtype: str) -> str:
    """The dtype SGLang is started with (engine and server alike): "auto" becomes float32 on CPU,
    where the trainer computes in float32 and the log-probs must agree exactly; on GPU SGLang's
    own "auto" (the checkpoint's dtype) stays. Any other name is passed through."""
    return "float32" if dtype == "auto" and not torch.cuda.is_available() else dtype


class SGLangEngine(BatchedEngine):
    """One SGLang engine over a HF checkpoint directory."""

    def __init__(self, model_dir: str, *, max_total_tokens: int = 16384, dtype: str = "auto", seed: int = 0,
                 tp_size: int = 1, base_gpu_id: int = 0, mem_fraction_static: float | None = None,
                 enable_return_routed_experts: bool = False, quantization: str | None = None,
                 deterministic: bool = False, **server_args):
        from megatron_marsrl.rollout.fp8 import check_start, sglang_args

        check_start(quantization, kind="sglang", model_dir=model_dir)  # FP8: a GPU and a model class SGLang supports
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            prepare_cpu_environment()
        from sglang.srt.entrypoints.engine import Engine

        kwargs = dict(model_path=str(model_dir), max_total_tokens=max_total_tokens, skip_tokenizer_init=True,
                      random_seed=seed, tp_size=tp_size, base_gpu_id=base_gpu_id, log_level="error",
                      dtype=sglang_dtype(dtype))
        if on_cpu:
            kwargs.update(CPU_ARGS)
        if mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = mem_fraction_static
        if enable_return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        if deterministic:
            kwargs["enable_deterministic_inference"] = True
        kwargs.update(sglang_args(quantization))
        self.experts_layout = experts_layout(model_dir)
        self.max_total_tokens = max_total_tokens
        self.weight_version = 0
        self._tp_size = tp_size
        before = set(descendants())
        self._engine = Engine(**kwargs, **server_args)
        self.processes = [pid for pid in descendants() if pid not in before]
        """The processes this engine started (its scheduler, detokenizer), stopped by `shutdown`:
        those that appeared below this process while it started (nothing else of ours starts a
        process in those seconds)."""
        self._batcher = DynamicBatcher(self._run_batch, token_budget=max_total_tokens, name="sglang-engine")

    def _check_request(self, req: EngineRequest) -> None:
        total = len(req.prompt_ids) + req.sampling.max_new_tokens
        if not req.prompt_ids or total > self.max_total_tokens:
            raise ValueError(f"request {req.rid!r}: {len(req.prompt_ids)} prompt tokens + max_new_tokens "
                             f"{req.sampling.max_new_tokens} must be in 1..max_total_tokens={self.max_total_tokens}")

    def _run_batch(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        params = [_sampling_params(r) for r in requests]
        outs = self._engine.generate(input_ids=[list(r.prompt_ids) for r in requests], sampling_params=params,
                                     return_logprob=True,
                                     return_routed_experts=any(r.return_routed_experts for r in requests))
        return [to_record(r, o, self.weight_version, experts_layout=self.experts_layout) for r, o in zip(requests, outs)]

    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        if temperature != 1.0:
            raise ValueError("SGLang reports prompt log-probs at temperature 1 only; score with temperature=1.0")
        with self._batcher.exclusive():
            outs = self._engine.generate(input_ids=[list(s) for s in sequences],
                                         sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                                         return_logprob=True, logprob_start_len=0)
        return [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, version: int) -> int:
        """HF checkpoint-named tensors, one update call per bucket inside one update session.
        SGLang ignores names it does not know: verify with a log-prob probe after syncing."""
        applied = 0
        with self._batcher.exclusive():  # between generate calls
            _check(self._engine.begin_weight_update(), "begin_weight_update")
            try:
                for bucket in buckets:
                    _check(self._engine.update_weights_from_tensor(serialize_per_rank(bucket, self._tp_size),
                                                                   load_format="flattened_bucket", flush_cache=False),
                           "update_weights_from_tensor")
                    applied += len(bucket)
            finally:
                _check(self._engine.end_weight_update(), "end_weight_update")
            self._engine.flush_cache()
            self.weight_version = version
        return applied

    def read_weights(self, names: list[str], rows: int) -> dict[str, torch.Tensor | None]:
        """SGLang's get_weights_by_name (None for models without it, e.g. Qwen2/Qwen3 in 0.5.23)."""
        with self._batcher.exclusive():
            return {name: weights_or_none(self._engine.get_weights_by_name(name, truncate_size=rows)) for name in names}

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Free the GPU memory of ``tags`` (of MEMORY_TAGS); needs enable_memory_saver=True."""
        self._engine.release_memory_occupation(tags=list(tags))

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Re-allocate what `release_memory` freed."""
        self._engine.resume_memory_occupation(tags=list(tags))

    def shutdown(self) -> None:
        """Stop the engine and the processes it started, and no other process of ours."""
        self._batcher.close()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            atexit.unregister(engine.shutdown)  # SGLang registers it; it would run again at exit
            alive = set(descendants())  # not a pid reused since by a process that is not ours
            with _tree_kills_limited_to([pid for pid in self.processes if pid in alive]):
                engine.shutdown()


@contextlib.contextmanager
def _tree_kills_limited_to(pids: list[int]):
    """``sglang.Engine.shutdown`` ends with ``kill_process_tree(os.getpid(), include_parent=False)``:
    it SIGKILLs every process below the caller, not only the engine's (the launch fork server,
    SGLang servers, a rank's other children). Within the block that call stops ``pids`` and
    their children instead; calls for other processes are left as they are. (SGLang's SIGQUIT
    handler, which a crashed scheduler triggers, still stops the whole tree and this process:
    a failure that ends the rank.)"""
    import sglang.srt.entrypoints.engine as sglang_engine

    kill_tree = sglang_engine.kill_process_tree

    def limited(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid not in (None, os.getpid()):
            return kill_tree(parent_pid, include_parent, skip_pid, wait_timeout)
        for pid in pids:
            kill_tree(pid, True, skip_pid, wait_timeout)

    sglang_engine.kill_process_tree = limited
    try:
        yield
    finally:
        sglang_engine.kill_process_tree = kill_tree


def to_record(req: EngineRequest, out: dict, weight_version: int, *,
              experts_layout: tuple[int, int] | None = None) -> EngineOutput:
    """One SGLang generate result (in-process or over HTTP) as our record. ``experts_layout``
    (layers, top_k) decodes routed experts for requests that asked for them."""
    meta = out["meta_info"]
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    finish = "length" if finish == "length" else "abort" if finish == "abort" else "stop"
    output_ids = list(out["output_ids"])
    routed = None
    if req.return_routed_experts and finish != "abort":
        routed = _routed_experts(req, meta, len(req.prompt_ids) + len(output_ids) - 1, experts_layout)
    return EngineOutput(rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=output_ids,
                        logprobs=[entry[0] for entry in meta.get("output_token_logprobs") or []],
                        finish_reason=finish, weight_version=weight_version, routed_experts=routed)


def weights_or_none(values) -> torch.Tensor | None:
    """A get_weights_by_name answer (nested lists of float32 values, or None) as a tensor."""
    return None if values is None else torch.tensor(values, dtype=torch.float32)


def _routed_experts(req: EngineRequest, meta: dict, rows: int, layout: tuple[int, int] | None):
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise EngineError(f"request {req.rid!r} asked for routed experts but SGLang returned none: start the engine "
                          "with enable_return_routed_experts=True (and serve an MoE model)")
    if layout is None or not layout[1]:
        raise EngineError(f"request {req.rid!r}: routed experts need the model's (layers, top_k) to decode")
    return decode_sglang(encoded, rows=rows, layout=layout)


def serialize_per_rank(bucket: list[tuple[str, torch.Tensor]], tp_size: int, *, output_str: bool = False) -> list:
    """One bucket as a single flattened tensor + metadata for SGLang's
    ``load_format="flattened_bucket"`` (one IPC handle per bucket instead of one per tensor),
    serialized once per engine TP rank: each rank opens and releases its own handle (SGLang
    0.5.23 indexes the list by TP rank; one serialization shared by all ranks would be released
    by the first). The tensor stays on the trainer's device: on GPU the engine ranks open a
    handle to rank 0's GPU memory (slime and verl serialize on each rank's own GPU instead)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=list(bucket))
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload, output_str=output_str) for _ in range(tp_size)]


def _check(result, what: str) -> None:
    ok, message = (result if isinstance(result, tuple) else (result, ""))[:2]
    if not ok:
        raise EngineError(f"SGLang {what} failed: {message}")


def _sampling_params(req: EngineRequest) -> dict:
    s = req.sampling
    params = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_new_tokens": s.max_new_tokens}
    if s.seed is not None:  # honoured by engines started with enable_deterministic_inference
        params["sampling_seed"] = s.seed & (2**63 - 1)
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    return params
