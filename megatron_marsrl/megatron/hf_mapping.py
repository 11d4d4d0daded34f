"""The name/shape mapping between HF checkpoints and Megatron parameters.

Pure functions over tensors: no process groups here. A *unit* is one Megatron parameter in
global terms (global layer and expert indices); it is built from one or more HF tensors and is
split over a tensor-parallel group in one of five ways:

  replicated  every rank holds the whole tensor (norms, router)
  vocab       rows split along dim 0 after zero-padding the vocabulary to a multiple of TP
              (embedding, output layer); export drops the padding again
  cols        split along dim 1 (attention output, MLP down projection)
  qkv         q/k/v interleaved per query group, then split along dim 0 by groups
  gate_up     [gate; up] with gate and up each split along dim 0 (SwiGLU fc1)

Loading reads only the slices a rank needs; export reassembles full HF tensors from the
shards of a group. Both directions are the same table, so they cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator

import torch

from megatron_marsrl.megatron.hf_config import ModelArch

# read(hf_name, dim, index, count, padded_to=None) -> chunk `index` of `count` equal chunks
# along `dim` (dim None: the whole tensor); with `padded_to`, dim 0 is first zero-padded to
# that many rows.
SliceReader = Callable[..., torch.Tensor]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocabulary rows Megatron holds: the HF vocabulary rounded up to a multiple of TP.
    The extra rows are zero and their logits are masked to -inf (forward.py)."""
    return -(-vocab_size // tp) * tp


@dataclasses.dataclass(frozen=True)
class Unit:
    key: str
    """Megatron parameter name with *global* layer/expert indices."""
    hf_names: tuple[str, ...]
    kind: str
    """replicated | vocab | cols | qkv | gate_up"""
    group: str | None
    """Which TP group splits it: "tp", "etp" (expert tensor parallel) or None."""


def units(arch: ModelArch) -> list[Unit]:
    """Every unit of the model in canonical (export) order."""
    out = [Unit("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "tp")]
    for g in range(arch.num_layers):
        out += _layer_units(arch, g)
    out.append(Unit("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", None))
    if not arch.tie_word_embeddings:
        out.append(Unit("output_layer.weight", ("lm_head.weight",), "vocab", "tp"))
    return out


def _layer_units(arch: ModelArch, g: int) -> list[Unit]:
    m, hf = f"decoder.layers.{g}.", f"model.layers.{g}."
    out = [
        Unit(m + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated", None),
        Unit(m + "self_attention.linear_qkv.weight",
             tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", "tp"),
    ]
    if arch.qk_norm:
        out += [Unit(m + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "replicated", None),
                Unit(m + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "replicated", None)]
    out += [
        Unit(m + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "cols", "tp"),
        Unit(m + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated", None),
    ]
    if not arch.layer_is_moe(g):
        return out + _mlp_units(m + "mlp.", hf + "mlp.", "tp")
    out.append(Unit(m + "mlp.router.weight", (hf + "mlp.gate.weight",), "replicated", None))
    for e in range(arch.num_experts):
        out += _mlp_units(m + f"mlp.experts.local_experts.{e}.", hf + f"mlp.experts.{e}.", "etp")
    return out


def _mlp_units(m: str, hf: str, group: str) -> list[Unit]:
    return [Unit(m + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), "gate_up", group),
            Unit(m + "linear_fc2.weight", (hf + "down_proj.weight",), "cols", group)]


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor, in canonical order."""
    h, hd = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for unit in units(arch):
        for name in unit.hf_names:
            leaf = name.rsplit(".", 2)[-2]
            if leaf in ("embed_tokens", "lm_head"):
                shape = (arch.vocab_size, h)
            elif leaf in ("q_norm", "k_norm"):
                shape = (hd,)
            elif leaf.endswith("layernorm") or leaf == "norm":
                shape = (h,)
            elif leaf == "q_proj":
                shape = (arch.num_attention_heads * hd, h)
            elif leaf in ("k_proj", "v_proj"):
                shape = (arch.num_key_value_heads * hd, h)
            elif leaf == "o_proj":
                shape = (h, arch.num_attention_heads * hd)
            elif leaf == "gate" and ".mlp.gate." in name:
                shape = (arch.num_experts, h)
            else:  # gate_proj / up_proj / down_proj of a dense MLP or an expert
                ffn = arch.moe_ffn_hidden_size if ".experts." in name else arch.ffn_hidden_size
                shape = (h, ffn) if leaf == "down_proj" else (ffn, h)
            shapes[name] = shape
    return shapes


# TE fuses the pre-attention / pre-MLP norms into the following linear layer; their weights are
# named <linear>.layer_norm_weight. Normalise them to the local-spec names used as unit keys.
_TE_FUSED_NORMS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)


def global_key(local_name: str, layer_offset: int, expert_offset: int) -> str:
    """Map a local parameter name (stage-local layer, rank-local expert) to its unit key."""
    name = local_name
    for te_name, local in _TE_FUSED_NORMS:
        name = name.replace(te_name, local)
    name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda mt: f"decoder.layers.{int(mt.group(1)) + layer_offset}.", name)
    return re.sub(r"\.local_experts\.(\d+)\.", lambda mt: f".local_experts.{int(mt.group(1)) + expert_offset}.", name)


def shard_from_hf(unit: Unit, read: SliceReader, rank: int, size: int, arch: ModelArch) -> torch.Tensor:
    """This rank's shard of ``unit`` built from HF tensors, reading only the needed slices."""
    names = unit.hf_names
    if unit.kind == "replicated" or size == 1 and unit.kind == "cols":
        return read(names[0], None, 0, 1)
    if unit.kind == "vocab":
        return read(names[0], 0, rank, size, padded_to=padded_vocab_size(arch.vocab_size, size))
    if unit.kind == "cols":
        return read(names[0], 1, rank, size)
    if unit.kind == "gate_up":
        return torch.cat([read(names[0], 0, rank, size), read(names[1], 0, rank, size)], dim=0)
    q, k, v = (read(n, 0, rank, size) for n in names)
    groups = arch.num_key_value_heads // size
    hidden = q.shape[-1]
    return torch.cat([q.reshape(groups, -1, hidden), k.reshape(groups, -1, hidden),
                      v.reshape(groups, -1, hidden)], dim=1).reshape(-1, hidden)


def hf_from_shards(unit: Unit, shards: list[torch.Tensor], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Reassemble the full HF tensors of ``unit`` from the shards of all ranks of its group."""
    names = unit.hf_names
    if unit.kind == "replicated":
        yield names[0], shards[0]
    elif unit.kind == "vocab":
        yield names[0], torch.cat(shards, dim=0)[: arch.vocab_size]
    elif unit.kind == "cols":
        yield names[0], torch.cat(shards, dim=1)
    elif unit.kind == "gate_up":
        half = shards[0].shape[0] // 2
        yield names[0], torch.cat([s[:half] for s in shards], dim=0)
        yield names[1], torch.cat([s[half:] for s in shards], dim=0)
    else:
        hd, hidden = arch.head_dim, shards[0].shape[-1]
        per_group = arch.num_attention_heads // arch.num_key_value_heads
        full = torch.cat(shards, dim=0).reshape(arch.num_key_value_heads, (per_group + 2) * hd, hidden)
        q, k, v = full.split([per_group * hd, hd, hd], dim=1)
        for name, part in zip(names, (q, k, v)):
            yield name, part.reshape(-1, hidden).contiguous()
