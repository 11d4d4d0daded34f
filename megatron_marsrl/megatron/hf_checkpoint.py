"""Load HF safetensors into a Megatron model of any layout; export it back to HF.

- :class:`HFCheckpointReader` opens a HF directory (single file or sharded index) and reads
  only the slices a rank needs (safetensors ``get_slice``), never the whole checkpoint.
- :func:`load_hf_weights` fills this rank's parameters; every rank reads its own shards.
- :func:`export_hf_buckets` yields ``[(hf_name, tensor), ...]`` buckets of bounded size on one
  rank, gathered over TP/ETP and sent there from the owning PP/EP rank; the engine weight
  sync and :func:`save_hf_checkpoint` both consume it.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_marsrl.megatron import hf_mapping
from megatron_marsrl.megatron.hf_config import ModelArch

# Buffers some HF checkpoints carry that are not parameters (recomputed at load time).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json",
                   "added_tokens.json")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match what its config.json describes."""


class HFCheckpointReader:
    """Slice-level access to the tensors of a HF safetensors checkpoint directory."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {self.path} does not exist")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise FileNotFoundError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)")
        self._files: dict[str, object] = {}
        self._safe_open = safe_open
        if weight_map is None:
            handle = self._open("model.safetensors")
            self.weight_map = {name: "model.safetensors" for name in handle.keys()}
        else:
            self.weight_map = weight_map

    def _open(self, filename: str):
        if filename not in self._files:
            path = self.path / filename
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in the index but missing")
            try:
                self._files[filename] = self._safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own SafetensorError type
                raise CheckpointMismatchError(f"{path}: not a readable safetensors file ({exc})") from exc
        return self._files[filename]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, index: int, count: int, padded_to: int | None = None) -> torch.Tensor:
        """Chunk ``index`` of ``count`` along ``dim`` (None: all), reading only that slice.
        ``padded_to`` (dim 0 only) zero-pads the rows to that many before chunking."""
        if name not in self.weight_map:
            raise CheckpointMismatchError(f"{self.path}: tensor {name!r} is missing")
        piece = self._open(self.weight_map[name]).get_slice(name)
        if dim is None:
            return piece[:]
        size = piece.get_shape()[dim]
        step = (padded_to or size) // count
        start, stop = index * step, (index + 1) * step
        if dim == 1:
            return piece[:, start:stop]
        rows = piece[min(start, size):min(stop, size)]
        missing = step - rows.shape[0]
        if missing:
            rows = torch.cat([rows, rows.new_zeros((missing, *rows.shape[1:]))])
        return rows

    def check_against(self, arch: ModelArch) -> None:
        """Raise CheckpointMismatchError naming missing, unexpected or mis-shaped tensors."""
        expected = hf_mapping.hf_shapes(arch)
        present = {n for n in self.weight_map if not n.endswith(_IGNORED_HF_SUFFIXES)}
        if arch.tie_word_embeddings:
            present.discard("lm_head.weight")
        missing = [n for n in expected if n not in present]
        extra = sorted(present - expected.keys())
        problems = []
        if missing:
            problems.append(f"{len(missing)} tensors missing (first: {missing[:3]})")
        if extra:
            problems.append(f"{len(extra)} unexpected tensors (first: {extra[:3]})")
        for name, shape in expected.items():
            if name in present and self.shape(name) != shape:
                problems.append(f"{name} has shape {self.shape(name)}, config.json implies {shape}")
                break
        if problems:
            raise CheckpointMismatchError(
                f"{self.path}: checkpoint does not match its config.json ({arch.model_type}, "
                f"{arch.num_layers} layers, {arch.num_experts} experts): " + "; ".join(problems))


def _rank_info():
    """(layer_offset, expert_offset, tp rank/size, etp rank/size) of this rank."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        etp=(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
        pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        ep=(ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
    )


def _local_units(model, arch: ModelArch) -> list[tuple[torch.nn.Parameter, hf_mapping.Unit]]:
    """This rank's parameters paired with their units, in model order."""
    info = _rank_info()
    layer_offset = info["pp"][0] * (arch.num_layers // info["pp"][1])
    expert_offset = info["ep"][0] * (arch.num_experts // info["ep"][1]) if arch.is_moe else 0
    by_key = {u.key: u for u in hf_mapping.units(arch)}
    tied_output = "embedding.word_embeddings.weight" if arch.tie_word_embeddings else None
    pairs = []
    for name, param in model.named_parameters():
        key = hf_mapping.global_key(name, layer_offset, expert_offset)
        if key == "output_layer.weight" and tied_output:
            key = tied_output  # last PP stage's copy of the tied embedding
        if key not in by_key:
            raise CheckpointMismatchError(f"Megatron parameter {name} (global {key}) has no HF counterpart")
        pairs.append((param, by_key[key], name))
    return pairs


def load_hf_weights(model, arch: ModelArch, hf_dir: str | Path) -> None:
    """Fill this rank's parameters of ``model`` from the HF checkpoint in ``hf_dir``."""
    reader = HFCheckpointReader(hf_dir)
    reader.check_against(arch)
    info = _rank_info()
    with torch.no_grad():
        for param, unit, name in _local_units(model, arch):
            rank, size = info[unit.group] if unit.group else (0, 1)
            shard = hf_mapping.shard_from_hf(unit, reader.read, rank, size, arch)
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointMismatchError(
                    f"{name}: HF shard shape {tuple(shard.shape)} != Megatron parameter {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))


def _group(unit: hf_mapping.Unit):
    from megatron.core import parallel_state as ps

    if unit.group == "tp":
        return ps.get_tensor_model_parallel_group()
    if unit.group == "etp":
        return ps.get_expert_tensor_parallel_group()
    return None


def _gather_unit(param: torch.Tensor, unit: hf_mapping.Unit) -> list[torch.Tensor]:
    group = _group(unit)
    if group is None or dist.get_world_size(group) == 1:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


def export_hf_buckets(model, arch: ModelArch, *, bucket_bytes: int = 512 << 20,
                      dtype: torch.dtype | None = None, dst: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the full model as HF-named tensors in buckets of at most ``bucket_bytes``
    (a single larger tensor gets a bucket of its own), on rank ``dst`` only.

    Collective: every rank of the world must iterate it to the end (the other ranks gather
    their tensor-parallel shards and send what they own to ``dst``; they yield nothing).
    Received tensors are allocated on ``dst``'s current device (CUDA under NCCL). Memory
    beyond the model is one gathered unit plus one bucket. Tensors may alias the model's
    parameters (units ``dst`` holds whole): consume or copy them before the next optimizer step.
    """
    mine = {unit.key: (param, unit) for param, unit, _ in _local_units(model, arch)}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not 0 <= dst < world:
        raise ValueError(f"dst={dst}: not a rank of this world of {world}")
    held = [sorted(mine)]
    if world > 1:
        held = [None] * world
        dist.all_gather_object(held, sorted(mine))
    owner = {}
    for rank, keys in enumerate(held):
        for key in keys:
            owner.setdefault(key, rank)
    owner.update({key: dst for key in held[dst]})  # what dst holds itself never travels
    shapes = hf_mapping.hf_shapes(arch)
    me = dist.get_rank() if world > 1 else 0
    device = next(model.parameters()).device
    bucket, size = [], 0
    for unit in hf_mapping.units(arch):
        pieces = {}
        if unit.key in mine:
            param, _ = mine[unit.key]
            pieces = dict(hf_mapping.hf_from_shards(unit, _gather_unit(param, unit), arch))
        src = owner[unit.key]
        for name in unit.hf_names:
            if me == src and me != dst:
                dist.send(pieces[name].contiguous(), dst=dst)
                continue
            if me != dst:
                continue
            if src == dst:
                tensor = pieces[name]
            else:  # a fresh buffer, never a view of a parameter
                tensor = torch.empty(shapes[name], dtype=_model_dtype(model), device=device)
                dist.recv(tensor, src=src)
            if dtype is not None:
                tensor = tensor.to(dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
    if bucket:
        yield bucket


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def save_hf_checkpoint(model, arch: ModelArch, out_dir: str | Path, *, hf_config: dict,
                       tokenizer_dir: str | Path | None = None, shard_bytes: int = 2 << 30,
                       progress=None) -> None:
    """Write ``model`` as a HF safetensors checkpoint (+ config.json and tokenizer files).

    Collective. Rank 0 writes into a temporary sibling directory and renames it into place
    at the end, so an interrupted save never leaves a directory that looks complete.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = None
    if rank == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    weight_map, shard, shard_size, files = {}, {}, 0, []

    def flush():
        nonlocal shard, shard_size
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update({n: fname for n in shard})
            shard, shard_size = {}, 0

    for bucket in export_hf_buckets(model, arch, bucket_bytes=min(shard_bytes, 512 << 20)):  # rank 0's
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if shard and shard_size + nbytes > shard_bytes:
                flush()
            shard[name] = tensor.to("cpu", copy=True)  # shards wait in host memory
            shard_size += nbytes
        if progress:
            progress(sum(t.numel() * t.element_size() for _, t in bucket))
    if rank == 0:
        flush()
        _finish_hf_dir(tmp, out_dir, files, weight_map, hf_config, tokenizer_dir)
    if dist.is_initialized():
        dist.barrier()


def _finish_hf_dir(tmp: Path, out_dir: Path, files, weight_map, hf_config, tokenizer_dir) -> None:
    total = sum((tmp / f).stat().st_size for f in files)
    if len(files) == 1:
        os.rename(tmp / files[0], tmp / "model.safetensors")
    else:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
    from megatron_marsrl.outputs import replace

    replace(tmp, out_dir, kind="hf")  # never deletes a directory marsrl did not write
