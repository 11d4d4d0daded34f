"""marsrl selfcheck: the embedded CPU main job until the trainer lands.

Builds a tiny random Qwen3-MoE checkpoint with transformers, converts it HF -> Megatron under
one layout (EP2, 2 gloo ranks), Megatron -> HF under another (TP2), and checks:
  * the round-tripped HF tensors equal the originals bit for bit,
  * Megatron's logits and temperature-scaled log-probs equal transformers' (fp32, 1e-4)
    under TP2+EP2 and PP2.
Prints where the checkpoints are. Exit code 0 only if every check passes.
"""
from __future__ import annotations

import time
from pathlib import Path

TOLERANCE = 1e-4


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="outputs/selfcheck",
                        help="working directory: new, empty or an earlier self-check's (default: outputs/selfcheck)")
    parser.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "qwen3", "llama"),
                        help="tiny model family to check (default qwen3_moe)")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded
    from megatron_marsrl.megatron.launch import ONE_THREAD, fork_server

    # its three 2-rank jobs fork their ranks from one process that imported torch and
    # megatron.core once, instead of each rank importing them (~7 s per rank)
    with fork_server(env=ONE_THREAD):  # the environment megatron/convert.py's jobs get
        return guarded(lambda: _check(args))


def _check(args) -> int:
    import torch
    from safetensors.torch import load_file

    from megatron_marsrl.megatron.convert import hf_to_mcore, mcore_to_hf
    from megatron_marsrl.megatron.launch import ONE_THREAD, launch
    from megatron_marsrl.megatron.parallel import ParallelConfig
    from megatron_marsrl.megatron.tiny import make_hf_checkpoint
    from megatron_marsrl.outputs import prepare_dir

    # --out must be new, empty or an earlier self-check's (marked) directory; force=True below
    # then replaces only the outputs an earlier self-check wrote there.
    out = prepare_dir(Path(args.out).resolve(), kind="selfcheck")
    moe = args.family == "qwen3_moe"
    start = time.perf_counter()
    hf = make_hf_checkpoint(args.family, out / "hf", seed=0)
    print(f"[selfcheck] tiny {args.family} HF checkpoint: {hf}")
    hf_to_mcore(hf, out / "mcore", ParallelConfig(ep=2) if moe else ParallelConfig(tp=2), force=True)
    mcore_to_hf(out / "mcore", out / "hf_roundtrip", ParallelConfig(tp=2), force=True)
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(out / "hf_roundtrip" / "model.safetensors"))
    exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"[selfcheck] round trip HF -> Megatron -> HF: {len(a)} tensors, bit-exact: {exact}")
    ok = exact
    layouts = {"tp2+ep2": {"tp": 2, "ep": 2}, "pp2": {"pp": 2}} if moe else {"tp2": {"tp": 2}, "pp2": {"pp": 2}}
    # every layout in one launch of 2 ranks (Megatron's groups rebuilt between them): one start-up
    per_rank = launch("megatron_marsrl.megatron.verify:parity_reports", 2,
                      {"cases": [{"hf_dir": str(hf), "layout": layout} for layout in layouts.values()]},
                      env=ONE_THREAD)
    for i, name in enumerate(layouts):
        reports = [rank_reports[i] for rank_reports in per_rank]
        logit = max(r["logit_diff"] for r in reports if r["logit_diff"] is not None)
        logprob = max(r["logprob_diff"] for r in reports)
        passed = logit < TOLERANCE and logprob < TOLERANCE and not any(r["export_mismatched"] for r in reports)
        ok &= passed
        print(f"[selfcheck] {name}: max |logit - HF| {logit:.2e}, max |logprob - HF| {logprob:.2e} "
              f"-> {'ok' if passed else 'FAILED'}")
    print(f"[selfcheck] {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    print(f"[selfcheck] checkpoints: HF {hf}, Megatron {out / 'mcore'}, round trip {out / 'hf_roundtrip'}")
    return 0 if ok else 1
