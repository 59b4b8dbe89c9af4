"""What a request may say: the body's bytes, then its fields, checked before any work.

    bytes --parse_json_body--> dict --check_fields--> dict --pydantic (strict)--> request model

`parse_json_body` refuses a wrong content type (415), a body over the limit (413), invalid
UTF-8, text that is not JSON (NaN and Infinity are not JSON, nor a number beyond a float's
range such as 1e999), duplicate keys, a string anywhere that is not Unicode (an unpaired
UTF-16 surrogate escape such as "\\ud800": `invalid_unicode`) and anything but an object (400).
`check_fields` names the first field we do not take: one of OpenAI's that this service does
not implement, sent at a value other than the no-op values of `labkit.serve.openai_fields`
(`unsupported_parameter`), or one OpenAI does not have either (`unknown_parameter`). The
models are strict: `"5"`, `5.0` and `true` are not token counts, NaN is not a temperature. A
field sent as null means "not given", as in OpenAI's API; the defaults are OpenAI's and are
listed in `labkit/serve/README.md`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labkit.serve.errors import APIError, invalid
from labkit.serve.openai_fields import (CHAT_NO_OPS, COMPLETION_NO_OPS, MESSAGE_NO_OPS, STREAM_OPTIONS_NO_OPS,
                                        asks_for_nothing, describe_no_ops)

MAX_STOP_STRINGS = 4          # OpenAI's limit
MAX_N = 16
MAX_LOGIT_BIAS = 300          # entries: OpenAI's limit (refused above it)
MAX_LOGIT_BIAS_VALUE = 100    # OpenAI's range: [-100, 100]
MAX_TOOLS = 128               # OpenAI's limit on `tools`
MAX_STOP_TOKEN_IDS = 64       # labkit's cap on vLLM's `stop_token_ids` (vLLM has none)
# a token id as OpenAI's logit_bias keys write it: a decimal integer without sign or leading zero
TOKEN_ID_KEY = "^(0|[1-9][0-9]*)$"
_MAX_TOKEN_ID_DIGITS = 18     # a longer id is past any vocabulary (and int() of 4,300 digits raises)
# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


# -- the body --------------------------------------------------------------------------------

def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond a 64-bit float's range")
    return value


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only where one occurs can a parsed
# string hold a lone surrogate (UTF-8 text cannot), so only then are the strings walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_string_not_unicode(value) -> str | None:
    """Where the first string (key or value) holding a lone surrogate is, as a field path such
    as `messages[0].content`; None if there is none. Iterative: nesting depth costs no stack."""
    pending = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return path or "(the body)"
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                where = key.encode("utf-8", "backslashreplace").decode("utf-8")
                where = f"{path}.{where}" if path else where
                if not _is_unicode(key):
                    return where
                pending.append((where, inner))
        elif isinstance(item, list):
            pending.extend((f"{path}[{i}]", inner) for i, inner in reversed(list(enumerate(item))))
    return None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def check_content_type(content_type: str | None) -> None:
    media, _, params = (content_type or "").partition(";")
    if media.strip().lower() != "application/json":
        raise APIError(415, f"the body must be application/json, got {content_type or 'no Content-Type'}",
                       "unsupported_media_type")
    charset = params.strip().lower().removeprefix("charset=").strip('"') if "charset" in params.lower() else "utf-8"
    if charset not in ("utf-8", "utf8"):
        raise APIError(415, f"the body must be UTF-8, got charset {charset}", "unsupported_media_type")


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise invalid(f"the body is not valid UTF-8 (byte {error.start})", code="invalid_utf8") from None
    if not text.strip():
        raise invalid("the body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as error:
        reason = str(error)
        if "integer string conversion" in reason:  # Python's own guard, in words for the client
            reason = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        raise invalid(f"the body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):
        where = first_string_not_unicode(body)
        if where is not None:
            raise invalid(f"{where}: the string holds an unpaired UTF-16 surrogate escape, which is not "
                          "Unicode text", where, "invalid_unicode")
    return body


def check_fields(body: dict, model: type[BaseModel], unsupported: dict[str, tuple], where: str = "") -> dict:
    """The body without the unsupported fields sent at a value that asks for nothing (null, or
    one of `unsupported[field]`); APIError for any other field the model does not have."""
    kept = {}
    for key, value in body.items():
        name = f"{where}{key}"
        if key in model.model_fields:
            kept[key] = value
        elif key not in unsupported:
            raise APIError(400, f"unknown parameter {name}", "unknown_parameter", name)
        elif not asks_for_nothing(value, unsupported[key]):
            taken = f" (only {describe_no_ops(unsupported[key])} are taken: they change nothing)" \
                if unsupported[key] else ""
            raise APIError(400, f"{name} is not supported by this service{taken}", "unsupported_parameter", name)
    return kept


# -- the fields ------------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool | None = None


Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`: a name (as OpenAI's: letters, digits, '_' and
    '-', at most 64), the schema (absent: any JSON value, as the empty schema says), and
    `strict`, with which a schema must follow OpenAI's strict rules."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatField(Strict):
    """`response_format`: text (no constraint), any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Strict):
    """The fields both routes share."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stop: Union[Annotated[str, Field(min_length=1)],
                Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)],
                None] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    ignore_eos: bool | None = None  # vLLM's: go on to max_tokens (benchmarks)
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Bias],
                          Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})
                          ] | None = None
    # vLLM's: stop at any of these ids (which are not part of the text)
    stop_token_ids: StopTokenIds | None = None
    deadline_ms: Annotated[float, Field(gt=0, le=1e7)] | None = None  # ours: admission control
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # chat: OpenAI's; completions: vLLM's extension, the same object
    response_format: ResponseFormatField | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as SamplingParams takes it; the keys were checked by `validate`."""
        return tuple((int(key), value) for key, value in (self.logit_bias or {}).items())

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.stop_token_ids or ())


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Union[str, TokenIds, Annotated[list[str], Field(min_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None  # the prompt's text before each choice's


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, Annotated[list[TextPart], Field(min_length=1)]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


# -- tools (labkit.serve.openai_tools turns these into labkit.protocols.tool_use's dataclasses) --

class FunctionDefinition(Strict):
    """A function tool: its name (checked with the tools as a whole), what it does, and a JSON
    Schema for its arguments object (absent: no arguments)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class MessageToolCall(Strict):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: CalledFunction


class ChatTurn(ChatMessage):
    """A chat route message: ChatMessage's roles and `tool`; an assistant turn's calls
    (content may then be null) and a tool turn's `tool_call_id` (checked in `validate`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Annotated[list[TextPart], Field(min_length=1)], None] = None
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1)] | None = None

    @property
    def text(self) -> str:
        return "" if self.content is None else super().text

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """What `/openapi.json` says a message is: one of the three shapes `check_turns` takes
        (the model itself has every field optional, so that a refusal names the field)."""
        shapes = (PlainTurn, AssistantTurn, ToolTurn)
        return {"oneOf": [handler(shape.__pydantic_core_schema__) for shape in shapes]}


Content = Union[str, Annotated[list[TextPart], Field(min_length=1)]]


class PlainTurn(Strict):
    role: Literal["system", "developer", "user"]
    content: Content


class AssistantTurn(Strict):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None


class ToolTurn(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: Annotated[str, Field(min_length=1)]


Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                     Field(max_length=MAX_METADATA_PAIRS)]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatTurn], Field(min_length=1)]
    metadata: Metadata | None = None  # informational, as `user`: written to the log, nothing else
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[FunctionTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None


def _param(loc: tuple) -> str:
    """`messages[2].content` from pydantic's location, without its union-branch names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out or any(part in m.model_fields for m in PATH_MODELS) \
                or part in ("name", "description", "schema", "strict", "format", "effort"):
            out += ("." if out else "") + part
        else:
            break
    return out


PATH_MODELS = (ChatTurn, StreamOptions, TextPart, ResponseFormatField, FunctionTool, FunctionDefinition,
               MessageToolCall, CalledFunction)


def _describe(value) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    except RecursionError:  # nested about as deep as the parser goes
        return "a value nested too deep to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _most_telling(errors: list[dict]) -> dict:
    """The first field's error; of a union's branches, one whose type matched (a list of five
    stop strings is too long, not "not a string")."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    return next((e for e in same if not e["type"].endswith("_type")), same[0])


def check_bias_keys(bias: dict) -> None:
    """400 for a `logit_bias` key that is not a token id in decimal (OpenAI's keys), or one too
    long to be in any vocabulary (the engine's limits check the vocabulary itself)."""
    for key in bias:
        if not re.fullmatch(TOKEN_ID_KEY, key):
            raise invalid(f"logit_bias: the keys are token ids written as decimal integers, such as "
                          f"\"50256\" (got {_describe(key)})", "logit_bias")
        if len(key) > _MAX_TOKEN_ID_DIGITS:
            raise APIError(400, f"logit_bias: the token id {key[:24]}... is outside the model's vocabulary",
                           "unknown_token", "logit_bias")


def field_refusal(error: ValidationError) -> APIError:
    """A 400 naming the first bad field of a strict model's validation error."""
    first = _most_telling(error.errors())
    param = _param(first["loc"])
    kind = first["type"]
    code = ("missing_required_parameter" if kind == "missing" else
            "invalid_type" if kind.endswith("_type") or kind.startswith("literal") else "invalid_value")
    shown = "" if kind == "missing" else f" (got {_describe(first.get('input'))})"
    return invalid(f"{param}: {first['msg']}{shown}", param, code)


def validate(model: type[SamplingFields], body: dict) -> SamplingFields:
    """The request model, or a 400 naming the first bad field."""
    body = check_fields(body, model, CHAT_NO_OPS if model is ChatCompletionRequest else COMPLETION_NO_OPS)
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = check_fields(body["stream_options"], StreamOptions, STREAM_OPTIONS_NO_OPS,
                                              "stream_options.")
    if model is ChatCompletionRequest and isinstance(body.get("messages"), list):
        body["messages"] = [check_fields(m, ChatTurn, MESSAGE_NO_OPS, f"messages[{i}].")
                            if isinstance(m, dict) else m for i, m in enumerate(body["messages"])]
    if model is ChatCompletionRequest and isinstance(body.get("tools"), list):
        check_tool_types(body["tools"])
    if isinstance(body.get("logit_bias"), dict):
        check_bias_keys(body["logit_bias"])
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise field_refusal(error) from None
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported: it would need the log-probabilities of the "
                            "prompt's tokens, which this engine does not compute (send one or the other)",
                       "unsupported_parameter", "echo")
    fmt = request.response_format
    if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
        raise invalid("response_format.json_schema goes with type json_schema, and only with it",
                      "response_format.json_schema", "missing_required_parameter" if fmt.type == "json_schema"
                      else "invalid_value")
    if isinstance(request, ChatCompletionRequest):
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        check_turns(request.messages)
    return request


def check_tool_types(tools: list) -> None:
    """400 naming a tool that is not a function tool (OpenAI's `custom` tools, hosted tools)."""
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported by this service; "
                                "only function tools are", "unsupported_parameter", f"tools[{i}].type")


def check_turns(messages: list[ChatTurn]) -> None:
    """Which fields go with which role: calls only on an assistant turn, whose content may then
    be null; a tool turn has a tool_call_id and content; no other turn has either."""
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise invalid(f"messages[{i}]: only an assistant message has tool_calls",
                          f"messages[{i}].tool_calls")
        if (m.tool_call_id is not None) != (m.role == "tool"):
            raise invalid(f"messages[{i}]: a tool message has a tool_call_id, and only a tool message does",
                          f"messages[{i}].tool_call_id",
                          "missing_required_parameter" if m.role == "tool" else "invalid_value")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise invalid(f"messages[{i}]: content is required (null only for an assistant message with "
                          "tool_calls)", f"messages[{i}].content", "missing_required_parameter")
