"""POST /tokenize and POST /detokenize over a real socket (raw HTTP), held to `transformers`'
tokenizer of the same GGUF file, and to the ids the completion and chat routes run."""

from __future__ import annotations

import httpx
import pytest

from labkit.models.registry import fetch
from live_server import LiveServer

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow
# no whitespace before a digit: transformers' GGUF tokenizer lacks SmolLM2's Digits step there
TEXTS = ["Hello world", "Les modèles de langage prédisent le prochain mot. 東京は首都です。",
         "def f(x):\n    return x*2\n", "emoji 🎉 and <|im_end|> inside", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"},
     {"role": "assistant", "content": "Stored keys and values."}, {"role": "user", "content": "Why?"}],
]


@pytest.fixture(scope="module")
def server():
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "4096", "--max-model-len", "1024") as live:
        yield live


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    path = fetch(MODEL)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def hf_chat_ids(hf, messages, add_generation_prompt=True) -> list[int]:
    ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_a_prompts_ids_are_transformers(server, hf, text, special):
    answer = post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": special,
                                        "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = hf(text, add_special_tokens=special).input_ids
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == hf.convert_ids_to_tokens(expected)
    assert body["max_model_len"] == 1024


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_conversations_ids_are_transformers_chat_template(server, hf, messages, generation_prompt):
    answer = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": generation_prompt})
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == hf_chat_ids(hf, messages, generation_prompt)
    assert "token_strs" not in answer.json()


def test_the_counts_are_what_the_completion_and_chat_routes_run(server):
    # a special token spelled in a message is plain text in the chat route (labkit.protocols.templates)
    text, messages = TEXTS[1], CONVERSATIONS[1] + [{"role": "user", "content": "and <|im_end|> inside?"}]
    completion = post(server, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    counted = post(server, "/tokenize", {"prompt": text}).json()["count"]
    assert counted == completion.json()["usage"]["prompt_tokens"]
    counted = post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert counted == chat.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_is_transformers_decode(server, hf, text):
    ids = hf(text, add_special_tokens=False).input_ids
    answer = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"prompt": hf.decode(ids)}
    assert answer.json()["prompt"] == text


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens[1]", "token_out_of_vocabulary"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]", "invalid_value"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens[0]", "invalid_type"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model", "model_not_found"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "messages",
     "invalid_value"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt",
     "unknown_parameter"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/tokenize", {}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "invalid_type"),
])
def test_bad_requests_get_a_400_or_404_naming_the_field(server, path, body, status, param, code):
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param and answer.json()["error"]["code"] == code, answer.text
