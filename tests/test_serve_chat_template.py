"""`labkit serve --chat-template`, as vLLM's option: a published template by name or a Jinja
file, in place of the model file's own, for every route that renders a conversation; one that
is missing or does not compile is refused when the server starts (exit 2, a one-line reason),
never at the first chat request. Gemma 3 270M's GGUF carries no template: its chat is refused
with a 400 that names the option, and served once the option gives it one."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from labkit.models.loader import load_tokenizer
from labkit.protocols.templates import chat_template_from, published_template
from live_server import LiveServer

pytestmark = pytest.mark.slow

# A template nothing else uses: its rendering is known by hand, so the ids a server runs can be
# checked against the plain tokenizer's encoding of that text (no template code involved).
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
BY_HAND = "[system] Be brief.\n[user] Name a colour.\n[assistant] "


def test_a_template_file_replaces_the_models_own_on_every_conversation_route(tmp_path):
    template = tmp_path / "brackets.jinja"
    template.write_text(BRACKETS)
    smol = load_tokenizer("smollm2-135m")
    want = smol.encode(BY_HAND, add_special_tokens=False)
    assert want != smol.encode_chat(MESSAGES)  # the file's own template renders another prompt
    with LiveServer("--model", "smollm2-135m", "--kv-cache-tokens", "2048", "--chat-template", str(template)) as server:
        tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()
        assert tokens["tokens"] == want
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=2, temperature=0)
        assert chat.usage.prompt_tokens == len(want)
        reply = client.responses.create(model="smollm2-135m", instructions="Be brief.", input="Name a colour.",
                                        max_output_tokens=16, temperature=0)
        assert reply.usage.input_tokens == len(want)


@pytest.mark.parametrize("spec, reason", [("/nonexistent/chat.jinja", "no such file"),
                                          ("BROKEN", "does not compile")])
def test_a_missing_or_broken_template_stops_the_server_at_start(tmp_path, spec, reason):
    if spec == "BROKEN":
        spec = str(tmp_path / "broken.jinja")
        (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    started = subprocess.run([sys.executable, "-m", "labkit.cli", "serve", "--port", "0", "--chat-template", spec],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 2, started.stdout + started.stderr
    assert reason in started.stderr and "Traceback" not in started.stderr, started.stderr


def test_gemma_chat_is_refused_without_a_template_and_served_with_the_published_one():
    gemma = load_tokenizer("gemma3-270m")
    assert gemma.chat_template is None
    with pytest.raises(ValueError, match="--chat-template"):
        gemma.encode_chat(MESSAGES)
    want = gemma.with_chat_template(published_template("gemma3")).encode_chat(MESSAGES)
    assert chat_template_from("gemma3") == published_template("gemma3")
    with LiveServer("--model", "gemma3-270m", "--kv-cache-tokens", "2048", "--chat-template", "gemma3") as server:
        tokens = httpx.post(server.url + "/tokenize", json={"model": "gemma3-270m", "messages": MESSAGES},
                            timeout=60).json()
        assert tokens["tokens"] == want
        assert gemma.decode(want).startswith("<bos><start_of_turn>user\nBe brief.")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="gemma3-270m", messages=MESSAGES, max_tokens=4, temperature=0)
        assert chat.usage.prompt_tokens == len(want) and chat.choices[0].finish_reason in ("stop", "length")
