"""Records and the interface shared by the rollout engines."""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Iterable, Protocol

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

    def __post_init__(self) -> None:
        # Training reads one log-prob per output token (loss.old_logprobs=rollout, TIS, the
        # mismatch metrics): an engine that reports fewer is refused here, at the boundary.
        if self.finish_reason != "abort" and len(self.logprobs) != len(self.output_ids):
            raise ValueError(f"request {self.rid!r}: the engine returned {len(self.logprobs)} log-probs for "
                             f"{len(self.output_ids)} output tokens; every output token needs its log-prob")


class EngineUnavailableError(ConnectionError):
    """The engine (its process, connection or batcher) is gone: the request may be retried on
    another engine. Errors of any other type come from the engine working on the request (a
    programming or model error) and are not retried."""


@dataclasses.dataclass(kw_only=True)
class GenerationTimeout:
    """How long one request may take once the engine has started it (time spent waiting for
    the engine's capacity does not count): ``base_s + per_token_s * max_new_tokens``."""

    base_s: float = 120.0
    per_token_s: float = 0.05
    """Generous for one decoding sequence in a full batch (20-50 ms/token on a busy GPU)."""

    def __post_init__(self):
        if self.base_s <= 0 or self.per_token_s < 0:
            raise ValueError(f"generation timeout base_s={self.base_s}, per_token_s={self.per_token_s}: "
                             "base_s must be > 0 and per_token_s >= 0")

    def seconds(self, requests: list[EngineRequest]) -> float:
        return self.base_s + self.per_token_s * max(r.sampling.max_new_tokens for r in requests)


class RolloutEngine(Protocol):
    """What the trainer needs from an engine (embedded transformers or SGLang). Engines are
    thread-safe: many requests may be in flight at once and the engine batches them."""

    weight_version: int

    def submit(self, requests: list[EngineRequest], *,
               on_start: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """Queue ``requests``; the future gives their outputs in order. ``on_start`` is called
        (from any thread) when the engine starts working on them. Bad requests raise here."""
        ...

    def generate(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        """``submit(requests).result()``."""
        ...

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, version: int) -> int:
        """Apply HF-named tensors (checkpoint names); returns how many were applied."""
        ...

    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of tokens[1:] given the prefix (the weight-sync probe)."""
        ...

    def read_weights(self, names: list[str], rows: int) -> dict[str, torch.Tensor | None]:
        """The first ``rows`` rows (dim 0) of each HF-named tensor as the engine holds it (its
        first TP shard), or None where the engine cannot read weights back."""
        ...

    def shutdown(self) -> None: ...
