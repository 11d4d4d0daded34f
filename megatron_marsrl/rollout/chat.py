"""The agents' Generator protocol over our rollout engines, with tokenization on our side.

We render the chat template with the model's own tokenizer and send token ids, so the ids the
trainer later trains on are exactly the ids that were generated (no re-tokenization drift),
and every completion carries its prompt ids, output ids and per-token log-probs.
"""
from __future__ import annotations

import asyncio

from megatron_marsrl.agents.client import Completion, GenerationRequest
from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling


def load_tokenizer(path: str):
    """The HF tokenizer in ``path`` (a checkpoint or tokenizer directory), offline."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


class EngineChatGenerator:
    """Samples chat completions from an EnginePool (or anything with ``async generate``)."""

    def __init__(self, pool, tokenizer, *, max_new_tokens: int | None = None, chat_template_kwargs: dict | None = None):
        self.pool = pool
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.chat_template_kwargs = chat_template_kwargs or {}
        eos = tokenizer.eos_token_id
        self._stop_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()

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
        def sampling(i: int) -> EngineSampling:  # completion i of a seeded request gets seed + i
            return EngineSampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=max_new,
                                  stop_token_ids=self._stop_ids, seed=None if s.seed is None else s.seed + i)

        outs = await asyncio.gather(*(self.pool.generate(EngineRequest(prompt_ids=ids, sampling=sampling(i), rid=f"c{i}"))
                                      for i in range(request.n)))
        prompt = self.tokenizer.decode(ids)
        return [self._completion(prompt, out) for out in outs]

    def _completion(self, prompt: str, out) -> Completion:
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return Completion(text=text, finish_reason=out.finish_reason, prompt=prompt,
                          prompt_token_ids=list(out.prompt_ids), token_ids=list(out.output_ids),
                          logprobs=list(out.logprobs))
