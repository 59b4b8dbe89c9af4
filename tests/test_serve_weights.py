"""`labkit serve --weights`: the service runs the engine on the weights it was told to.

With `gguf-int8` the matrices read the model file's blocks and round the activations to
8 bits, which changes the greedy tokens of this prompt after a few; the served answer must
be that model's, from the engine's simple loop in this process, and not float32's."""

from __future__ import annotations

import openai
import pytest

from labkit.engine.backends import backend_for
from labkit.engine.loop import generate
from labkit.sampling import SamplingParams
from live_server import LiveServer

pytestmark = pytest.mark.slow


def test_a_server_on_the_files_blocks_answers_with_that_model(model):
    prompt, params = "List three colours:", SamplingParams(temperature=0.0, max_tokens=16)
    rounded = generate(backend_for(True, "gguf-int8").prepare(model), prompt, params)
    assert rounded.token_ids != generate(model, prompt, params).token_ids  # the check can tell them apart
    with LiveServer("--model", "smollm2-135m", "--weights", "gguf-int8", "--kv-cache-tokens", "2048") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0)
    assert answer.choices[0].text == rounded.text
