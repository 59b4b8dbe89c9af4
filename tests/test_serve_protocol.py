"""What the service accepts, field by field, without a server: body parsing and validation."""

from __future__ import annotations

import pytest

from labkit.serve.errors import APIError
from labkit.serve.protocol import (ChatCompletionRequest, CompletionRequest, check_content_type,
                                   parse_json_body, validate)

BASE = {"model": "m", "prompt": "hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("raw, code", [
    (b"", "invalid_json"),
    (b"{not json", "invalid_json"),
    (b'{"model": "m", "temperature": NaN}', "invalid_json"),
    (b'{"model": "m", "temperature": Infinity}', "invalid_json"),
    (b'{"a": 1, "a": 2}', "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'"text"', "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', "invalid_utf8"),
    (b"[" * 100_000, "invalid_json"),
    (b'{"a": ' * 10_000 + b"1" + b"}" * 10_000, "invalid_json"),
    (b'{"model": "m", "temperature": 1e999}', "invalid_json"),
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    (b"12", "invalid_json"),
    (b"null", "invalid_json"),
])
def test_bodies_that_are_not_a_json_object_are_refused_with_400(raw, code):
    error = refusal(lambda: parse_json_body(raw))
    assert (error.status, error.code) == (400, code)


@pytest.mark.parametrize("raw, param", [
    (rb'{"model": "m", "prompt": "a\ud800b"}', "prompt"),
    (rb'{"model": "m", "prompt": ["ok", "\udfff"]}', "prompt[1]"),
    (rb'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
     "messages[0].content[0].text"),
    (rb'{"model": "m", "stop": ["\ud83d"]}', "stop[0]"),
    (rb'{"model": "m", "user": "\uDBFF"}', "user"),
    (rb'{"model": "m", "metadata": {"\ud800": "v"}}', "metadata.\\ud800"),
    (rb'{"\ud800": 1}', "\\ud800"),
])
def test_a_string_that_is_not_unicode_is_refused_where_it_is(raw, param):
    error = refusal(lambda: parse_json_body(raw))
    assert (error.status, error.code, error.param) == (400, "invalid_unicode", param)
    error.response()  # the answer itself can be sent: no surrogate reaches its UTF-8 encoding


@pytest.mark.parametrize("raw, value", [
    (rb'{"prompt": "\ud83d\ude00"}', "\U0001f600"),  # a surrogate pair is one character
    (rb'{"prompt": "a\u0000b"}', "a\x00b"),  # NUL is Unicode text
    (rb'{"prompt": "\\ud800"}', "\\ud800"),  # an escaped backslash, then "ud800": no surrogate
])
def test_valid_unicode_escapes_pass(raw, value):
    assert parse_json_body(raw)["prompt"] == value


def test_a_json_object_is_parsed():
    assert parse_json_body('{"model": "m", "prompt": "é"}'.encode()) == {"model": "m", "prompt": "é"}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_only_utf8_json_bodies_are_taken(content_type):
    assert refusal(lambda: check_content_type(content_type)).status == 415


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=UTF-8"])
def test_json_content_types_pass(content_type):
    check_content_type(content_type)


@pytest.mark.parametrize("extra, param, code", [
    ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"max_tokens": 5.0}, "max_tokens", "invalid_type"),
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"n": 17}, "n", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"logprobs": 6}, "logprobs", "invalid_value"),
    ({"presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [1, -2]}, "prompt", "invalid_value"),
    ({"prompt": None}, "prompt", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
    ({"echo": True, "logprobs": 0}, "echo", "unsupported_parameter"),
    ({"echo": 0}, "echo", "invalid_type"),
    ({"best_of": 2}, "best_of", "unsupported_parameter"),
    ({"best_of": True}, "best_of", "unsupported_parameter"),
    ({"suffix": "x"}, "suffix", "unsupported_parameter"),
    ({"logit_bias": {"a": 5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"-1": 5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"01": 5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1" * 19: 5}}, "logit_bias", "unknown_token"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": "5"}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"1": True}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"logit_bias": [[1, 5]]}, "logit_bias", "invalid_type"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids[1]", "invalid_value"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids[0]", "invalid_type"),
    ({"stop_token_ids": 2}, "stop_token_ids", "invalid_type"),
    ({"metadata": {}}, "metadata", "unknown_parameter"),  # chat's, not in CreateCompletionRequest
    ({"temprature": 0.5}, "temprature", "unknown_parameter"),
    ({"messages": []}, "messages", "unknown_parameter"),
])
def test_each_bad_completion_field_is_named(extra, param, code):
    error = refusal(lambda: validate(CompletionRequest, BASE | extra))
    assert (error.status, error.param, error.code) == (400, param, code), error.message
    assert param in error.message


def test_a_missing_field_is_named():
    error = refusal(lambda: validate(CompletionRequest, {"model": "m"}))
    assert (error.param, error.code) == ("prompt", "missing_required_parameter")


def test_null_means_not_given():
    request = validate(CompletionRequest, BASE | {"temperature": None, "logit_bias": None, "n": None})
    assert request.temperature is None and request.n is None


def test_integers_are_taken_where_numbers_are_asked_for():
    assert validate(CompletionRequest, BASE | {"temperature": 1}).temperature == 1.0


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], ["a", "b"], [[1, 2], [3]]])
def test_completion_prompts_may_be_text_ids_or_lists_of_either(prompt):
    assert validate(CompletionRequest, BASE | {"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("messages, param, code", [
    ([], "messages", "invalid_value"),
    ([{"role": "function", "content": "x"}], "messages[0].role", "invalid_type"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id", "missing_required_parameter"),
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": "x", "name": "bob"}], "messages[0].name", "unsupported_parameter"),
    ([{"role": "user", "content": "x", "mood": "ok"}], "messages[0].mood", "unknown_parameter"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content",
     "invalid_type"),
    ("hello", "messages", "invalid_type"),
])
def test_each_bad_message_is_named(messages, param, code):
    error = refusal(lambda: validate(ChatCompletionRequest, CHAT | {"messages": messages}))
    assert (error.param, error.code) == (param, code), error.message


def test_chat_rules_between_fields():
    both = refusal(lambda: validate(ChatCompletionRequest, CHAT | {"max_tokens": 4, "max_completion_tokens": 4}))
    assert both.param == "max_tokens"
    alone = refusal(lambda: validate(ChatCompletionRequest, CHAT | {"top_logprobs": 3}))
    assert alone.param == "top_logprobs"
    assert refusal(lambda: validate(ChatCompletionRequest, CHAT | {"tools": []})).param == "tools"  # as OpenAI


def test_text_parts_are_joined():
    request = validate(ChatCompletionRequest, CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert request.messages[0].text == "a\nb"


def test_every_error_has_the_one_shape():
    body = refusal(lambda: validate(CompletionRequest, BASE | {"n": 0})).body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


NO_OP_CHAT = [{"store": False}, {"response_format": {"type": "text"}}, {"logit_bias": {}},
              {"stop_token_ids": []},
              {"parallel_tool_calls": True}, {"parallel_tool_calls": False}, {"service_tier": "auto"},
              {"tool_choice": "none"},
              {"modalities": ["text"]}, {"metadata": {}}, {"metadata": {"k" * 64: "v" * 512, "team": "a"}},
              {"user": "user-1234"}, {"function_call": "none"}, {"reasoning_effort": "medium"},
              {"verbosity": "medium"}, {"stream": True, "stream_options": {"include_obfuscation": False}}]


@pytest.mark.parametrize("extra", NO_OP_CHAT, ids=lambda e: ",".join(e))
def test_openai_fields_at_values_that_change_nothing_are_taken(extra):
    request = validate(ChatCompletionRequest, CHAT | extra)
    assert request.temperature is None and request.n is None


@pytest.mark.parametrize("extra, param, code", [
    ({"store": True}, "store", "unsupported_parameter"),
    ({"store": 0}, "store", "unsupported_parameter"),
    ({"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ({"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
    ({"moderation": {"model": "x"}}, "moderation", "unsupported_parameter"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "unsupported_parameter"),
    ({"metadata": {"k": 1}}, "metadata", "invalid_type"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"metadata": ["k"]}, "metadata", "invalid_type"),
    ({"mystery": False}, "mystery", "unknown_parameter"),
])
def test_other_values_of_fields_this_service_does_not_implement_are_refused(extra, param, code):
    error = refusal(lambda: validate(ChatCompletionRequest, CHAT | extra))
    assert (error.status, error.param, error.code) == (400, param, code), error.message


@pytest.mark.parametrize("field", ["logit_bias", "temperature", "stop", "echo", "user"])
def test_nesting_as_deep_as_the_parser_goes_is_refused_not_crashed(field):
    """A value nested just shallower than the parser's limit must not overflow the stack of
    what reads it next (comparing it with a no-op value, quoting it in the message)."""
    for depth in range(900, 1000):
        raw = b'{"model": "m", "prompt": "x", "' + field.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
        try:
            body = parse_json_body(raw)
        except APIError:
            continue  # deeper than the parser goes: invalid_json
        assert refusal(lambda: validate(CompletionRequest, body)).status == 400
