"""Functions run on each rank by megatron_marsrl.megatron.launch in the multi-rank tests."""
from __future__ import annotations

import os

import torch

from megatron_marsrl.megatron.forward import full_logits
from megatron_marsrl.megatron.verify import build_from_hf, parity_report


def _setup(hf_dir: str, layout: dict):
    return build_from_hf(hf_dir, layout)


def parity(hf_dir: str, layout: dict, seed: int = 0) -> dict:
    return parity_report(hf_dir, layout, seed)


def train_losses(hf_dir: str, layout: dict, steps: int = 3, global_batch: int = 4, seq: int = 16,
                 lr: float = 0.5, optimizer: str = "sgd", adam_eps: float = 1e-8) -> list[float]:
    """Token-mean cross-entropy per step for a fixed data stream, under ``layout``."""
    from megatron.core import parallel_state as ps

    from tests.megatron.reference_step import train_step
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer

    arch, parallel, model = _setup(hf_dir, layout)
    ddp, optimizer = wrap_ddp_and_optimizer(model, OptimConfig(optimizer=optimizer, lr=lr, clip_grad=0.0, adam_eps=adam_eps),
                                            distributed_optimizer=parallel.distributed_optimizer)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(42)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, arch.vocab_size, (global_batch, seq), generator=gen)
        mine = batch.chunk(dp)[dp_rank]
        micro = [{"tokens": row[None]} for row in mine]

        def ce(logp, b):
            return -logp.mean(), {}

        losses.append(train_step(ddp, optimizer, micro, ce)["loss"])
    return losses


def save_trained(hf_dir: str, layout: dict, ckpt: str, steps: int = 2) -> None:
    """Train ``steps`` steps with Adam under ``layout`` and save model + optimizer."""
    from megatron_marsrl.megatron.dist_checkpoint import save_checkpoint

    ddp, optimizer, arch = _train(hf_dir, layout, steps)
    save_checkpoint(ckpt, ddp, optimizer=optimizer, meta={})


def resume_and_score(hf_dir: str, layout: dict, ckpt: str, steps: int = 1) -> dict:
    """Load ``ckpt`` under ``layout``: logits of fixed tokens, and the loss of further steps."""
    from megatron_marsrl.megatron.dist_checkpoint import load_checkpoint

    ddp, optimizer, arch = _train(hf_dir, layout, 0)
    load_checkpoint(ckpt, ddp, optimizer=optimizer)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = full_logits(ddp.module, tokens)
    losses = _steps(ddp, optimizer, arch, steps, seed=99)
    return {"logits": None if logits is None else logits.tolist(), "losses": losses}


def _train(hf_dir, layout, steps):
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer

    arch, parallel, model = _setup(hf_dir, layout)
    ddp, optimizer = wrap_ddp_and_optimizer(model, OptimConfig(lr=1e-2, adam_eps=1e-3, clip_grad=0.0),
                                            distributed_optimizer=parallel.distributed_optimizer)
    _steps(ddp, optimizer, arch, steps, seed=42)
    return ddp, optimizer, arch


def _steps(ddp, optimizer, arch, steps, seed, global_batch=4, seq=16):
    from megatron.core import parallel_state as ps

    from tests.megatron.reference_step import train_step

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, arch.vocab_size, (global_batch, seq), generator=gen)
        micro = [{"tokens": row[None]} for row in batch.chunk(dp)[dp_rank]]
        losses.append(train_step(ddp, optimizer, micro, lambda logp, b: (-logp.mean(), {}))["loss"])
    return losses


def continued_losses(hf_dir: str) -> float:
    """Loss of the step after :func:`save_trained`'s steps, without saving (world size 1)."""
    ddp, optimizer, arch = _train(hf_dir, {}, 2)
    return _steps(ddp, optimizer, arch, 1, seed=99)[0]


def streamed_vs_step(hf_dir: str, layout: dict, steps: int = 2) -> float | None:
    """Train two copies on the same data: one with train_step (all micro-batches in one
    schedule), one micro-batch at a time in shuffled order with the sync deferred to
    finish_accumulation and sum-form losses rescaled by the step's token count. Returns the
    max |logit difference| afterwards (last pipeline stage; None elsewhere)."""
    import random

    from megatron.core import parallel_state as ps

    from megatron_marsrl.megatron.forward import backward_micro_batch, finish_accumulation
    from megatron_marsrl.megatron.hf_checkpoint import load_hf_weights
    from megatron_marsrl.megatron.model import build_model
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer
    from tests.megatron.reference_step import train_step

    arch, parallel, model_a = _setup(hf_dir, layout)
    model_b = build_model(arch, parallel)
    load_hf_weights(model_b, arch, hf_dir)
    opt = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0)
    ddp_a, opt_a = wrap_ddp_and_optimizer(model_a, opt)
    ddp_b, opt_b = wrap_ddp_and_optimizer(model_b, opt)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(42)
    for step in range(steps):
        batch = torch.randint(0, arch.vocab_size, (4, 16), generator=gen)
        micro = [{"tokens": row[None]} for row in batch.chunk(dp)[dp_rank]]
        train_step(ddp_a, opt_a, micro, lambda logp, b: (-logp.mean(), {}))
        order = list(range(len(micro)))
        random.Random(step * 10 + dp_rank).shuffle(order)
        for i in order:
            backward_micro_batch(ddp_b, micro[i], lambda logp, ent, b: (-logp.sum(), {}))
        finish_accumulation(ddp_b, opt_b, grad_scale=dp / (batch.shape[0] * (batch.shape[1] - 1)))
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    a, b = full_logits(ddp_a.module, tokens), full_logits(ddp_b.module, tokens)
    return None if a is None else float((a - b).abs().max())


def token_stats_vs_reference(hf_dir: str, layout: dict, chunk_elements: int) -> dict[str, float]:
    """Largest |chunked token_stats - reference| over TP-sharded random logits: log-probs and
    entropy against a full-softmax computation (and log-probs against Megatron's unchunked
    vocab-parallel cross entropy), and the gradient each rank gets for its shard of the logits
    under a loss mixing both, against autograd through the full softmax."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_marsrl.megatron import forward
    from tests.megatron.reference_step import padding_masked

    _setup(hf_dir, layout)
    gen = torch.Generator().manual_seed(3)
    vocab, padded, temperature = 61, 64, 0.7
    full = torch.randn(3, 7, padded, generator=gen) * 4
    labels = torch.randint(0, vocab, (3, 7), generator=gen)
    labels[0, :3] = vocab - 1  # labels on the last shard, next to its padding
    w_logp, w_ent = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    ref_in = full.clone().requires_grad_(True)
    scaled = ref_in[..., :vocab] / temperature
    ref_logp = torch.log_softmax(scaled, -1).gather(-1, labels[..., None])[..., 0]
    ref_ent = torch.distributions.Categorical(logits=scaled).entropy()
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward(retain_graph=True)
    ref_grad = ref_in.grad

    forward.LOGIT_CHUNK_ELEMENTS, saved = chunk_elements, forward.LOGIT_CHUNK_ELEMENTS
    try:
        mine = full.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
        logp, ent = forward.token_stats(mine, labels, temperature=temperature, vocab_size=vocab)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        alone = full.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
        logp_alone, no_entropy = forward.token_stats(alone, labels, temperature=temperature, vocab_size=vocab,
                                                     with_entropy=False)
        (logp_alone * w_logp).sum().backward()
    finally:
        forward.LOGIT_CHUNK_ELEMENTS = saved
    ref_in.grad = None
    (ref_logp * w_logp).sum().backward()  # the log-prob term's gradient alone, for `alone`
    first = rank * mine.shape[-1]
    unchunked = -vocab_parallel_cross_entropy(padding_masked(full.chunk(tp, dim=-1)[rank].clone() / temperature,
                                                             vocab), labels)
    padding = mine.grad[..., max(vocab - first, 0):]
    assert no_entropy is None, "token_stats(with_entropy=False) returned an entropy"
    return {"logp": float((logp - ref_logp).abs().max()), "entropy": float((ent - ref_ent).abs().max()),
            "logp_without_entropy": float((logp_alone - ref_logp).abs().max()),
            "grad_without_entropy": float((alone.grad - ref_in.grad.chunk(tp, dim=-1)[rank]).abs().max()),
            "logp_vs_megatron": float((logp - unchunked).abs().max()),
            "grad": float((mine.grad - ref_grad.chunk(tp, dim=-1)[rank]).abs().max()),
            "padding_grad": float(padding.abs().max()) if padding.numel() else 0.0}


def grad_buffer_precision(hf_dir: str, layout: dict, micro_batches: int = 8) -> dict:
    """Accumulate one RL-like step (advantages of both signs) into bf16-parameter models with
    fp32 and with bf16 gradient buffers; reduce over data-parallel ranks; report each buffer's
    dtype and the relative L2 error of the bf16 buffers' gradient against the fp32 ones."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_marsrl.megatron.forward import backward_micro_batch
    from megatron_marsrl.megatron.hf_checkpoint import load_hf_weights
    from megatron_marsrl.megatron.model import build_model
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer

    arch, parallel, model_a = _setup(hf_dir, layout)
    models = []
    for fp32_buffers, model in ((True, model_a), (False, None)):
        if model is None:
            model = build_model(arch, parallel)
            load_hf_weights(model, arch, hf_dir)
        model.bfloat16()
        model.config.bf16, model.config.params_dtype = True, torch.bfloat16
        ddp, _ = wrap_ddp_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.1, grad_reduce_in_fp32=fp32_buffers))
        models.append(ddp)
    gen = torch.Generator().manual_seed(11 + torch.distributed.get_rank())
    for _ in range(micro_batches):
        tokens = torch.randint(0, arch.vocab_size, (1, 24), generator=gen)
        advantage = float(torch.randn((), generator=gen))
        for ddp in models:
            backward_micro_batch(ddp, {"tokens": tokens}, lambda logp, ent, b, a=advantage: (-a * logp.sum(), {}))
    grads = []
    for ddp in models:
        finalize_model_grads([ddp])
        grads.append(torch.cat([p.main_grad.float().flatten() for p in ddp.module.parameters()]))
    dtypes = [str(next(iter(ddp.module.parameters())).main_grad.dtype) for ddp in models]
    return {"dtypes": dtypes, "relative_error": float((grads[1] - grads[0]).norm() / grads[0].norm())}


def offload_round_trip(hf_dir: str, layout: dict) -> dict:
    """Two identical policies train the same three Adam steps; between the steps one of them
    moves its state and parameters out and back (PolicyActor.offload/onload, CPU storages
    included: the path a GPU run takes). Reports whether the storages were emptied and the
    largest parameter difference at the end."""
    from megatron_marsrl.megatron.actor import PolicyActor, Sequence, pack_sequences
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.optim import OptimConfig
    from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel

    arch, parallel = ModelArch.from_hf_dir(hf_dir), ParallelConfig(**layout)
    init_parallel(parallel, arch)
    optim = OptimConfig(lr=1e-2, clip_grad=1.0)
    actors = [PolicyActor(f"p{i}", arch, parallel, optim, hf_dir=hf_dir) for i in range(2)]
    gen = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
    emptied, moved = [], 0
    for step in range(3):
        seqs = [Sequence(prompt_ids=torch.randint(0, arch.vocab_size, (4,), generator=gen).tolist(),
                         response_ids=torch.randint(0, arch.vocab_size, (6,), generator=gen).tolist(),
                         advantage=float(torch.randn((), generator=gen)), reward=0.0) for _ in range(2)]
        for actor in actors:
            actor.train_micro_batch(pack_sequences(seqs), lambda logp, ent, b: (-logp.sum(), {}), with_entropy=False)
            actor.finish_step(grad_scale=1.0, max_grad_norm=None)
        if step < 2:
            moved += actors[1].offload("state", include_cpu=True) + actors[1].offload("params", include_cpu=True)
            emptied.append(all(p.untyped_storage().nbytes() == 0 for p in actors[1].model.parameters()))
            actors[1].onload("params")
            actors[1].onload("state")
    diff = max(float((a - b).abs().max()) for a, b in zip(actors[0].model.parameters(), actors[1].model.parameters()))
    return {"emptied": all(emptied), "moved_bytes": moved, "max_diff": diff}


def bf16_vs_fp32_logprobs(hf_dir: str) -> dict:
    """The trainer's per-token log-probs of one packed micro-batch of chat sequences in bf16
    (Megatron mixed precision, as "auto" trains on a CPU with bf16 units) against fp32: mean and
    max |difference| over the response tokens, where the loss reads them."""
    import transformers

    from megatron_marsrl.megatron.actor import Sequence, pack_sequences
    from megatron_marsrl.megatron.forward import micro_batch_logprobs

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    seqs = []
    for a, b in ((7, 12), (19, 3), (4, 15), (11, 9)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Reply with the "
                                                 "number only."}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        seqs.append(Sequence(prompt_ids=list(prompt), response_ids=tokenizer(f"{a + b}<|im_end|>")["input_ids"],
                             advantage=0.0, reward=0.0))
    batch = pack_sequences(seqs)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        _, _, model = build_from_hf(hf_dir, {}, dtype=dtype)
        model.eval()
        out[dtype] = micro_batch_logprobs(model, batch)
    mask = batch["response_mask"]
    diff = (out[torch.bfloat16] - out[torch.float32])[mask].abs()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(mask.sum()),
            "fp32_mean_logp": float(out[torch.float32][mask].mean())}


def dithered_main_params(hf_dir: str, layout: dict, lr: float = 1e-5) -> dict:
    """bf16 model, Adam: how its fp32 main copies sit against the bf16 parameters before and after
    `dither_main_params`, and how much of one Adam step of `lr` (the same gradients) reaches the
    bf16 weights from main copies on the grid and from dithered ones: sum |bf16 change| over
    sum |main change|."""
    from megatron_marsrl.megatron.hf_checkpoint import load_hf_weights
    from megatron_marsrl.megatron.model import build_model
    from megatron_marsrl.megatron.optim import OptimConfig, _low_precision_main_params, dither_main_params, \
        wrap_ddp_and_optimizer

    arch, parallel, model = build_from_hf(hf_dir, layout, dtype=torch.bfloat16)
    result = {}
    for dithered in (False, True):
        if dithered:
            model = build_model(arch, parallel, dtype=torch.bfloat16)
            load_hf_weights(model, arch, hf_dir)
        ddp, optimizer = wrap_ddp_and_optimizer(model, OptimConfig(lr=lr, clip_grad=0.0),
                                                distributed_optimizer=parallel.distributed_optimizer)
        pairs = list(_low_precision_main_params(optimizer))
        if dithered:
            result["moved"] = dither_main_params(optimizer)
            result["rounds_back"] = all(torch.equal(main.to(torch.bfloat16), low) for low, main in pairs)
            result["off_grid"] = sum(int((main != low.float()).sum()) for low, main in pairs) / result["moved"]
            result["main_sum"] = float(sum(main.double().sum() for _, main in pairs))
        else:
            result["on_grid_at_start"] = all(torch.equal(main, low.float()) for low, main in pairs)
        lows, mains = [low.double() for low, _ in pairs], [main.double() for _, main in pairs]
        gen = torch.Generator().manual_seed(5)
        for p in ddp.module.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        optimizer.step()
        # `low` views this rank's part of each parameter (its shard under the distributed optimizer)
        reached = sum(float((low.double() - b).abs().sum()) for (low, _), b in zip(pairs, lows))
        stepped = sum(float((main.double() - m).abs().sum()) for (_, main), m in zip(pairs, mains))
        result["reached_dithered" if dithered else "reached_on_grid"] = reached / stepped
    return result


def process_facts(fail_rank: int = -1) -> dict:
    """Where this rank runs (for the launcher's own tests); rank `fail_rank` raises instead."""
    rank = int(os.environ["RANK"])
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} failed on purpose")
    return {"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "marker": os.environ.get("MARSRL_TEST_MARKER")}
