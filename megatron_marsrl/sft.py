"""Supervised fine-tuning on Megatron (`marsrl sft`): chat data in, an HF checkpoint out that
`marsrl train model.path=<output>/hf` starts from.

    marsrl sft --model HF_DIR --data chats.jsonl [--eval held_out.jsonl] [key=value ...]

Data: JSONL, one conversation per line, {"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]} (system / user / assistant roles, at least one
assistant message, never first). Each conversation is rendered with the model's own chat
template, turn by turn, and only the assistant replies carry loss; a reply the template does
not end with the tokenizer's EOS token gets one appended, so the model learns where to stop
(the rollout engines stop there).

Training: the same Megatron actor and forward path as `marsrl train` (any TP / PP / EP
layout, packed micro-batches of at most `token_budget` tokens, one row each); an optimizer
step per `batch_sequences` conversations, dealt in turn to the data-parallel ranks
(`dp_rounds`), the loss the mean NLL over the batch's assistant tokens. Each step logs
train/loss, train/tokens and sft/grad_norm; with held-out data, eval/loss before the first
step and after the last (and every `eval_every` steps).
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_marsrl.megatron.optim import OptimConfig
from megatron_marsrl.megatron.parallel import ParallelConfig, sum_data_parallel

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(kw_only=True)
class SFTConfig:
    """One supervised fine-tuning run."""

    model: str = ""
    """Starting HF checkpoint directory (convert a GGUF file first: `marsrl convert gguf-to-hf`)."""
    data: str = ""
    """Training conversations (JSONL, see the module docstring)."""
    eval: str = ""
    """Held-out conversations for eval/loss; "" disables it."""
    output_dir: str = "outputs/sft"
    """Run directory: hf/ (the fine-tuned checkpoint), metrics.jsonl, tensorboard/; must be new,
    empty, or (with force) an earlier marsrl output."""
    force: bool = False
    """Replace a non-empty output_dir written by marsrl."""
    epochs: int = 1
    """Passes over the training data (shuffled anew each pass)."""
    batch_sequences: int = 32
    """Conversations per optimizer step."""
    token_budget: int = 2048
    """Most tokens in one packed micro-batch (a longer conversation is refused)."""
    eval_every: int = 0
    """Evaluate every N steps as well; 0: before the first step and after the last only."""
    dtype: str = "auto"
    """"auto" (bfloat16 on a GPU or a CPU with bf16 matrix instructions, else float32:
    precision.choose_dtype), "float32" or "bfloat16"."""
    seed: int = 1234
    """Data order."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron layout (world size = number of launched ranks)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("sft model is empty: give an HF checkpoint directory (--model)")
        if not self.data:
            raise ValueError("sft data is empty: give a JSONL file of conversations (--data)")
        for name in ("epochs", "batch_sequences", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft {name}={getattr(self, name)}: must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"sft eval_every={self.eval_every}: must be >= 0")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"sft dtype={self.dtype!r}: use auto, float32 or bfloat16")


@dataclass(frozen=True)
class Example:
    """One tokenized conversation: its tokens and which of them carry loss."""

    ids: list[int]
    loss_mask: list[bool]
    """Per token: True for the assistant replies' tokens (and their EOS)."""


def preflight(cfg: SFTConfig) -> list[list[dict]]:
    """Everything that can be checked before ranks start: the model directory, the data, the
    output directory. Returns the training conversations."""
    from megatron_marsrl import outputs

    if not (Path(cfg.model) / "config.json").is_file():
        raise FileNotFoundError(f"sft model {cfg.model} has no config.json; give an HF checkpoint directory "
                                "(a .gguf file: convert it first with `marsrl convert gguf-to-hf`)")
    conversations = load_conversations(cfg.data)
    if cfg.eval:
        load_conversations(cfg.eval)
    outputs.check_replaceable(cfg.output_dir, force=cfg.force)
    return conversations


def load_conversations(path: str | Path) -> list[list[dict]]:
    """The conversations of a JSONL file; a bad line raises ValueError naming it and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data {path} does not exist; give a JSONL file of {{\"messages\": [...]}} rows")
    out = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from exc
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: each message needs a role in {CHAT_ROLES} and text content, got {m!r}")
        roles = [m["role"] for m in messages]
        if "assistant" not in roles:
            raise ValueError(f"{where}: no assistant message, so nothing to learn")
        if roles[0] == "assistant":
            raise ValueError(f"{where}: the conversation starts with an assistant message; put the request first")
        out.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not out:
        raise ValueError(f"SFT data {path} holds no conversation")
    return out


def tokenize_conversation(tokenizer, messages: list[dict]) -> Example:
    """Render `messages` with the tokenizer's chat template turn by turn; assistant replies
    (with an EOS appended where the template has none) carry loss, everything else none."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[bool] = []
    rendered: list[int] = []  # the template's rendering so far (without the EOS tokens we append)

    def add(part: list[dict], generation_prompt: bool, loss: bool) -> list[int]:
        """Render `part`, append what it adds to the rendering so far; returns the new tokens."""
        nonlocal rendered
        full = tokenizer.apply_chat_template(part, tokenize=True, add_generation_prompt=generation_prompt)
        full = list(full["input_ids"] if hasattr(full, "keys") else full)
        if full[:len(rendered)] != rendered:
            raise ValueError(f"the chat template does not render message {len(part) - 1} as a continuation of "
                             "the ones before it, so the assistant tokens cannot be located; use single-reply "
                             "conversations or a template that renders prefix by prefix")
        new, rendered = full[len(rendered):], full
        ids.extend(new)
        mask.extend([loss] * len(new))
        return new

    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            add(messages[:k + 1], False, False)
            continue
        add(messages[:k], True, False)  # the template's header of the reply
        reply = add(messages[:k + 1], False, True)
        if eos is not None and eos not in reply:
            ids.append(eos)
            mask.append(True)
    return Example(ids=ids, loss_mask=mask)


def batches(examples: list[Example], *, batch_sequences: int, epochs: int, seed: int) -> list[list[Example]]:
    """The optimizer steps' examples: each epoch shuffled (deterministic in `seed`), cut into
    batches of `batch_sequences` (the last one of an epoch may be smaller)."""
    out = []
    for epoch in range(epochs):
        order = list(range(len(examples)))
        random.Random(f"sft:{seed}:{epoch}").shuffle(order)
        out += [[examples[i] for i in order[s:s + batch_sequences]] for s in range(0, len(order), batch_sequences)]
    return out


def micro_batches(examples: list[Example], token_budget: int) -> list[list[Example]]:
    """Pack examples in order into micro-batches of at most `token_budget` tokens."""
    out: list[list[Example]] = []
    used = token_budget
    for ex in examples:
        if len(ex.ids) > token_budget:
            raise ValueError(f"a conversation of {len(ex.ids)} tokens exceeds token_budget={token_budget}; "
                             "raise token_budget or shorten the data")
        if used + len(ex.ids) > token_budget:
            out.append([])
            used = 0
        out[-1].append(ex)
        used += len(ex.ids)
    return out


def _sequence(ex: Example):
    """The actor's training sequence: everything before the first loss token is the prompt."""
    from megatron_marsrl.megatron.actor import Sequence

    first = ex.loss_mask.index(True)
    first = max(first, 1)  # a prompt of at least one token: position 0 predicts nothing
    return Sequence(prompt_ids=ex.ids[:first], response_ids=ex.ids[first:], advantage=0.0, reward=0.0,
                    loss_mask=ex.loss_mask[first:])


def _nll_loss(logp: torch.Tensor, entropy, batch: dict):
    mask = batch["response_mask"].to(logp.device)
    nll = -torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum()
    return nll, {"nll_sum": nll.detach(), "tokens": mask.sum().to(logp.dtype)}


def dp_rounds(examples: list[Example], dp: int, token_budget: int) -> list[list[list[Example]]]:
    """A batch's examples dealt in turn to the data-parallel ranks, each rank's share packed
    into micro-batches: round by round, one micro-batch per rank ([] where a rank has run out).
    Every rank computes every share, so all agree on the number of rounds."""
    shares = [micro_batches(examples[rank::dp], token_budget) for rank in range(dp)]
    return [[mbs[r] if r < len(mbs) else [] for mbs in shares] for r in range(max(map(len, shares)))]


def run_rank(cfg: SFTConfig) -> dict:
    """One rank of `marsrl sft` (under torchrun); returns the run's summary (on every rank)."""
    import torch.distributed as dist

    from megatron_marsrl import outputs
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.parallel import init_parallel

    conversations = preflight(cfg)
    init_parallel(cfg.parallel, ModelArch.from_hf_dir(cfg.model), seed=cfg.seed)
    run_dir = Path(cfg.output_dir)
    if dist.get_rank() == 0:  # only rank 0 writes into the run directory
        if cfg.force and run_dir.exists():
            outputs.remove(run_dir)
        outputs.prepare_dir(run_dir, kind="sft")
    return fine_tune(cfg, conversations)


def fine_tune(cfg: SFTConfig, conversations: list[list[dict]], *, quiet: bool = False) -> dict:
    """The SFT loop on the current process groups (`init_parallel` done, `cfg.output_dir`
    ready): trains a fresh actor from `cfg.model`, writes `<output_dir>/hf`; `quiet` keeps
    the per-step lines off the console (metrics.jsonl and TensorBoard are written either way).
    Returns the summary (steps, losses, hf_dir) on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megatron_marsrl.megatron import forward
    from megatron_marsrl.megatron.actor import PolicyActor, Sequence, pack_sequences
    from megatron_marsrl.megatron.hf_checkpoint import save_hf_checkpoint
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.precision import choose_dtype

    run_dir = Path(cfg.output_dir)
    arch = ModelArch.from_hf_dir(cfg.model)
    rank, dp, dp_rank = dist.get_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    actor = PolicyActor("sft", arch, cfg.parallel, cfg.optim, hf_dir=cfg.model, dtype=choose_dtype(cfg.dtype).dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    train = [tokenize_conversation(tokenizer, c) for c in conversations]
    held_out = [tokenize_conversation(tokenizer, c) for c in load_conversations(cfg.eval)] if cfg.eval else []
    steps = batches(train, batch_sequences=cfg.batch_sequences, epochs=cfg.epochs, seed=cfg.seed)
    filler = Sequence(prompt_ids=[0], response_ids=[0], advantage=0.0, reward=0.0, loss_mask=[False])

    def batch_of(mine: list[Example]) -> dict:
        return pack_sequences([_sequence(ex) for ex in mine] if mine else [filler])

    def evaluate() -> float:
        nll = tokens = 0.0
        for rnd in dp_rounds(held_out, dp, cfg.token_budget):
            batch = batch_of(rnd[dp_rank])
            logp = forward.micro_batch_logprobs(actor.module, batch)
            mask = batch["response_mask"]
            nll -= float(torch.where(mask, logp.cpu(), torch.zeros(())).sum())
            tokens += float(mask.sum())
        nll, tokens = sum_data_parallel((nll, tokens))
        return nll / max(tokens, 1.0)

    observer = None
    if rank == 0:
        from megatron_marsrl.rl.observe import Observer

        observer = Observer(run_dir, total_steps=len(steps), start_step=0, progress=not quiet, quiet=quiet)
    summary: dict = {"steps": len(steps), "train_examples": len(train)}
    if held_out:
        summary["eval_loss_first"] = evaluate()
        if observer:
            observer.log(0, {"eval/loss": summary["eval_loss_first"]})
    for step, examples in enumerate(steps, start=1):
        nll = tokens = 0.0
        for rnd in dp_rounds(examples, dp, cfg.token_budget):
            metrics = actor.train_micro_batch(batch_of(rnd[dp_rank]), _nll_loss, with_entropy=False)
            nll += metrics["nll_sum"]
            tokens += metrics["tokens"]
        nll, tokens = sum_data_parallel((nll, tokens))
        report = actor.finish_step(grad_scale=dp / max(tokens, 1.0), max_grad_norm=None)
        scalars = {"train/loss": nll / max(tokens, 1.0), "train/tokens": tokens, "sft/grad_norm": report["grad_norm"]}
        summary["train_loss_last"] = scalars["train/loss"]
        if held_out and (step == len(steps) or (cfg.eval_every and step % cfg.eval_every == 0)):
            scalars["eval/loss"] = summary["eval_loss_last"] = evaluate()
        if observer:
            observer.log(step, {k: v for k, v in scalars.items() if not k.startswith("eval/")})
            if "eval/loss" in scalars:
                observer.log(step, {"eval/loss": scalars["eval/loss"]})
    hf_config = json.loads((Path(cfg.model) / "config.json").read_text())
    save_hf_checkpoint(actor.module, arch, run_dir / "hf", hf_config=hf_config, tokenizer_dir=cfg.model)
    if observer:
        observer.close()
    del actor  # Megatron's DDP holds reference cycles: free the model and optimizer state now
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    summary["hf_dir"] = str(run_dir / "hf")
    return summary
