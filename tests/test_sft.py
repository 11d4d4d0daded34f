"""`marsrl sft`: which tokens carry loss, bad data, and real runs on 2 gloo ranks (layouts agree,
held-out loss falls, `marsrl train` starts from the result)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_marsrl.agents import arithmetic
from megatron_marsrl.sft import (Example, dp_rounds, batches, load_conversations, micro_batches, preflight,
                                 tokenize_conversation, SFTConfig)


@pytest.fixture(scope="module")
def tiny_task_model(tmp_path_factory) -> Path:
    return arithmetic.build_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _tokens(tokenizer, ex: Example) -> list[tuple[str, bool]]:
    return list(zip(tokenizer.convert_ids_to_tokens(ex.ids), ex.loss_mask))


def test_only_assistant_replies_and_their_eos_carry_loss(tiny_task_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_task_model))
    one = tokenize_conversation(tok, [{"role": "user", "content": "solve : What is 3 + 4 ? ="},
                                      {"role": "assistant", "content": "7"}])
    assert _tokens(tok, one) == [(w, False) for w in "solve : What is 3 + 4 ? =".split()] + \
        [("7", True), ("<eos>", True)]  # the template has no EOS: one is appended, so stopping is learned
    two = tokenize_conversation(tok, [{"role": "user", "content": "check : 1 + 1 = 2 :"},
                                      {"role": "assistant", "content": "yes"},
                                      {"role": "user", "content": "fix : 1 + 1 = 3 no ="},
                                      {"role": "assistant", "content": "2"}])
    assert [t for t, m in _tokens(tok, two) if m] == ["yes", "<eos>", "2", "<eos>"]
    tokens = _tokens(tok, two)
    assert tokens[tokens.index(("fix", False)):] == [("fix", False), (":", False), ("1", False), ("+", False), ("1", False),
                                     ("=", False), ("3", False), ("no", False), ("=", False), ("2", True),
                                     ("<eos>", True)]


@pytest.mark.slow
def test_a_template_that_ends_replies_with_eos_gets_no_second_one(smollm2_hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    ex = tokenize_conversation(tok, [{"role": "user", "content": "What is 2 + 2?"},
                                     {"role": "assistant", "content": "4"}])
    trained = tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if m])
    assert trained.startswith("4<|im_end|>") and trained.count("<|im_end|>") == 1
    assert "What is 2 + 2?" in tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if not m])


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"text": "hi"}', 'expected {"messages"'),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}',
     "starts with an assistant message"),
    ('{"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}', "each message needs"),
])
def test_bad_rows_name_the_line_and_the_problem(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
                    + line + "\n")
    with pytest.raises(ValueError, match=rf"data.jsonl:2: .*{message}"):
        load_conversations(path)


def test_preflight_and_packing_errors(tmp_path, tiny_task_model):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        preflight(SFTConfig(model=str(tmp_path), data=str(data), output_dir=str(tmp_path / "o")))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        preflight(SFTConfig(model=str(tiny_task_model), data=str(tmp_path / "missing.jsonl")))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        preflight(SFTConfig(model=str(tiny_task_model), data=str(data), output_dir=str(tmp_path / "o")))
    with pytest.raises(ValueError, match="exceeds token_budget=3"):
        micro_batches([Example(ids=[1, 2, 3, 4], loss_mask=[False, False, True, True])], 3)
    with pytest.raises(ValueError, match="batch_sequences=0: must be >= 1"):
        SFTConfig(model="m", data="d", batch_sequences=0)


def test_batches_cover_every_example_once_per_epoch_and_pack_within_the_budget():
    examples = [Example(ids=[i] * (1 + i % 5), loss_mask=[True] * (1 + i % 5)) for i in range(23)]
    steps = batches(examples, batch_sequences=8, epochs=2, seed=3)
    assert [len(b) for b in steps] == [8, 8, 7, 8, 8, 7]
    for epoch in (steps[:3], steps[3:]):
        assert sorted(ex.ids[0] for b in epoch for ex in b) == list(range(23))
    assert steps[:3] != steps[3:]  # reshuffled
    for mb in micro_batches(steps[0], 9):
        assert sum(len(ex.ids) for ex in mb) <= 9


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_a_batch_is_shared_between_the_data_parallel_ranks(dp):
    """Each data-parallel rank trains its own part of a batch (not one rank the whole batch
    while the others wait): every example once, each rank a near-equal share within the budget,
    the same number of rounds on every rank."""
    examples = [Example(ids=[i] * (1 + i % 5), loss_mask=[True] * (1 + i % 5)) for i in range(23)]
    rounds = dp_rounds(examples, dp, 9)
    assert all(len(rnd) == dp for rnd in rounds)
    assert sorted(ex.ids[0] for rnd in rounds for mb in rnd for ex in mb) == list(range(23))
    counts = [sum(len(rnd[rank]) for rnd in rounds) for rank in range(dp)]
    assert max(counts) - min(counts) <= 1, counts
    for rnd in rounds:
        assert all(sum(len(ex.ids) for ex in mb) <= 9 for mb in rnd)
    assert dp_rounds([], dp, 9) == []
    # a batch that fits one micro-batch still goes to every rank
    [single] = dp_rounds(examples, dp, 1000)
    assert [len(mb) for mb in single] == [len(examples[rank::dp]) for rank in range(dp)]


# ---- real runs ------------------------------------------------------------------------------------------
def _solver_chats(path: Path, split: str, n: int) -> Path:
    from megatron_marsrl.rl.data import arithmetic_problems

    with path.open("w") as f:
        for p in arithmetic_problems(n, seed=0, split=split, max_operand=9, max_terms=2, ops="+-"):
            messages = arithmetic.SOLVER.build_prompt({"problem": p.problem}) + \
                [{"role": "assistant", "content": p.answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _sft(model: Path, data: Path, out: Path, *args: str, held_out: Path | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_marsrl.cli", "sft", "--model", str(model), "--data", str(data),
           "--output", str(out), *(["--eval", str(held_out)] if held_out else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def sft_rank(model: str, data: str, output: str, overrides: list[str]) -> None:
    """One rank of `marsrl sft` (the command's config resolution and rank function), for `launch`."""
    from argparse import Namespace

    from megatron_marsrl.commands.sft import resolve_config
    from megatron_marsrl.sft import run_rank

    run_rank(resolve_config(Namespace(model=model, data=data, eval="", output=output, force=False,
                                      overrides=overrides)))


def _sft_launched(model: Path, data: Path, out: Path, world: int, *args: str) -> list[dict]:
    """`_sft` with the ranks forked from the tests' launch server instead of a torchrun start."""
    from megatron_marsrl.megatron.launch import ONE_THREAD, launch

    launch("tests.test_sft:sft_rank", world, {"model": str(model), "data": str(data), "output": str(out),
                                              "overrides": list(args)}, env=ONE_THREAD)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_layouts_train_the_same_and_rl_starts_from_the_result(tmp_path, tiny_task_model):
    """World 1, EP2 and PP2 give the same losses step by step (SGD, so rounding noise is not
    amplified the way Adam's first step amplifies it); with Adam the held-out loss falls; the
    checkpoint is one `marsrl train` starts from."""
    data = _solver_chats(tmp_path / "train.jsonl", "train", 64)
    held_out = _solver_chats(tmp_path / "eval.jsonl", "eval", 12)
    # fp32: the layouts agree to rounding there (auto would be bf16 on a CPU with bf16 units)
    sgd = ("epochs=1", "batch_sequences=16", "token_budget=64", "optim.optimizer=sgd", "optim.lr=0.5", "dtype=float32")
    layouts = {"world1": ((), 1), "ep2": (("parallel.ep=2",), 2), "pp2": (("parallel.pp=2",), 2)}
    runs = {name: _sft_launched(tiny_task_model, data, tmp_path / name, world, *sgd, *layout)
            for name, (layout, world) in layouts.items()}
    losses = {name: [r["train/loss"] for r in records if "train/loss" in r] for name, records in runs.items()}
    assert len(losses["world1"]) == 4 and losses["world1"][-1] < losses["world1"][0]
    for name in ("ep2", "pp2"):
        assert losses[name] == pytest.approx(losses["world1"], rel=1e-4), name

    out = tmp_path / "adam"  # the command as a user runs it
    records = _sft(tiny_task_model, data, out, "epochs=10", "batch_sequences=16", "optim.lr=3e-3", "parallel.ep=2",
                   held_out=held_out)
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 1.0, evals
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    run = tmp_path / "rl"
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl.cli", "train", "--recipe", "tiny_arithmetic",
                           f"model.path={out / 'hf'}", f"run.output_dir={run}", "run.steps=1", "run.progress=false",
                           "run.checkpoint_every=0", "run.eval_every=0"],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "time/step" in r)
    assert first["rollout/solver/parse_fail"] < 0.5  # the warm start answers with digits and stops
