"""HF <-> Megatron (torch_dist) checkpoint conversion, runnable on CPU.

The parent process validates everything it can cheaply (files, config, tensor names and
shapes, layout) so bad input fails in a second with a clear message; the conversion itself runs
on as many local ranks as the layout needs (``launch``), each rank reading only its slices.
Outputs are written to a temporary sibling and renamed into place at the very end; an existing
output is replaced only with ``force`` and only if marsrl wrote it (``megatron_marsrl.outputs``).
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from megatron_marsrl.megatron import dist_checkpoint
from megatron_marsrl.megatron.hf_checkpoint import TOKENIZER_FILES, HFCheckpointReader
from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.parallel import ParallelConfig
from megatron_marsrl.outputs import check_replaceable

FORMAT = "marsrl-mcore-v1"


class ConversionError(RuntimeError):
    """A conversion failed; the output directory was not created."""


def min_world_size(parallel: ParallelConfig) -> int:
    """Fewest ranks realising ``parallel``: TP*PP*DP with DP just large enough that
    the expert grid (EP*ETP) tiles the DP*TP ranks."""
    expert = parallel.ep * parallel.expert_tp
    dp = expert // math.gcd(parallel.tp, expert)
    return parallel.tp * parallel.pp * dp


def _log(msg: str) -> None:
    print(f"[marsrl convert] {msg}", flush=True)


def hf_to_mcore(input_dir: str | Path, output_dir: str | Path, parallel: ParallelConfig, *,
                force: bool = False) -> dict:
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    check_replaceable(output_dir, force=force)  # --force replaces only our own outputs
    arch = ModelArch.from_hf_dir(input_dir)
    reader = HFCheckpointReader(input_dir)
    reader.check_against(arch)
    world = min_world_size(parallel)
    parallel.validate(arch, world)
    nbytes = sum((input_dir / f).stat().st_size for f in set(reader.weight_map.values()))
    _log(f"{input_dir}: {arch.model_type}, {arch.num_layers} layers, {arch.num_experts} experts, "
         f"{nbytes / 1e6:.1f} MB; layout tp={parallel.tp} pp={parallel.pp} ep={parallel.ep} "
         f"etp={parallel.expert_tp} on {world} rank(s)")
    start = time.perf_counter()
    _launch(output_dir, "megatron_marsrl.megatron.convert:_hf_to_mcore_rank", world, {
        "input_dir": str(input_dir), "output_dir": str(output_dir), "layout": _layout_dict(parallel)})
    seconds = time.perf_counter() - start
    _log(f"wrote {output_dir} in {seconds:.1f} s, process start-up included ({nbytes / seconds / 1e6:.1f} MB/s)")
    return {"bytes": nbytes, "seconds": seconds, "world_size": world}


def mcore_to_hf(input_dir: str | Path, output_dir: str | Path, parallel: ParallelConfig | None = None, *,
                force: bool = False) -> dict:
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    check_replaceable(output_dir, force=force)  # --force replaces only our own outputs
    meta = dist_checkpoint.read_meta(input_dir)
    if meta.get("format") != FORMAT or "hf_config" not in meta:
        raise ValueError(f"{input_dir} was not written by marsrl (format {meta.get('format')!r}, want {FORMAT})")
    arch = ModelArch.from_hf_dict(meta["hf_config"], source=f"{input_dir}/{dist_checkpoint.META_FILE}")
    parallel = parallel or ParallelConfig()
    world = min_world_size(parallel)
    parallel.validate(arch, world)
    _log(f"{input_dir}: {arch.model_type}, saved under {meta.get('layout')}; exporting on {world} rank(s)")
    start = time.perf_counter()
    _launch(output_dir, "megatron_marsrl.megatron.convert:_mcore_to_hf_rank", world, {
        "input_dir": str(input_dir), "output_dir": str(output_dir), "layout": _layout_dict(parallel)})
    seconds = time.perf_counter() - start
    nbytes = sum(p.stat().st_size for p in output_dir.glob("*.safetensors"))
    _log(f"wrote {output_dir} in {seconds:.1f} s ({nbytes / 1e6:.1f} MB)")
    return {"bytes": nbytes, "seconds": seconds, "world_size": world}


def _layout_dict(parallel: ParallelConfig) -> dict:
    return {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "etp": parallel.etp,
            "sequence_parallel": parallel.sequence_parallel}


def _launch(output_dir: Path, target: str, world: int, kwargs: dict) -> None:
    from megatron_marsrl.megatron.launch import ONE_THREAD, LaunchError, launch

    try:
        launch(target, world, kwargs, env=ONE_THREAD)
    except LaunchError as exc:
        remove_partial_outputs(output_dir)
        raise ConversionError(f"conversion failed; no output was written.\n{exc}") from exc


def _build(arch: ModelArch, layout: dict):
    from megatron_marsrl.megatron.model import build_model
    from megatron_marsrl.megatron.parallel import init_parallel

    parallel = ParallelConfig(**layout)
    init_parallel(parallel, arch)
    return build_model(arch, parallel)


def _hf_to_mcore_rank(input_dir: str, output_dir: str, layout: dict) -> None:
    from megatron_marsrl.megatron.hf_checkpoint import load_hf_weights

    arch = ModelArch.from_hf_dir(input_dir)
    model = _build(arch, layout)
    load_hf_weights(model, arch, input_dir)
    hf_config = json.loads((Path(input_dir) / "config.json").read_text())
    tokenizer = {f"tokenizer/{n}": Path(input_dir) / n for n in TOKENIZER_FILES if (Path(input_dir) / n).is_file()}
    dist_checkpoint.save_checkpoint(output_dir, model, meta={
        "format": FORMAT, "hf_config": hf_config, "layout": layout, "step": 0}, extra_files=tokenizer)


def _mcore_to_hf_rank(input_dir: str, output_dir: str, layout: dict) -> None:
    from megatron_marsrl.megatron.hf_checkpoint import save_hf_checkpoint

    meta = dist_checkpoint.read_meta(input_dir)
    arch = ModelArch.from_hf_dict(meta["hf_config"])
    model = _build(arch, layout)
    dist_checkpoint.load_checkpoint(input_dir, model)
    tokenizer_dir = Path(input_dir) / "tokenizer"
    save_hf_checkpoint(model, arch, output_dir, hf_config=meta["hf_config"],
                       tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None)


def remove_partial_outputs(output_dir: str | Path) -> int:
    """Delete temporary siblings left by killed conversions; returns how many were removed."""
    output_dir = Path(output_dir)
    removed = 0
    for stale in output_dir.parent.glob(f".{output_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
        removed += 1
    return removed
