"""`labkit serve --weights`: the service runs the engine on the weights it was told to.

With `gguf-int8` the matrices read the model file's blocks and round the activations to
8 bits, which changes the greedy tokens of this prompt after a few; the served answer must
be that of the same engine configuration run in this process, and not float32's."""

from __future__ import annotations

import openai
import pytest

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.sampling import SamplingParams
from live_server import LiveServer

pytestmark = pytest.mark.slow


def test_a_server_on_the_files_blocks_answers_with_that_model(model):
    prompt = model.tokenizer.encode("List three colours:")
    params = SamplingParams(temperature=0.0, max_tokens=16)

    def in_process(weights: str) -> str:
        engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048, weights=weights))
        return model.tokenizer.decode(engine.generate([prompt], params)[0].samples[0].token_ids)

    rounded = in_process("gguf-int8")
    assert rounded != in_process("f32")  # the check can tell them apart
    with LiveServer("--model", "smollm2-135m", "--weights", "gguf-int8", "--kv-cache-tokens", "2048") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="smollm2-135m", prompt="List three colours:", max_tokens=16,
                                           temperature=0)
    assert answer.choices[0].text == rounded


def test_a_server_with_a_bf16_cache_answers_with_that_engine(model):
    """`--weights bf16 --kv-dtype bf16`: the served tokens are those of that engine in this
    process, which on this prompt differ from the same weights over a float32 cache (so a
    flag that did not reach the engine would fail the check)."""
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    prompt, params = model.tokenizer.encode(text), SamplingParams(temperature=0.0, max_tokens=16)

    def in_process(kv_dtype: str | None) -> str:
        engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048, weights="bf16", kv_dtype=kv_dtype))
        return model.tokenizer.decode(engine.generate([prompt], params)[0].samples[0].token_ids)

    bf16_cache = in_process("bf16")
    assert bf16_cache != in_process(None)
    with LiveServer("--model", "smollm2-135m", "--weights", "bf16", "--kv-dtype", "bf16",
                    "--kv-cache-tokens", "2048") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=16, temperature=0)
    assert answer.choices[0].text == bf16_cache
