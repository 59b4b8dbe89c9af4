"""`labkit serve --weights`: the service runs the engine on the weights it was told to.

With `gguf-int8` the matrices read the model file's blocks and round the activations to
8 bits; with `--kv-dtype bf16` the keys and values are stored in bfloat16. The served answer
must be that of the same engine configuration run in this process (the same kernels on the
same single request: the same numerical path, so the same tokens), and its log-probabilities
must be that configuration's, not those of the configuration a lost flag would run (which
part from them by far more than float32 rounding)."""

from __future__ import annotations

import openai
import pytest

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.sampling import SamplingParams
from conftest import needs_kernels
from live_server import LiveServer

# both modes run on labkit's C kernels; a server told to use one where they do not load
# refuses to start and says why; it never serves float32 instead
pytestmark = [pytest.mark.slow, needs_kernels]
# How far the served log-probabilities may be from the same configuration's in this process,
# and how far apart (on some step both share) the other configuration's must be: float32
# rounding is ~1e-5; 8-bit activations and a bfloat16 cache move a log-probability by ~1e-2.
SAME, APART = 1e-4, 1e-3


def in_process(model, prompt, params, **config):
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048, **config))
    return engine.generate([prompt], params)[0].samples[0]


def shared_steps_apart(a, b) -> float:
    """The largest difference of two samples' chosen log-probabilities on the steps before
    (and at) their first different token, where both read the same text."""
    n = next((i + 1 for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
             min(len(a.token_ids), len(b.token_ids)))
    return max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n]))


def test_a_server_on_the_files_blocks_answers_with_that_model(model):
    prompt = model.tokenizer.encode("List three colours:")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    rounded = in_process(model, prompt, params, weights="gguf-int8")
    assert shared_steps_apart(rounded, in_process(model, prompt, params, weights="f32")) > APART  # told apart
    with LiveServer("--model", "smollm2-135m", "--weights", "gguf-int8", "--kv-cache-tokens", "2048") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="smollm2-135m", prompt="List three colours:", max_tokens=16,
                                           temperature=0, logprobs=0)
    assert answer.choices[0].text == model.tokenizer.decode(rounded.token_ids)
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(rounded.logprobs, abs=SAME)


def test_a_server_with_a_bf16_cache_answers_with_that_engine(model):
    """`--weights bf16 --kv-dtype bf16`: the served tokens and log-probabilities are those of
    that engine in this process, whose log-probabilities part from the same weights over a
    float32 cache (so a flag that did not reach the engine would fail the check)."""
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    prompt, params = model.tokenizer.encode(text), SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    bf16_cache = in_process(model, prompt, params, weights="bf16", kv_dtype="bf16")
    assert shared_steps_apart(bf16_cache, in_process(model, prompt, params, weights="bf16")) > APART
    with LiveServer("--model", "smollm2-135m", "--weights", "bf16", "--kv-dtype", "bf16",
                    "--kv-cache-tokens", "2048") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=16, temperature=0,
                                           logprobs=0)
    assert answer.choices[0].text == model.tokenizer.decode(bf16_cache.token_ids)
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(bf16_cache.logprobs, abs=SAME)
