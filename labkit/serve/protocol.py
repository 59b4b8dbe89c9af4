"""What a request may say: the body's bytes, then its fields, checked before any work.

    bytes --parse_json_body--> dict --check_fields--> dict --pydantic (strict)--> request model

`parse_json_body` refuses a wrong content type (415), a body over the limit (413), invalid
UTF-8, text that is not JSON (NaN and Infinity are not JSON), duplicate keys and anything but
an object (400). `check_fields` names the first field we do not take: one of OpenAI's that this
service does not support (`unsupported_parameter`), or one OpenAI does not have either
(`unknown_parameter`). The models are strict: `"5"`, `5.0` and `true` are not token counts,
NaN is not a temperature. A field sent as null means "not given", as in OpenAI's API; the
defaults are OpenAI's and are listed in `labkit/serve/README.md`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labkit.serve.errors import APIError, invalid

MAX_STOP_STRINGS = 4          # OpenAI's limit
MAX_N = 16

# Fields OpenAI documents that this service refuses (a null value counts as not given).
UNSUPPORTED_COMPLETION = {"best_of", "echo", "logit_bias", "suffix"}
UNSUPPORTED_CHAT = {"audio", "function_call", "functions", "logit_bias", "metadata", "modalities",
                    "parallel_tool_calls", "prediction", "prompt_cache_key", "prompt_cache_retention",
                    "reasoning_effort", "response_format", "safety_identifier", "service_tier", "store",
                    "tool_choice", "tools", "verbosity", "web_search_options"}
UNSUPPORTED_MESSAGE = {"name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call"}
UNSUPPORTED_STREAM_OPTIONS = {"include_obfuscation"}


# -- the body --------------------------------------------------------------------------------

def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


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
        body = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as error:
        raise invalid(f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def check_fields(body: dict, model: type[BaseModel], unsupported: set[str], where: str = "") -> dict:
    """The body without unsupported fields sent as null; APIError for any other field the
    model does not have."""
    kept = {}
    for key, value in body.items():
        name = f"{where}{key}"
        if key in model.model_fields:
            kept[key] = value
        elif key not in unsupported:
            raise APIError(400, f"unknown parameter {name}", "unknown_parameter", name)
        elif value is not None:
            raise APIError(400, f"{name} is not supported by this service", "unsupported_parameter", name)
    return kept


# -- the fields ------------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool | None = None


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
    deadline_ms: Annotated[float, Field(gt=0, le=1e7)] | None = None  # ours: admission control
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Union[str, TokenIds, Annotated[list[str], Field(min_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, Annotated[list[TextPart], Field(min_length=1)]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


def _param(loc: tuple) -> str:
    """`messages[2].content` from pydantic's location, without its union-branch names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out or part in ChatMessage.model_fields or part in StreamOptions.model_fields \
                or part in TextPart.model_fields:
            out += ("." if out else "") + part
        else:
            break
    return out


def _describe(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _most_telling(errors: list[dict]) -> dict:
    """The first field's error; of a union's branches, one whose type matched (a list of five
    stop strings is too long, not "not a string")."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    return next((e for e in same if not e["type"].endswith("_type")), same[0])


def validate(model: type[SamplingFields], body: dict) -> SamplingFields:
    """The request model, or a 400 naming the first bad field."""
    body = check_fields(body, model, UNSUPPORTED_CHAT if model is ChatCompletionRequest else UNSUPPORTED_COMPLETION)
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = check_fields(body["stream_options"], StreamOptions, UNSUPPORTED_STREAM_OPTIONS,
                                              "stream_options.")
    if model is ChatCompletionRequest and isinstance(body.get("messages"), list):
        body["messages"] = [check_fields(m, ChatMessage, UNSUPPORTED_MESSAGE, f"messages[{i}].")
                            if isinstance(m, dict) else m for i, m in enumerate(body["messages"])]
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        first = _most_telling(error.errors())
        param = _param(first["loc"])
        kind = first["type"]
        code = ("missing_required_parameter" if kind == "missing" else
                "invalid_type" if kind.endswith("_type") or kind.startswith("literal") else "invalid_value")
        shown = "" if kind == "missing" else f" (got {_describe(first.get('input'))})"
        raise invalid(f"{param}: {first['msg']}{shown}", param, code) from None
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(request, ChatCompletionRequest):
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    return request
