"""The parts of an RL step, wired together: what `loop.train` calls by name.

Process roles: every rank holds its shard of each policy (Megatron); rank 0 additionally
owns the rollout engine pools (its node's engines, and the SGLang servers the first rank of
every other node starts: rl/node_engines.py), the agents (in a background thread,
`RolloutDriver`), the micro-batch scheduler, TensorBoard and the console. Rank 0 broadcasts each training round
(one micro-batch per data-parallel rank, one policy) on a control group; the other ranks
follow, so every collective inside Megatron runs in the same order everywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_marsrl.algorithms.advantages import batch_from_samples, compute_advantages
from megatron_marsrl.algorithms.losses import PolicyLossInputs, dmmpt_gate, policy_loss
from megatron_marsrl.data_types import Group, Sample
from megatron_marsrl.megatron.actor import PolicyActor, Sequence, pack_sequences
from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.parallel import gather_data_parallel, init_parallel, sum_data_parallel
from megatron_marsrl.precision import choose_dtype
from megatron_marsrl.procs import StopSignals, exit_with_launcher
from megatron_marsrl.rl import checkpoint
from megatron_marsrl.rl.config import ROLES, TrainConfig
from megatron_marsrl.rl.data import dataset_from_spec
from megatron_marsrl.rl.node_engines import NodeEngines, NodeRank, check_placement, gather_remote, spreads
from megatron_marsrl.rl.messages import StepAbort, StepEnd, StepMessage, TrainPhase, TrainRound, Update
from megatron_marsrl.rl.scheduler import MicroBatchScheduler, Round, SeqItem
from megatron_marsrl.rl.train_metrics import MetricSums, mismatch_metrics, weigh

log = logging.getLogger(__name__)


class Trainer:
    """Holds the policies (all ranks), the rollout side (rank 0) and a node's SGLang servers
    (the first rank of every other node) of one run."""

    def __init__(self, config: TrainConfig, *, resume: bool = False):
        self.config = config
        self.run_dir = Path(config.run.output_dir)
        if not resume and checkpoint.latest(self.run_dir) is not None:
            raise FileExistsError(f"{self.run_dir} already holds checkpoints of a run: pass --resume to continue "
                                  "it, or choose another run.output_dir (nothing was changed)")
        exit_with_launcher()  # ...taking every process this rank starts along
        where = NodeRank.from_env()
        check_placement(config, where)
        if int(os.environ.get("RANK", 0)) == 0:  # the rank that reads them: a bad dataset fails before the warm start
            for spec in filter(None, (config.task.train, config.task.eval)):
                dataset_from_spec(spec)
        self.hf_dir = self._initial_model()
        self.arch = ModelArch.from_hf_dir(self.hf_dir)
        init_parallel(config.parallel, self.arch, seed=config.run.seed)
        self.rank = dist.get_rank()
        self.control = dist.new_group(backend="gloo", timeout=timedelta(hours=6))
        self.precision = choose_dtype(config.model.dtype)
        if self.rank == 0:
            log.info("training dtype: %s (%s)", self.precision.name, self.precision.reason)
        dtype = self.precision.dtype
        if config.warm_start is not None:
            self.hf_dir = self._warm_start(config.warm_start)
        self.actors = {name: PolicyActor(name, self.arch, config.parallel, config.optim, hf_dir=str(self.hf_dir),
                                         dtype=dtype, reference=config.policy.reference,
                                         moe_aux_loss_coeff=config.model.moe_aux_loss_coeff)
                       for name in config.policy_names()}
        # The post-sync probe (mean |diff| of log-probs) catches wrong tensors (differences of
        # nats); it must not trip on the engine's own precision: fp32 agrees to ~1e-6; bf16 to
        # ~1e-2 on the tiny models and 0.05-0.11 on SmolLM2-135M (embedded engine against
        # Megatron, rising as the policy sharpens over 36 steps); FP8 rollout (engine.quantization)
        # differs by design and is watched through train/mismatch_* instead. The bit-for-bit
        # read-back catches a sync that did nothing.
        self.probe_tolerance = (1e-3 if dtype == torch.float32 else 0.3) if not config.engine.quantization else 5.0
        self.rollout = self.node_engines = None
        self.time_share = None
        if config.pipeline.time_shared:
            from megatron_marsrl.rl.time_share import TimeShare

            # The trainer leaves the GPU before the engines start, so that SGLang sizes its KV
            # pool for the GPU it has to itself in the rollout phase.
            self.time_share = TimeShare(self.actors, None, group=self.control)
            self.time_share.start()
        try:
            self._start_engines(where)
        except BaseException:
            self.close()
            raise
        if self.time_share is not None and self.rollout is not None:
            self.time_share.pools = self.rollout.pools
        self.start_step = 0
        self._policy_entropy: dict[str, float] = {}
        """Each policy's mean token entropy in the last step trained (all ranks): DMMPT's gate."""
        self._step_updates: defaultdict[str, list[dict]] = defaultdict(list)
        """The running step's PPO mini-batch updates per policy (their optimizer reports)."""
        self.stop_signals = StopSignals().install()
        if resume:
            try:
                self._resume()
            except BaseException:  # e.g. a checkpoint of another layout: stop the engines too
                self.close()
                raise
        if self.rank == 0:
            self._save_config()

    # ---- set-up -----------------------------------------------------------------------
    def _start_engines(self, where: NodeRank) -> None:
        """Rank 0: its node's engines, the agents and the driver (RolloutSide); the first rank
        of every other node: that node's SGLang servers (NodeEngines), which rank 0's pools
        then reach over HTTP."""
        config = self.config
        if spreads(config, where) and where.node > 0 and where.local_rank == 0:
            self.node_engines = NodeEngines(config, str(self.hf_dir), where)
        if self.rank == 0:
            # An in-process engine (SGLang's CPU path) samples in the rollout thread through
            # torch's global CPU RNG; Megatron's RNG tracker notices the change on every forward
            # and warns. Training draws no random numbers (no dropout): nothing to learn from it.
            logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
            from megatron_marsrl.rl.rollout_side import RolloutSide

            self.rollout = RolloutSide(config, str(self.hf_dir), dtype=self.precision.dtype)
            log.info("rollout engines started: %s", ", ".join(f"policy {name}: {len(pool.engines)} x {config.engine.kind}"
                                                            for name, pool in self.rollout.pools.items()))
        if spreads(config, where):  # every node's engines serve rank 0's pools
            remote = gather_remote(self.control, self.node_engines)
            if self.rollout is not None:
                self.rollout.attach_remote(remote, str(self.hf_dir))

    def _initial_model(self) -> Path:
        """The HF checkpoint training starts from: model.path, or one rank 0 writes to
        run_dir/initial_model (the embedded task's tiny model, or a GGUF file converted)."""
        source = self.config.model.path
        path = self.config.model.start_checkpoint(self.run_dir)
        if not self.config.model.built_at_start:
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model.path={str(path)!r} has no config.json; give a local HF "
                                        "checkpoint directory, a .gguf file, or 'task' for the task's tiny model")
            return path
        rank = int(os.environ.get("RANK", 0))
        if rank == 0 and not (path / "config.json").is_file():
            if source == "task":
                from megatron_marsrl.agents import arithmetic

                arithmetic.build_model(path, seed=self.config.run.seed, overrides=self.config.task.tiny_model)
            else:
                from megatron_marsrl.gguf import gguf_to_hf

                gguf_to_hf(source, path, log=log.info)
        deadline = time.time() + 300
        while not (path / "tokenizer_config.json").is_file():  # other ranks wait for rank 0
            if time.time() > deadline:
                raise TimeoutError(f"rank {rank}: {path} did not appear within 300 s")
            time.sleep(0.2)
        return path

    def _warm_start(self, warm) -> Path:
        """Supervised fine-tuning of the starting checkpoint (sft.fine_tune on these ranks) into
        run_dir/warm_start/hf, unless a finished one with the same settings is there."""
        import hashlib
        import json

        from megatron_marsrl import outputs, sft
        from megatron_marsrl.megatron.optim import OptimConfig

        out = self.run_dir / "warm_start"
        if warm.data == "task":
            from megatron_marsrl.agents.arithmetic import demonstrations
            from megatron_marsrl.rl.data import arithmetic_phrasings
            from megatron_marsrl.rl.rollout_side import role_set

            conversations = demonstrations(arithmetic_phrasings(dataset_from_spec(self.config.task.train)),
                                           seed=self.config.run.seed, roles=role_set(self.config.task.name))
        else:
            conversations = sft.load_conversations(warm.data)
        # the conversations themselves are part of the key: a changed file or task reruns it
        digest = hashlib.sha256(json.dumps(conversations, sort_keys=True).encode()).hexdigest()
        # the model as configured, not the run's own copy of it (run_dir/initial_model): a warm
        # start copied into another run directory with the same settings is reused there
        model = self.config.model
        source = {"path": model.path, **({"tiny_model": self.config.task.tiny_model} if model.path == "task" else {})}
        settings = {**dataclasses.asdict(warm), "model": source, "seed": self.config.run.seed,
                    "layout": dataclasses.asdict(self.config.parallel), "dtype": self.precision.name,
                    "clip_grad": self.config.optim.clip_grad, "conversations_sha256": digest}
        done = out / "hf" / "config.json"
        reuse = self._broadcast(done.is_file() and (out / "settings.json").is_file() and
                                json.loads((out / "settings.json").read_text()) == settings
                                if self.rank == 0 else None)  # rank 0 decides for all
        if reuse:
            return done.parent
        cfg = sft.SFTConfig(model=str(self.hf_dir), data=warm.data, output_dir=str(out), epochs=warm.epochs,
                            batch_sequences=warm.batch_sequences, dtype=self.precision.name,
                            seed=self.config.run.seed, parallel=self.config.parallel,
                            optim=OptimConfig(lr=warm.lr, clip_grad=self.config.optim.clip_grad))
        if self.rank == 0:
            if out.exists():
                outputs.remove(out)
            outputs.prepare_dir(out, kind="warm_start")
        dist.barrier()
        start = time.perf_counter()
        summary = sft.fine_tune(cfg, conversations, quiet=True)
        if self.rank == 0:
            seconds = time.perf_counter() - start
            (out / "summary.json").write_text(json.dumps({**summary, "seconds": seconds}, indent=1))
            (out / "settings.json").write_text(json.dumps(settings, indent=1))
            from megatron_marsrl.rl.console import terminal

            print(f"warm start: {summary['steps']} SFT steps on {summary['train_examples']} conversations, "
                  f"loss {summary['train_loss_last']:.3f} at the end ({seconds:.0f} s): {out}",
                  file=terminal(), flush=True)
        return out / "hf"

    def stop_requested(self) -> bool:
        """True on every rank when any rank got SIGTERM/SIGINT."""
        flag = torch.tensor([1 if self.stop_signals.name else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def _broadcast(self, obj=None):
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, group=self.control)
        return holder[0]

    def _tell(self, msg: StepMessage) -> None:
        """Rank 0: send a step's message to the other ranks (messages.py)."""
        self._broadcast(msg)

    # ---- rollouts + training of one step ------------------------------------------------
    def start_rollouts(self, step: int) -> None:
        if self.rollout is not None:
            self.rollout.start_step(step)

    def train_while_generating(self, step: int) -> tuple[list[Sample], dict]:
        """Train each unit of groups as soon as the scheduler packs it, while the rest is still
        being generated. Returns the step's samples (rank 0; [] elsewhere) and train metrics."""
        acc = MetricSums()
        self._step_updates.clear()
        if self.rank == 0:
            samples, timing = self._lead_step(step, acc)
        else:
            samples, timing = [], {}
            self._follow_step(step, acc)
        return samples, {**self._reduce(acc), **timing}

    def _follow_step(self, step: int, acc: MetricSums) -> None:
        """Ranks other than 0: train the rounds rank 0 sends until the step ends or aborts."""
        while True:
            match self._broadcast():
                case TrainRound(policy=policy, micro_batches=payload):
                    self._run_round(policy, payload, acc)
                case Update(policy=policy):
                    self._update(policy, acc)
                case TrainPhase():
                    self.time_share.to_training()
                case StepEnd():
                    return
                case StepAbort(reason=reason, by_signal=by_signal):
                    raise StepAborted(f"rank 0 stopped step {step}: {reason}", by_signal=by_signal)
                case msg:
                    raise TypeError(f"rank {self.rank}: unexpected control message {msg!r} in step {step}")

    def _lead_step(self, step: int, acc: MetricSums) -> tuple[list[Sample], dict]:
        cfg = self.config
        sched = MicroBatchScheduler(cfg.scheduler, dp_size=_dp_size(), policies=cfg.policy_names())
        sched.begin_step(step, version=step)
        samples, seqs = [], {}
        start = time.perf_counter()
        t = {"train": 0.0, "idle": 0.0, "rounds": []}
        since_update: defaultdict[str, int] = defaultdict(int)  # sequences trained per policy
        while True:
            wait = time.perf_counter()
            unit = self._from_rollout(step, self._next_unit)
            t["idle"] += time.perf_counter() - wait
            if unit is None:
                break
            self._from_rollout(step, lambda: [sched.add_group(items) for items in
                                              self._prepare_unit(unit, seqs, samples)])
            # A failure inside a round is not caught: the other ranks are inside Megatron's
            # collectives with us, so the process must end and torchrun tear the job down.
            self._train_rounds(sched.pop_ready(), seqs, acc, t, since_update)
            self._mini_batch_updates(since_update, acc)
        if self.time_share is not None:  # nothing trained yet (no overlap): the engines make room
            self._tell(TrainPhase())
            self.time_share.to_training()
        self._train_rounds(sched.finish_step(), seqs, acc, t, since_update)  # the rest: optimizer_step
        self._tell(StepEnd())
        finished = self.rollout.driver.finished_at
        during = sum(max(0.0, min(end, finished) - begin) for begin, end in t["rounds"])
        return samples, {"time/rollout": finished - start, "time/train": t["train"], "time/train_idle": t["idle"],
                         "time/overlap_fraction": during / t["train"] if t["train"] else 0.0,
                         "time/rollout_and_train": time.perf_counter() - start}

    def _from_rollout(self, step: int, fn):
        """Run a rollout-side call; if it fails (engines gave up, a stop signal, bad data) tell
        the other ranks to abort the step (they wait on the control group, not in Megatron)."""
        try:
            return fn()
        except Exception as exc:
            by_signal = isinstance(exc, _Interrupted)
            self._tell(StepAbort(reason=f"{type(exc).__name__}: {exc}", by_signal=by_signal))
            self.rollout.abort()
            raise StepAborted(f"step {step} stopped: {type(exc).__name__}: {exc}", by_signal=by_signal) from exc

    def _next_unit(self) -> list[Group] | None:
        """The driver's next unit, polling for a stop signal while waiting."""
        import queue

        while True:
            if self.stop_signals.name:
                raise _Interrupted(self.stop_signals.name)
            try:
                return self.rollout.driver.next_unit(timeout=0.5)
            except queue.Empty:
                continue

    def _prepare_unit(self, unit: list[Group], seqs: dict, samples: list) -> list[list[SeqItem]]:
        """Advantages of one unit (all its groups pool within one problem; kept on each
        `Sample.advantage`), training sequences, and scheduler items (one list per group)."""
        unit_samples = [s for g in unit for s in g.samples]
        adv = compute_advantages(batch_from_samples(unit_samples), self.config.advantage)
        out = []
        mask_old = self.config.pipeline.segment_old_tokens == "mask"
        for sample, a in zip(unit_samples, adv.tolist()):
            sample.advantage = a
            seqs[sample.sample_id] = (sample.role, _sequence(sample, self.rollout.version, mask_old))
        samples.extend(unit_samples)
        for g in unit:
            # With segment rollout a group holds samples finished in earlier steps: their tokens
            # are masked (or importance-corrected), so every item trains as the current version;
            # samples with nothing left to train are not scheduled.
            items = [SeqItem(key=s.sample_id, policy=self.config.policy_of(s.role), group_id=g.group_id,
                             num_tokens=len(s.prompt_token_ids or []) + len(s.response_token_ids or []),
                             version=self.rollout.version)
                     for s in g.samples if s.response_token_ids and _trainable(seqs[s.sample_id][1])]
            if items:
                out.append(items)
        return out

    def _train_rounds(self, rounds: list[Round], seqs: dict, acc: MetricSums, t: dict,
                      since_update: defaultdict[str, int]) -> None:
        for rnd in rounds:
            since_update[rnd.policy] += sum(len(mb.items) for mb in rnd.micro_batches)
            payload = [[seqs[item.key] for item in mb.items] for mb in rnd.micro_batches]
            self._tell(TrainRound(policy=rnd.policy, micro_batches=payload))
            begin = time.perf_counter()
            self._run_round(rnd.policy, payload, acc)
            t["rounds"].append((begin, time.perf_counter()))
            t["train"] += t["rounds"][-1][1] - begin

    def _mini_batch_updates(self, since_update: defaultdict[str, int], acc: MetricSums) -> None:
        """Rank 0: update every policy whose PPO mini-batch is complete (none without
        `policy.mini_batch_sequences`); the step's last mini-batch is `optimizer_step`'s."""
        size = self.config.policy.mini_batch_sequences
        for policy in [p for p, n in since_update.items() if size is not None and n >= size]:
            self._tell(Update(policy=policy))
            self._update(policy, acc)
            since_update[policy] = 0

    def _update(self, policy: str, acc: MetricSums) -> None:
        """Every rank: the optimizer step of one PPO mini-batch, normalised by its loss units
        (summed over data-parallel ranks)."""
        [units] = sum_data_parallel([acc.units[policy] - acc.applied[policy]])
        acc.applied[policy] = acc.units[policy]
        if units == 0:  # only empty stand-in sequences: nothing to step on
            self.actors[policy].skip_step()
            return
        report = self.actors[policy].finish_step(grad_scale=_dp_size() / units,
                                                 max_grad_norm=self.config.policy.max_grad_norm)
        self._step_updates[policy].append(report)

    def _run_round(self, policy: str, payload: list, acc: MetricSums) -> None:
        from megatron.core import parallel_state as ps

        from megatron_marsrl.megatron.routing_replay import replay_coverage

        mine = payload[ps.get_data_parallel_rank()]
        real = bool(mine)
        if not real:  # this DP rank has nothing in the round but must join the collectives
            mine = [("solver", Sequence(prompt_ids=[0], response_ids=[0], advantage=0.0, reward=0.0,
                                        trained_from=1))]
        batch = pack_sequences([s for _, s in mine])
        batch["role_index"] = torch.tensor([ROLES.index(r) if r in ROLES else -1 for r, _ in mine])
        batch["temperature"] = self.config.rollout.sampling.temperature or 1.0
        batch["dmmpt_active"] = self._dmmpt_active(policy)
        actor = self.actors[policy]
        if actor.reference is not None:
            batch["ref_logprobs"] = actor.reference_logprobs(batch, temperature=batch["temperature"])
        metrics = actor.train_micro_batch(batch, self._loss_fn, with_entropy=True,
                                          entropy_grad=self.config.loss.entropy_coef > 0)
        # "loss" is this micro-batch's share of the step objective (a sum, normalised at the end)
        acc.add_units(policy, metrics.pop("aggregation_units"), metrics.pop("loss"))
        if real:
            if "entropy" in metrics:
                acc.add_entropy(policy, metrics["entropy"], float(batch["response_mask"].sum()))
            # the share of the engine's routing record that this stage's routers replayed
            metrics["routing_replayed"] = (replay_coverage(actor.module, batch["routed_experts"])
                                           if "routed_experts" in batch else 0.0)
            acc.add(weigh(metrics, batch["response_mask"], batch["role_index"]))

    def _dmmpt_active(self, policy: str) -> bool | None:
        """DMMPT's decision for the whole step: the policy's mean token entropy over the last
        step it trained (every micro-batch and data-parallel rank) is below the target; off
        until a step has measured it. None when DMMPT is off."""
        cfg = self.config.loss.dmmpt
        if cfg is None:
            return None
        entropy = self._policy_entropy.get(policy)
        return entropy is not None and dmmpt_gate(entropy, cfg)

    def _loss_fn(self, logp: torch.Tensor, entropy: torch.Tensor | None, batch: dict):
        cfg = self.config.loss
        mask = batch["response_mask"].to(logp.device)
        rollout = batch["rollout_logprobs"].to(logp.device)
        inputs = PolicyLossInputs(
            logprobs=logp, old_logprobs=rollout if cfg.old_logprobs == "rollout" else logp.detach(),
            advantages=batch["advantages"].to(logp.device),
            response_mask=mask, entropy=entropy, rewards=batch["rewards"].to(logp.device),
            ref_logprobs=batch["ref_logprobs"].to(logp.device) if "ref_logprobs" in batch else None,
            rollout_logprobs=rollout if cfg.tis is not None else None, dmmpt_active=batch.get("dmmpt_active"))
        loss, metrics = policy_loss(inputs, cfg, normalizer=1.0)
        metrics = {**metrics, **mismatch_metrics(logp.detach(), rollout, mask, batch["role_index"], entropy)}
        return loss, metrics

    def _reduce(self, acc: MetricSums) -> dict:
        """The step's train metrics (weighted means over micro-batches and data-parallel ranks)
        and each policy's step objective; keeps the step's loss units for `optimizer_step`."""
        total = MetricSums.merged(gather_data_parallel(acc))
        self._units = {p: total.units[p] - total.applied[p] for p in total.units}  # the last mini-batch's
        self._policy_entropy.update(total.policy_entropy())
        out = {f"train/{k}": v for k, v in total.means().items()}
        out["train/nonfinite_metrics"] = total.nonfinite
        trained = [p for p in self.actors if total.units.get(p)]
        for policy in trained:  # the step objective each optimizer step minimised
            out[f"{policy}/loss"] = total.losses[policy] / total.units[policy]
        if trained:
            out["train/loss"] = sum(total.losses[p] for p in trained) / sum(total.units[p] for p in trained)
        return out

    # ---- metrics, evaluation ---------------------------------------------------------------
    def observer(self):
        """TensorBoard + progress bar on rank 0; a sink elsewhere."""
        if self.rank != 0:
            return _NullObserver()
        from megatron_marsrl.rl.observe import Observer

        return Observer(self.run_dir, total_steps=self.config.run.steps, start_step=self.start_step,
                        progress=self.config.run.progress)

    def evaluate(self, step: int) -> dict:
        """Held-out per-role rewards (rank 0 generates; the others wait at the next collective)."""
        return self.rollout.evaluate(step) if self.rollout is not None else {}

    def probe(self, samples: list[Sample]) -> dict | None:
        return self.rollout.probe_sequences(samples) if self.rollout is not None else None

    def rollout_metrics(self, samples: list[Sample], metrics: dict, step_time: float) -> dict:
        """Per-role rollout statistics and throughput (rank 0)."""
        if self.rollout is None:
            return {}
        from megatron_marsrl.rl.rollout_side import sample_metrics

        out = sample_metrics(samples)
        generated = sum(len(s.response_token_ids or []) for s in samples)
        trained = sum(len(s.prompt_token_ids or []) + len(s.response_token_ids or []) for s in samples)
        out.update({"time/step": step_time, "throughput/samples_per_s": len(samples) / step_time,
                    "throughput/rollout_tokens_per_s": generated / max(metrics.get("time/rollout", 0.0), 1e-9),
                    "throughput/train_tokens_per_s": trained / max(metrics.get("time/train", 0.0), 1e-9),
                    "time/train_idle_fraction": metrics.get("time/train_idle", 0.0) / step_time,
                    "rollout/samples": len(samples), "rollout/pending_stage_inputs": len(self.rollout.driver.pending),
                    "rollout/continued_samples": sum(len(set(s.metadata.get("token_versions") or [])) > 1
                                                     for s in samples)})
        # Raw per-step figures for `marsrl bench throughput` (tokens/s/GPU, MFU): the lengths of
        # the sequences trained (those with a response), and the devices of each side.
        lengths = [len(s.prompt_token_ids or []) + len(s.response_token_ids) for s in samples if s.response_token_ids]
        out.update({"tokens/generated": generated, "tokens/trained": sum(lengths),
                    "tokens/max_seq_len": max(lengths, default=0),
                    "tokens/attended_len": sum(n * n for n in lengths) / max(sum(lengths), 1),
                    "world/train_gpus": dist.get_world_size(),
                    "world/rollout_engines_serving": self.rollout.engines_serving(),
                    "world/rollout_gpus": self.config.engine.tp_size * sum(len(p.engines) for p in
                                                                           self.rollout.pools.values())})
        return out

    # ---- update, sync, evaluate, checkpoint ---------------------------------------------------
    def optimizer_step(self) -> dict:
        """Each policy's (last) optimizer step of the RL step, normalised by the loss units
        trained since its previous one; metrics over all of the step's updates."""
        out = {}
        for name, actor in self.actors.items():
            units = self._units.get(name, 0.0)
            reports = self._step_updates[name]
            if units > 0:
                reports.append(actor.finish_step(grad_scale=_dp_size() / units,
                                                 max_grad_norm=self.config.policy.max_grad_norm))
            else:  # nothing (left) of this policy this step (segment rollout, per-role, mini-batches)
                actor.skip_step()
            if not reports:
                out[f"{name}/trained_nothing"] = 1.0
                continue
            skipped = [r for r in reports if not r["update_applied"]]
            for r in skipped:
                log.warning("policy %s: update skipped (grad norm %s)", name, r["grad_norm"])
            out[f"{name}/grad_norm"] = sum(r["grad_norm"] for r in reports) / len(reports)
            out[f"{name}/update_skipped"] = float(len(skipped))
            out[f"{name}/updates"] = float(len(reports))
            out[f"{name}/micro_batches"] = sum(r["micro_batches"] for r in reports)
        return out

    def sync_weights(self, version: int, probe: dict | None = None) -> dict:
        """Megatron -> engines for every policy; with the probe check after each."""
        from megatron_marsrl.megatron.weight_sync import sync_and_verify, sync_weights

        out, start = {}, time.perf_counter()
        if self.time_share is not None:
            self.time_share.to_sync()
        for name, actor in self.actors.items():
            pool = self.rollout.pools[name] if self.rollout is not None else None
            seqs = self._broadcast(probe.get(name) if probe and self.rank == 0 else None) \
                if self.config.run.sync_probe else None
            if seqs:
                report = sync_and_verify(actor.module, self.arch, pool, version=version, probe=seqs,
                                         tolerance=self.probe_tolerance,
                                         readback=not self.config.engine.quantization)
                out[f"{name}/sync_probe_mismatch"] = report["mismatch"]["mean"]
                out[f"{name}/sync_readback_tensors"] = float(report["readback"] or 0)
            else:
                report = sync_weights(actor.module, self.arch, pool, version=version)
            out[f"{name}/sync_gb"] = report["bytes"] / 1e9
        if self.rollout is not None:
            self.rollout.version = version
        if self.time_share is not None:
            self.time_share.to_rollout()
        out["time/sync"] = time.perf_counter() - start
        return out

    def save(self, step: int, *, redo_step: bool = False) -> Path:
        """Checkpoint after `step` steps; `redo_step`: the running step failed, save the state
        from its start so that a resume runs it again (the weights were not updated yet, unless
        PPO mini-batch updates of the step ran: then they were, and a warning says so)."""
        state = self._broadcast(self.rollout.state_dict(step_start=redo_step) if self.rollout is not None else None)
        if redo_step and any(self._step_updates.values()):
            log.warning("step %d stopped after %d of its PPO mini-batch updates: the checkpoint holds the updated "
                        "weights, so a resume redoes the step from them, not from the step's start", step + 1,
                        sum(map(len, self._step_updates.values())))
        state = {**state, "policy_entropy": self._policy_entropy}
        with self.time_share.trainer_resident() if self.time_share is not None else contextlib.nullcontext():
            path = checkpoint.save(self.run_dir, step, self.actors, state, keep=self.config.run.keep_checkpoints)
        if self.rank == 0:
            log.info("checkpoint saved: %s", path)
        return path

    def _resume(self) -> None:
        path = checkpoint.latest(self.run_dir) if self.rank == 0 else None
        path = self._broadcast(str(path) if path else None)
        if path is None:
            log.warning("--resume: no complete checkpoint under %s; starting from step 0", self.run_dir)
            return
        if self.time_share is not None:  # as after a rollout: the engines make room, the trainer comes back
            self.time_share.to_training()
        state = checkpoint.load(path, self.actors)
        self._policy_entropy = dict(state.get("policy_entropy", {}))
        if self.rollout is not None:
            self.rollout.load_state_dict(state)
        self.start_step = state["step"]
        self.sync_weights(version=self.start_step)
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.start_step)

    def _save_config(self) -> None:
        """The resolved config next to the run (an earlier one is kept as config.<n>.json), with
        model.dtype as this machine resolved it ("auto" -> float32 or bfloat16)."""
        import json

        from megatron_marsrl.rl.overrides import config_to_dict

        path = self.run_dir / "config.json"
        if path.is_file():
            n = len(list(self.run_dir.glob("config.*.json")))
            path.rename(self.run_dir / f"config.{n}.json")
        config = dataclasses.replace(self.config, model=dataclasses.replace(self.config.model,
                                                                            dtype=self.precision.name))
        path.write_text(json.dumps(config_to_dict(config), indent=2))

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
        if self.node_engines is not None:
            self.node_engines.close()


class StepAborted(RuntimeError):
    """A step could not finish (a stop signal, or engines that failed after their retries);
    raised on every rank. The step can be redone: the weights were not updated (except by the
    step's PPO mini-batch updates, `policy.mini_batch_sequences`, if some ran)."""

    def __init__(self, message: str, *, by_signal: bool = False):
        super().__init__(message)
        self.by_signal = by_signal


class _Interrupted(Exception):
    """SIGTERM/SIGINT arrived while the step was generating."""


class _NullObserver:
    def log(self, step, metrics) -> None:
        pass

    def save_rollouts(self, step, samples) -> None:
        pass

    def close(self) -> None:
        pass


def _dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def _trainable(seq: Sequence) -> bool:
    return seq.trained_from < len(seq.response_ids)


def _sequence(sample: Sample, version: int, mask_old: bool) -> Sequence:
    """The training sequence of a sample whose advantage is set; with segment rollout and
    `mask_old`, tokens generated by older weights get no gradient (otherwise TIS corrects them
    through the rollout log-probs)."""
    versions = sample.metadata.get("token_versions")
    trained_from = 0
    if versions and mask_old:
        trained_from = next((i for i, v in enumerate(versions) if v == version), len(versions))
    return Sequence(prompt_ids=list(sample.prompt_token_ids or []), response_ids=list(sample.response_token_ids or []),
                    advantage=sample.advantage, reward=float(sample.reward or 0.0), trained_from=trained_from,
                    rollout_logprobs=list(sample.rollout_logprobs) if sample.rollout_logprobs else None,
                    routed_experts=sample.metadata.get("routed_experts"))
