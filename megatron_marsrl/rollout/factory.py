"""Pick and start rollout engines from one typed config: the switch between implementations."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from megatron_marsrl.rollout.engine import GenerationTimeout

ENGINES = ("hf", "sglang", "sglang_server")
PLACEMENTS = ("colocated", "split")


@dataclasses.dataclass(kw_only=True)
class RolloutEngineConfig:
    """Which engines generate the rollouts, and where."""

    kind: str = "hf"
    """"hf": embedded transformers (CPU default, starts in seconds); "sglang": sglang.Engine in
    this process; "sglang_server": SGLang server processes behind an HTTP client (GPU default)."""
    num_engines: int = 1
    """Engines per node (per policy); each gets ``tp_size`` consecutive GPUs. SGLang servers
    start on every node of the run (each node's first rank starts its own); the in-process
    kinds ("hf", "sglang") live in rank 0's process only."""
    placement: str = "colocated"
    """"colocated": the engines share GPUs with trainer ranks; those on rank 0's node take
    weights from rank 0 directly (shared memory / CUDA IPC), other nodes' by broadcast.
    "split" (sglang_server only): the engines have GPUs of their own on every node (from
    ``base_gpu_id``, past the node's trainer ranks) and every engine takes weights by
    broadcast from rank 0 (``update_weights_from_distributed``; NCCL on GPU, gloo on CPU)."""
    tp_size: int = 1
    """Tensor-parallel size of each SGLang engine (the GPUs it spans)."""
    ep_size: int = 1
    """Expert-parallel size inside each SGLang engine (MoE); divides tp_size."""
    dp_size: int = 1
    """Data-parallel attention replicas inside each SGLang engine."""
    base_gpu_id: int = 0
    """First GPU used by the engines on this node."""
    gpus_per_node: int = 8
    host: str = "127.0.0.1"
    """Bind address of SGLang servers: loopback unless other nodes must reach them. Any other
    address needs an API key in the environment variable MARSRL_SGLANG_API_KEY (never in the
    config, which is saved with the run): the servers get it as ``--api-key`` and every request
    sends it. Set on loopback, the key is used too."""
    max_total_tokens: int = 16384
    """KV-cache capacity per engine, in tokens."""
    mem_fraction_static: float | None = None
    """SGLang's static memory fraction (colocated runs leave room for training)."""
    startup_timeout: float = 300.0
    generation_timeout: GenerationTimeout = dataclasses.field(default_factory=GenerationTimeout)
    """Limit of one request once its engine started it: base_s + per_token_s * max_new_tokens."""
    max_inflight_per_engine: int = 512
    """Requests in flight per engine; the engine batches them (SGLang: continuous batching)."""
    max_batch_tokens: int = 65536
    """Embedded engine: prompt + max_new_tokens summed over one batch (raised to
    max_total_tokens when smaller, so that one request always fits: `batch_tokens`)."""
    deterministic: bool = False
    """SGLang engines honour per-request seeds (``enable_deterministic_inference``): the same
    rollouts after a resume. GPU only (SGLang 0.5.23 has no deterministic CPU attention
    backend) and slower; the embedded engine is always deterministic."""
    seed: int = 0
    routed_experts: bool = False
    """Engines record the experts each token was routed to (MoE routing replay in training)."""
    quantization: str | None = None
    """None: serve the training dtype. "fp8": SGLang engines hold FP8 weights and re-quantize every
    bf16 weight sync (SGLang's flash_rl loader; GPU only, dense Qwen2/Qwen3; see rollout/fp8.py).
    The train/rollout gap it adds shows in train/mismatch_abs and train/mismatch_k3."""

    def __post_init__(self):
        from megatron_marsrl.rollout.fp8 import check_kind

        if self.kind not in ENGINES:
            raise ValueError(f"engine kind={self.kind!r}: choose one of {', '.join(ENGINES)}")
        check_kind(self.quantization, self.kind)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"engine.placement={self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.placement == "split" and self.kind != "sglang_server":
            raise ValueError(f"engine.placement=split needs engine.kind=sglang_server (weights reach the engines by "
                             f"broadcast to SGLang servers), not {self.kind!r}")
        if self.num_engines < 1 or self.tp_size < 1:
            raise ValueError(f"num_engines={self.num_engines}, tp_size={self.tp_size}: both must be >= 1")
        if self.max_inflight_per_engine < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"max_inflight_per_engine={self.max_inflight_per_engine}, max_batch_tokens="
                             f"{self.max_batch_tokens}: both must be >= 1")
        if self.kind == "sglang_server":
            _check_host(self.host)
        if self.kind != "hf" and self.base_gpu_id + self.num_engines * self.tp_size > self.gpus_per_node:
            raise ValueError(f"{self.num_engines} engines x tp {self.tp_size} from GPU {self.base_gpu_id} need more "
                             f"than the {self.gpus_per_node} GPUs of a node")

    @property
    def on_every_node(self) -> bool:
        """Whether each node of the run starts its own engines: SGLang servers do (each node's
        first rank starts them, rank 0 reaches them over HTTP); the in-process kinds live in
        rank 0's process, on the first node only."""
        return self.kind == "sglang_server"

    @property
    def batching(self) -> str:
        """How an engine takes requests: "static" (one batch at a time behind
        rollout/batcher.py, the in-process kinds) or "continuous" (SGLang's server scheduler)."""
        return "continuous" if self.kind == "sglang_server" else "static"

    @property
    def batch_tokens(self) -> int:
        """Static batching: the most prompt + max_new_tokens summed over one batch, the budget
        the in-process engines' batcher gets (at least one whole request)."""
        return max(self.max_batch_tokens, self.max_total_tokens) if self.kind == "hf" else self.max_total_tokens


def _check_host(host: str) -> None:
    from megatron_marsrl.net import is_loopback
    from megatron_marsrl.rollout.sglang_server import API_KEY_ENV

    if not is_loopback(host) and not os.environ.get(API_KEY_ENV):
        raise ValueError(f"engine.host={host!r} lets other machines reach the SGLang servers, whose weight updates "
                         f"are pickled tensors: set the environment variable {API_KEY_ENV} to a secret key "
                         "(passed to SGLang as --api-key and sent with every request), or use engine.host=127.0.0.1")


def make_engine(kind: str, model_dir: str, *, max_total_tokens: int = 4096, seed: int = 0,
                quantization: str | None = None):
    """One engine of ``kind`` over a local HF checkpoint directory."""
    cfg = RolloutEngineConfig(kind=kind, max_total_tokens=max_total_tokens, seed=seed, quantization=quantization)
    return _start_one(cfg, model_dir, 0)


def start_engines(cfg: RolloutEngineConfig, model_dir: str, *, dtype: torch.dtype = torch.float32,
                  memory_saver: bool = False):
    """Start this node's ``cfg.num_engines`` engines and return them behind one EnginePool.
    ``dtype``: what the embedded engine ("hf") generates in, the training dtype (SGLang picks its
    own: `sglang_engine.sglang_dtype`; on CPU it stays fp32, where its bf16 path hangs).
    ``memory_saver`` starts SGLang engines with its memory saver, so that they can release and
    resume their weights and KV cache (time-shared colocation; GPU only)."""
    from megatron_marsrl.rollout.pool import EnginePool

    engines = start_node_engines(cfg, model_dir, dtype=dtype, memory_saver=memory_saver)
    return EnginePool(engines, max_concurrency=cfg.max_inflight_per_engine * len(engines),
                      timeout=cfg.generation_timeout, by_broadcast=cfg.placement == "split")


def start_node_engines(cfg: RolloutEngineConfig, model_dir: str, *, dtype: torch.dtype = torch.float32,
                       memory_saver: bool = False) -> list:
    """Start this node's ``cfg.num_engines`` engines (all stopped again if one fails)."""
    engines = []
    try:
        for i in range(cfg.num_engines):
            engines.append(_start_one(cfg, model_dir, i, dtype=dtype, memory_saver=memory_saver))
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines


def attach_engines(cfg: RolloutEngineConfig, model_dir: str, urls: list[str]) -> list:
    """Clients of SGLang servers another node started with ``cfg`` (`start_node_engines`)."""
    from megatron_marsrl.rollout.sglang_server import SGLangServer

    return [SGLangServer.attach(_server_config(cfg, model_dir, i), url) for i, url in enumerate(urls)]


def _start_one(cfg: RolloutEngineConfig, model_dir: str, index: int, *, dtype: torch.dtype = torch.float32,
               memory_saver: bool = False):
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model path {model_dir}: no config.json (need a local HF checkpoint directory)")
    from megatron_marsrl.rollout.fp8 import check_start

    check_start(cfg.quantization, kind=cfg.kind, model_dir=model_dir)  # before anything is spawned
    if cfg.kind == "hf":
        from megatron_marsrl.rollout.hf_engine import TransformersEngine

        return TransformersEngine(model_dir, dtype=dtype, seed=cfg.seed + index, max_total_tokens=cfg.max_total_tokens,
                                  max_batch_tokens=cfg.batch_tokens)
    if cfg.kind == "sglang":
        from megatron_marsrl.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_dir, seed=cfg.seed + index, max_total_tokens=cfg.max_total_tokens,
                            tp_size=cfg.tp_size, base_gpu_id=cfg.base_gpu_id + index * cfg.tp_size,
                            mem_fraction_static=cfg.mem_fraction_static, quantization=cfg.quantization,
                            enable_return_routed_experts=cfg.routed_experts, deterministic=cfg.deterministic,
                            **({"enable_memory_saver": True} if memory_saver else {}))
    from megatron_marsrl.rollout.sglang_server import SGLangServer

    return SGLangServer(_server_config(cfg, model_dir, index, memory_saver=memory_saver)).start()


def _server_config(cfg: RolloutEngineConfig, model_dir: str, index: int, *, memory_saver: bool = False):
    from megatron_marsrl.rollout.sglang_server import API_KEY_ENV, SGLangServerConfig

    return SGLangServerConfig(
        model_path=model_dir, host=cfg.host, api_key=os.environ.get(API_KEY_ENV) or None,
        max_total_tokens=cfg.max_total_tokens, tp_size=cfg.tp_size, ep_size=cfg.ep_size, dp_size=cfg.dp_size,
        base_gpu_id=cfg.base_gpu_id + index * cfg.tp_size, mem_fraction_static=cfg.mem_fraction_static,
        startup_timeout=cfg.startup_timeout, generation_timeout=cfg.generation_timeout,
        max_inflight=cfg.max_inflight_per_engine, deterministic=cfg.deterministic,
        seed=cfg.seed + index, quantization=cfg.quantization,
        enable_return_routed_experts=cfg.routed_experts, memory_saver=memory_saver)
