"""The agents' Generator protocol over our rollout engines, with tokenization on our side.

We render the chat template with the model's own tokenizer and send token ids, so the ids the
trainer later trains on are exactly the ids that were generated (no re-tokenization drift),
and every completion carries its prompt ids, output ids and per-token log-probs.
"""
from __future__ import annotations

import asyncio
import uuid
import zlib

from megatron_marsrl.agents.client import Completion, GenerationRequest
from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling


def load_tokenizer(path: str):
    """The HF tokenizer in ``path`` (a checkpoint or tokenizer directory), offline."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The token ids generation stops on: the tokenizer's EOS (one id or several)."""
    eos = tokenizer.eos_token_id
    return tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()


class EngineChatGenerator:
    """Samples chat completions from an EnginePool (or anything with ``async generate``)."""

    def __init__(self, pool, tokenizer, *, max_new_tokens: int | None = None, chat_template_kwargs: dict | None = None,
                 segment_tokens: int | None = None, gate=None, routed_experts: bool = False):
        """`segment_tokens` + `gate` (segment rollout): generate at most that many tokens per
        RL step; an unfinished output waits at `gate.wait()` for the next step's weights and
        continues from where it stopped. Completions carry each token's weight version (the
        engine's own record), with or without segments."""
        if (segment_tokens is None) != (gate is None):
            raise ValueError("segment rollout needs both segment_tokens and a gate")
        self.segment_tokens, self.gate, self.routed_experts = segment_tokens, gate, routed_experts
        self.pool = pool
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._stop_ids = stop_token_ids(tokenizer)

    def prompt_ids(self, messages) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 **self.chat_template_kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        s = request.sampling
        if s.stop:
            # Cutting text at a stop string would leave token ids that no longer match it.
            raise ValueError(f"stop strings {s.stop} are not supported here: the engine stops on token ids "
                             "(the tokenizer's EOS); train on the ids as generated")
        ids = self.prompt_ids(request.messages)
        max_new = min(s.max_tokens, self.max_new_tokens) if self.max_new_tokens else s.max_tokens
        def sampling(i: int, done: int, budget: int) -> EngineSampling:
            # completion i of a seeded request gets seed + i (+ tokens so far, per segment)
            seed = None if s.seed is None else zlib.crc32(f"{s.seed}:{i}:{done}".encode())
            return EngineSampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=budget,
                                  stop_token_ids=self._stop_ids, seed=seed)

        tag = uuid.uuid4().hex[:12]  # request ids must be unique across concurrent calls

        async def one(i: int) -> Completion:
            if self.gate is None:
                return await generate(i)
            self.gate.enter()
            try:
                return await generate(i)
            finally:
                self.gate.leave()

        async def generate(i: int) -> Completion:
            out_ids, logps, versions = [], [], []
            while True:
                budget = max_new - len(out_ids)
                if self.segment_tokens:
                    budget = min(budget, self.segment_tokens)
                out = await self.pool.generate(EngineRequest(prompt_ids=ids + out_ids, rid=f"{tag}-c{i}",
                                                             sampling=sampling(i, len(out_ids), budget),
                                                             return_routed_experts=self.routed_experts))
                out_ids += out.output_ids
                logps += out.logprobs
                versions += [out.weight_version] * len(out.output_ids)
                if out.finish_reason != "length" or len(out_ids) >= max_new or not self.segment_tokens:
                    completion = self._completion(ids, out_ids, logps, out.finish_reason, versions)
                    # the last request covered prompt + all output: its record spans every token
                    completion.routed_experts = out.routed_experts
                    return completion
                await self.gate.wait()

        return list(await asyncio.gather(*(one(i) for i in range(request.n))))

    def _completion(self, prompt_ids, output_ids, logprobs, finish_reason, versions) -> Completion:
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        return Completion(text=text, finish_reason=finish_reason, prompt=self.tokenizer.decode(prompt_ids),
                          prompt_token_ids=list(prompt_ids), token_ids=list(output_ids),
                          logprobs=list(logprobs), token_versions=versions)
