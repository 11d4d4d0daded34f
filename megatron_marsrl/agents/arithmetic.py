"""The embedded CPU task: Solver, Verifier and Corrector on small integer arithmetic.

Two role sets: `ROLES` for the tiny model of the embedded main job, and `CHAT_ROLES` for a real
instruct model (task "arithmetic_chat", e.g. SmolLM2 in the `smollm2_arithmetic` recipe):
plain-English requests rendered with the model's own chat template.

The tiny main job exists so the whole RL system (agentic pipeline, scheduler, Megatron, rollout engine,
weight sync, checkpoints) can train for real on a 2-core machine in minutes and show
rewards rising. Three things differ from the MarsRL math task, all for speed:
  * a word-level tokenizer of ~40 tokens (digits one token each), so a tiny randomly
    initialised Qwen3-MoE emits a digit or a verdict word from the first step;
  * compact prompts ("solve: What is 3 + 4 ?", "check: ... = 7", "fix: ... = 8 no");
  * lenient parsers: the answer is the leading run of digits, the verdict the first word
    ("yes" = correct, "no" = wrong), so short outputs are scored without a format to learn.
Rewards are the MarsRL agent rewards (rewards/agent_rewards.py: answer match; verdict right
about the judged answer, read with this task's parser).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path

from megatron_marsrl.agents.client import Message
from megatron_marsrl.agents.parsing import ParsedOutput
from megatron_marsrl.agents.roles import Role, RoleSet
from megatron_marsrl.data_types import ParseStatus, Verdict
from megatron_marsrl.rewards.agent_rewards import answer_reward, verdict_reward

SPECIAL = ("<pad>", "<eos>", "<unk>")
WORDS = ("solve", "check", "fix", ":", "What", "is", "Compute", "?", ".", "+", "-", "*", "=", "(", ")",
         "yes", "no")
VOCAB = SPECIAL + WORDS + tuple(str(d) for d in range(10))
MODEL_VOCAB = 64
"""Rows of the tiny model's embedding (>= len(VOCAB); a multiple of 8 for any TP up to 8)."""

# Every message is its content followed by a space; generation starts right after "=" or ":".
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def build_tokenizer(out_dir: str | Path):
    """Save the task's word-level tokenizer (HF format, chat template included) to `out_dir`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_model(out_dir: str | Path, *, seed: int = 0, overrides: dict | None = None) -> Path:
    """A tiny random Qwen3-MoE plus the task tokenizer in `out_dir` (an HF checkpoint)."""
    from megatron_marsrl.megatron.tiny import make_hf_checkpoint

    eos = VOCAB.index("<eos>")
    config = {"vocab_size": MODEL_VOCAB, "eos_token_id": eos, "pad_token_id": VOCAB.index("<pad>"),
              "bos_token_id": None, "max_position_embeddings": 256, **(overrides or {})}
    if config["vocab_size"] < len(VOCAB):
        raise ValueError(f"tiny model vocab_size={config['vocab_size']} is smaller than the task "
                         f"tokenizer ({len(VOCAB)} tokens)")
    path = make_hf_checkpoint("qwen3_moe", out_dir, seed=seed, overrides=config)
    build_tokenizer(path)
    return path


_VERDICT_WORDS = {"yes": Verdict.CORRECT, "no": Verdict.WRONG}


def _unparsed(text: str, status: ParseStatus, passed_on: str) -> ParsedOutput:
    """No value: EMPTY for a blank output, ``status`` otherwise."""
    return ParsedOutput(value=None, status=ParseStatus.EMPTY if not text.strip() else status, passed_on=passed_on)


def _words(text: str) -> list[str]:
    return text.replace("<eos>", " ").split()


def parse_answer(text: str, finish_reason: str = "stop") -> ParsedOutput:
    """Leading digits of the output ("1 2 +" -> "12"); the rest is ignored, and so is a cut-off
    ending (outputs here are a few tokens; there is no reasoning to lose)."""
    digits = []
    for word in _words(text):
        if not word.isdigit():
            break
        digits.append(word)
    if not digits:
        return _unparsed(text, ParseStatus.NO_ANSWER, text.strip())
    value = "".join(digits)
    return ParsedOutput(value=value, status=ParseStatus.OK, passed_on=value)


def parse_verdict(text: str, finish_reason: str = "stop") -> ParsedOutput:
    """First word: "yes" -> correct, "no" -> wrong; anything else has no verdict."""
    words = _words(text)
    first = words[0] if words else ""
    verdict = _VERDICT_WORDS.get(first)
    if verdict is None:
        return _unparsed(" ".join(words), ParseStatus.NO_VERDICT, first)
    return ParsedOutput(value=verdict.value, status=ParseStatus.OK, passed_on=first)


def _judged_answer(solution: str) -> str | None:
    return parse_answer(solution).value


def _prompt(template: str):
    def build(inputs: Mapping[str, str]) -> list[Message]:
        return [{"role": "user", "content": template.format(**inputs)}]
    return build


SOLVER = Role(name="solver", input_keys=("problem",), build_prompt=_prompt("solve : {problem} ="),
              parse_output=parse_answer, reward=answer_reward)
VERIFIER = Role(name="verifier", input_keys=("problem", "solution"),
                build_prompt=_prompt("check : {problem} = {solution} :"), parse_output=parse_verdict,
                reward=functools.partial(verdict_reward, extract=_judged_answer))
CORRECTOR = Role(name="corrector", input_keys=("problem", "solution", "report"),
                 build_prompt=_prompt("fix : {problem} = {solution} {report} ="), parse_output=parse_answer,
                 reward=answer_reward)
# A solution is passed on as its answer alone; a rejection as the verdict word.
ROLES = RoleSet(solver=SOLVER, verifier=VERIFIER, corrector=CORRECTOR, solution_text=str, rejection_report="no")


def demonstrations(problems, *, seed: int, roles: RoleSet = ROLES, judged: int = 4) -> list[list[Message]]:
    """Supervised conversations for a warm start (`marsrl sft` data). For each problem: the Solver
    giving the answer; the Verifier judging `judged` wrong solutions ("no": a near miss, then
    others within 9 of the answer) each next to the right one ("yes"), so its verdicts are
    balanced; the Corrector fixing the near miss. Deterministic in `seed`.

    Judging many wrong solutions is what makes the Verifier compare rather than recognise: with
    one near miss per problem a tiny model learns to accept anything but that near miss (and
    the extra checks also teach it, and through it the Solver, more arithmetic)."""
    import random

    if judged < 1:
        raise ValueError(f"demonstrations: judged={judged} must be >= 1")
    rng = random.Random(f"demonstrations:{seed}")
    out: list[list[Message]] = []
    for p in problems:
        right = int(p.answer)
        near = max(0, right + rng.choice([-3, -2, -1, 1, 2, 3])) if right > 2 else right + rng.randint(1, 3)
        others = [v for v in range(max(0, right - 9), right + 10) if v not in (right, near)]
        wrongs = [str(near)] + [str(v) for v in rng.sample(others, min(judged - 1, len(others)))]
        out.append(roles.solver.build_prompt({"problem": p.problem}) + [{"role": "assistant", "content": p.answer}])
        for wrong in wrongs:
            for solution, verdict in ((p.answer, "yes"), (wrong, "no")):
                out.append(roles.verifier.build_prompt({"problem": p.problem, "solution": solution})
                           + [{"role": "assistant", "content": verdict}])
        out.append(roles.corrector.build_prompt({"problem": p.problem, "solution": wrongs[0],
                                                 "report": roles.rejection_report})
                   + [{"role": "assistant", "content": p.answer}])
    return out


# ---- CHAT_ROLES: the same task for a pretrained instruct model ------------------------------
_NUMBER = re.compile(r"-?\d+")


def parse_chat_answer(text: str, finish_reason: str = "stop") -> ParsedOutput:
    """The last integer of a reply that ended by itself ("7 + 5 = 12." -> "12"). A reply cut
    off at the token limit has no answer: short, finished replies are what the task asks for."""
    if finish_reason == "length":
        return ParsedOutput(value=None, status=ParseStatus.TRUNCATED, passed_on=text.strip())
    numbers = _NUMBER.findall(text)
    if not numbers:
        return _unparsed(text, ParseStatus.NO_ANSWER, text.strip())
    value = str(int(numbers[-1]))
    return ParsedOutput(value=value, status=ParseStatus.OK, passed_on=value)


def parse_chat_verdict(text: str, finish_reason: str = "stop") -> ParsedOutput:
    """The first word, case and punctuation aside: "Yes" -> correct, "No" -> wrong."""
    words = re.findall(r"[a-z]+", text.lower())
    first = words[0] if words else ""
    verdict = _VERDICT_WORDS.get(first)
    if verdict is None:
        return _unparsed(text, ParseStatus.NO_VERDICT, text.strip())
    return ParsedOutput(value=verdict.value, status=ParseStatus.OK, passed_on=first)


def _chat_judged_answer(solution: str) -> str | None:
    return parse_chat_answer(solution).value


CHAT_SOLVER = Role(name="solver", input_keys=("problem",),
                   build_prompt=_prompt("{problem} Reply with the number only."),
                   parse_output=parse_chat_answer, reward=answer_reward)
CHAT_VERIFIER = Role(name="verifier", input_keys=("problem", "solution"),
                     build_prompt=_prompt("Question: {problem}\nProposed answer: {solution}\n"
                                          "Is the proposed answer correct? Reply yes or no."),
                     parse_output=parse_chat_verdict,
                     reward=functools.partial(verdict_reward, extract=_chat_judged_answer))
CHAT_CORRECTOR = Role(name="corrector", input_keys=("problem", "solution", "report"),
                      build_prompt=_prompt("Question: {problem}\nProposed answer: {solution}\n"
                                           "A checker replied: {report}\nGive the correct answer. "
                                           "Reply with the number only."),
                      parse_output=parse_chat_answer, reward=answer_reward)
CHAT_ROLES = RoleSet(solver=CHAT_SOLVER, verifier=CHAT_VERIFIER, corrector=CHAT_CORRECTOR, solution_text=str,
                     rejection_report="no")
