"""The experts an MoE rollout engine routed each token to, for routing replay in the trainer.

A record (``EngineOutput.routed_experts``) is an int32 tensor ``[tokens - 1, layers, top_k]``
over the sequence prompt + output: row i holds the global expert ids token i was sent to in
each decoder layer. The last output token is never fed to the model, so it has no row; that
is exactly the rows a next-token forward over ``tokens[:-1]`` routes (megatron/routing_replay.py).

Both engines produce it: SGLang (``--enable-return-routed-experts``; its scheduler captures the
top-k ids per KV slot and returns them base64-encoded) and the embedded transformers engine
(forward hooks on the routers while ``generate`` runs).
"""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import torch

# transformers' sparse MoE blocks (Qwen3-MoE, Qwen2-MoE, ...) keep their router at
# layers.{i}.mlp.gate; it returns (router_logits, routing_weights, selected_experts).
_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")

NO_ROUTING = -1
"""Entry of a row that has no recorded routing (dense layers, padding): the trainer's router
chooses for itself there."""


def experts_layout(model_dir: str | Path) -> tuple[int, int]:
    """(decoder layers, experts per token) of the HF checkpoint in ``model_dir``: the shape of
    one record row. (0, 0) for dense models."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("num_hidden_layers", 0)), int(config.get("num_experts_per_tok", 0) or 0)


def decode_sglang(encoded: str, *, rows: int, layout: tuple[int, int]) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 ``[rows, layers, top_k]``)."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    layers, top_k = layout
    if flat.size != rows * layers * top_k:
        raise ValueError(f"SGLang returned {flat.size} routed-expert ids; expected {rows} tokens x {layers} layers "
                         f"x top-{top_k} = {rows * layers * top_k}")
    return torch.from_numpy(flat.copy()).view(rows, layers, top_k)


class RoutedExpertsRecorder:
    """Records the top-k expert ids of every MoE router of a transformers model, per forward
    call, while active (``with recorder: model.generate(...)``)."""

    def __init__(self, model, num_layers: int):
        self.num_layers = num_layers
        self.gates = {int(m.group(1)): mod for name, mod in model.named_modules() if (m := _GATE.search(name))}
        if not self.gates:
            raise ValueError(f"{type(model).__name__} has no MoE routers (layers.N.mlp.gate): nothing to record")
        self._steps: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.gates}
        self._handles: list = []

    def __enter__(self) -> "RoutedExpertsRecorder":
        for steps in self._steps.values():
            steps.clear()
        self._handles = [gate.register_forward_hook(self._hook(layer)) for layer, gate in self.gates.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def record(module, args, output):
            self._steps[layer].append(output[-1].detach().to(torch.int32))
        return record

    def take(self, batch_size: int) -> torch.Tensor:
        """``[batch, fed positions, layers, top_k]`` over the forward calls since entering: each
        call's routed tokens are (batch, its positions) flattened batch-major, as the routers see them."""
        per_layer = {}
        for layer, steps in self._steps.items():
            top_k = steps[0].shape[-1]
            per_layer[layer] = torch.cat([s.view(batch_size, -1, top_k) for s in steps], dim=1)
            steps.clear()
        some = next(iter(per_layer.values()))
        out = torch.full((batch_size, some.shape[1], self.num_layers, some.shape[2]), NO_ROUTING, dtype=torch.int32)
        for layer, routed in per_layer.items():
            out[:, :, layer] = routed
        return out


def left_padded_rows(routed: torch.Tensor, row: int, *, width: int, prompt_len: int, output_len: int) -> torch.Tensor:
    """Row ``row``'s record from a left-padded batch capture (prompts right-aligned at ``width``)."""
    start = width - prompt_len
    return routed[row, start: width + output_len - 1].clone()

