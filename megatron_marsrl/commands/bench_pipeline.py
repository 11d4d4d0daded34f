"""marsrl bench pipeline: step time of synchronous RL versus the MarsRL agentic pipeline with
the overlapping micro-batch scheduler.

    marsrl bench pipeline --simulate                        # 64 x H100, Qwen3-30B-A3B, MarsRL recipe
    marsrl bench pipeline --simulate --rollout-gpus 40 --segment-tokens 0 --json out.json
    marsrl bench pipeline --simulate --set length_sigma=1.5 --set continue_fraction=0.6
    marsrl bench pipeline --steps 6                          # measured: tiny_arithmetic, 3 modes + prediction

--simulate projects the figures with the discrete-event model of megatron_marsrl.rl.simulate
(every assumption is a SimConfig field: the flags below set the main ones, --set any of them).
Without --simulate the real pipeline is measured (megatron_marsrl.rl.bench_real) in the
simulator's three modes, and the simulator, calibrated on the measured sync run
(megatron_marsrl.rl.sim_calibrate), predicts each: printed side by side with the error.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

# flag -> (SimConfig field, type, help)
_FLAGS = {
    "--problems": ("problems_per_step", int, "new problems per step (default 128)"),
    "--group-size": ("group_size", int, "samples per group, G (default 8)"),
    "--inputs-per-stage": ("inputs_per_stage", int, "inputs each later stage takes, k (default 2)"),
    "--max-stages": ("max_stages", int, "agent stages per trajectory, S (default 5)"),
    "--mean-tokens": ("mean_tokens", int, "mean output length (default 20000)"),
    "--max-tokens": ("max_tokens", int, "output cap (default 65536)"),
    "--sigma": ("length_sigma", float, "lognormal shape of the lengths; 0: constant (default 1.0)"),
    "--segment-tokens": ("segment_tokens", int, "segment rollout cap in the pipeline modes; 0: off (default 16384)"),
    "--gpus": ("num_gpus", int, "GPUs in the cluster (default 64)"),
    "--rollout-gpus": ("rollout_gpus", int, "GPUs that only generate (the rest only train); 0: colocated (default)"),
    "--gpus-per-engine": ("gpus_per_engine", int, "GPUs per rollout engine (default 4)"),
    "--concurrency": ("engine_concurrency", int, "sequences one engine decodes at once (default 128)"),
    "--decode-tps": ("decode_tokens_per_s", float, "decode tokens/s of one sequence (default 50)"),
    "--train-tps": ("train_tokens_per_s_per_gpu", float, "training tokens/s per GPU (default 4000)"),
    "--gpus-per-replica": ("train_gpus_per_replica", int, "GPUs per data-parallel training replica (default 8)"),
    "--weight-sync-s": ("weight_sync_s", float, "optimizer step + weight sync seconds per step (default 20)"),
    "--steps": ("measured_steps", int, "steps per mode (default 8 simulated, 6 measured)"),
    "--seed": ("seed", int, "random seed (default 0)"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--simulate", action="store_true",
                        help="project the step times with the discrete-event model instead of measuring")
    sim = parser.add_argument_group("simulation (--simulate)")
    for flag, (_, kind, help_text) in _FLAGS.items():
        sim.add_argument(flag, type=kind, default=None, help=help_text)
    sim.add_argument("--separate-policies", action="store_true", help="one policy per role instead of a shared one")
    sim.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="set any SimConfig field (repeatable), e.g. --set continue_fraction=0.6")
    real = parser.add_argument_group("measured (default): sync, pipeline, pipeline+overlap, each next to the "
                                     "simulator's prediction (calibrated on the sync run)")
    real.add_argument("--recipe", default="tiny_arithmetic", help="recipe every mode trains (default tiny_arithmetic)")
    real.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="train config override applied to every mode (repeatable)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file ('-': stdout only)")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    if args.simulate:
        return guarded(lambda: _simulate(args))
    try:
        from megatron_marsrl.rl.bench_real import run_real
    except ModuleNotFoundError as exc:
        if exc.name != "megatron_marsrl.rl.bench_real":
            raise
        print("error: measuring the real pipeline needs megatron_marsrl.rl.bench_real, which is not installed "
              "in this checkout; use --simulate for the projected figures", file=sys.stderr)
        return 2
    return guarded(lambda: int(run_real(args) or 0))


def sim_config_from_args(args):
    """SimConfig defaults, then the flags given, then each --set override."""
    from megatron_marsrl.rl.overrides import apply_overrides
    from megatron_marsrl.rl.simulate import SimConfig

    fields = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _, _) in _FLAGS.items()}
    fields = {name: value for name, value in fields.items() if value is not None}
    if fields.get("segment_tokens") == 0:
        fields["segment_tokens"] = None
    if fields.get("rollout_gpus") == 0:
        fields["rollout_gpus"] = None
    if args.separate_policies:
        fields["separate_policies"] = True
    return apply_overrides(dataclasses.replace(SimConfig(), **fields), args.set)


def _simulate(args) -> int:
    from megatron_marsrl.rl.simulate import simulate

    result = simulate(sim_config_from_args(args))
    if args.json == "-":
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
    return 0


def _print(result) -> None:
    cfg = result.config
    lengths = cfg.length_model()
    placement = ("colocated" if cfg.colocated
                 else f"{cfg.generation_gpus} generate / {cfg.training_gpus} train")
    segments = f"segments of {cfg.segment_tokens}" if cfg.segment_tokens else "no segments"
    print(f"bench pipeline --simulate: {cfg.num_gpus} GPUs ({placement}), "
          f"{cfg.generation_gpus // cfg.gpus_per_engine} engines x {cfg.engine_concurrency} sequences at "
          f"{cfg.decode_tokens_per_s:g} tok/s, {cfg.dp_size} training replicas at "
          f"{cfg.train_tokens_per_s_per_gpu:g} tok/s/GPU")
    print(f"  {cfg.problems_per_step} problems/step, G={cfg.group_size} k={cfg.inputs_per_stage} "
          f"S={cfg.max_stages}; outputs mean {cfg.mean_tokens:g} max {cfg.max_tokens} "
          f"({lengths.truncated_fraction():.1%} truncated), {segments}; median of {cfg.measured_steps} steps")
    print(f"{'mode':<18}{'step s':>9}{'rollout s':>11}{'samples/s':>11}{'train idle':>12}"
          f"{'rollout idle':>14}{'overlapped':>12}{'speed-up':>10}")
    for name, row in result.modes.items():
        print(f"{name:<18}{row.median_step_s:>9.0f}{row.median_rollout_s:>11.0f}{row.samples_per_s:>11.2f}"
              f"{row.train_idle_fraction:>12.1%}{row.rollout_idle_fraction:>14.1%}"
              f"{row.overlapped_rounds_fraction:>12.1%}{result.speedup[name]:>9.2f}x")
