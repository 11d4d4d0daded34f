"""Records and the interface shared by the rollout engines."""
from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol

import torch


@dataclasses.dataclass(kw_only=True)
class EngineSampling:
    """Sampling parameters of one request."""

    temperature: float = 1.0
    """0 means greedy. Reported log-probs are under logits / temperature (1 when greedy)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these (the model's EOS is always included)."""
    seed: int | None = None
    """Per-request sampling seed: the same request gives the same tokens whatever else runs
    (embedded engine always; SGLang as far as its kernels are deterministic). None: engine RNG."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: use -1 (off) or a positive integer")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")


@dataclasses.dataclass(kw_only=True)
class EngineRequest:
    prompt_ids: list[int]
    sampling: EngineSampling = dataclasses.field(default_factory=EngineSampling)
    rid: str = ""
    return_routed_experts: bool = False
    """MoE models: also return the experts each token was routed to (for routing replay in the
    trainer). SGLang engines must be started with enable_return_routed_experts=True."""


@dataclasses.dataclass(kw_only=True)
class EngineOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    """Log-probability of each output token under the sampling temperature."""
    finish_reason: str
    """"stop" (a stop/EOS token), "length" (max_new_tokens) or "abort"."""
    weight_version: int
    routed_experts: torch.Tensor | None = None
    """With ``return_routed_experts``: int32 ``[len(prompt_ids) + len(output_ids) - 1, layers,
    top_k]``, row i = the global expert ids token i of prompt+output was routed to in each
    decoder layer (the last output token is never fed to the model, so it has no row). Rows
    of dense layers hold no routing (-1 from the embedded engine, 0 from SGLang). None if not
    asked for or the request was aborted."""


class RolloutEngine(Protocol):
    """What the trainer needs from an engine (embedded transformers or SGLang)."""

    weight_version: int

    def generate(self, requests: list[EngineRequest]) -> list[EngineOutput]: ...

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, version: int) -> int:
        """Apply HF-named tensors (checkpoint names); returns how many were applied."""
        ...

    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of tokens[1:] given the prefix (the weight-sync probe)."""
        ...

    def shutdown(self) -> None: ...
