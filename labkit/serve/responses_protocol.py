"""What a Responses API request (`POST /v1/responses`) may say, checked before any work.

The subset a local, stateless server serves: `input` as a string or a list of items,
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` (plain
text, `json_object` or `json_schema`: structured outputs, as chat's `response_format`),
function `tools`, `tool_choice`, `parallel_tool_calls`, informational `metadata` and `user`,
and labkit's own sampling and admission fields. The body's bytes are read by
`labkit.serve.protocol.parse_json_body`; the field rules are the chat route's: unknown fields
get 400 `unknown_parameter`; OpenAI's fields this service does not implement are taken only at
a value that asks for nothing (`RESPONSES_NO_OPS`) and refused otherwise with 400
`unsupported_parameter` and a reason (this server keeps no state and has no hosted tools);
the models are strict (`"5"` is not a token count).

Input items are read by their `type`: `message` (the default, as OpenAI's "easy" messages have
none), `function_call` and `function_call_output` (rendered by the tool-calling core:
`labkit.serve.responses_tools`). Every other item type (`item_reference`, `reasoning`, hosted
tools' calls) is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, ValidationError

from labkit.serve.errors import APIError, invalid
from labkit.serve.openai_fields import ONLY_NULL, asks_for_nothing, describe_no_ops
from labkit.serve.protocol import Metadata, Strict, check_fields

# -- what asks for nothing, and why the rest is refused -----------------------------------------

NO_STATE = "this server keeps no state: send the whole conversation in `input`"
NOT_YET = "not supported yet by this server"

# field: (values taken besides null, the reason any other value is refused)
RESPONSES_NO_OPS: dict[str, tuple[tuple, str]] = {
    "store": ((False,), NO_STATE + " (store defaults to false here, not to OpenAI's true)"),
    "previous_response_id": (ONLY_NULL, NO_STATE),
    "conversation": (ONLY_NULL, NO_STATE),
    "background": ((False,), NO_STATE + "; background responses are stored to be polled"),
    "prompt": (ONLY_NULL, NO_STATE + "; stored prompt templates do not exist here"),
    "include": (([],), "this server adds no extra output data (sources, logprobs, encrypted reasoning)"),
    "max_tool_calls": (ONLY_NULL, "no hosted tools run here (a reply's function calls all come back)"),
    "reasoning": (ONLY_NULL, "the served models have no reasoning settings"),
    "service_tier": (("auto", "default"), "this server has one tier, the default"),
    "truncation": (("disabled",), "input is never truncated: a conversation beyond the context gets 400"),
    "top_logprobs": ((0,), "logprobs are " + NOT_YET + " on this route"),
    "safety_identifier": (ONLY_NULL, NOT_YET),
    "prompt_cache_key": (ONLY_NULL, "the prefix cache is keyed by the prompt itself (see `cache_salt`)"),
    "prompt_cache_retention": (ONLY_NULL, "the prefix cache keeps blocks while the pool has room"),
    "prompt_cache_options": (ONLY_NULL, "the prefix cache keeps blocks while the pool has room"),
    "moderation": (ONLY_NULL, NOT_YET),
    "context_management": (ONLY_NULL, NOT_YET),
}
TEXT_NO_OPS: dict[str, tuple[tuple, str]] = {
    "verbosity": (("medium",), "the served models have no verbosity setting")}
STREAM_OPTIONS_NO_OPS: dict[str, tuple[tuple, str]] = {
    "include_obfuscation": ((False,), "labkit's events carry no obfuscation field")}


def refuse_what_asks_for_something(body: dict, no_ops: dict[str, tuple[tuple, str]], where: str = "") -> dict:
    """The body without the unimplemented fields sent at a value that asks for nothing;
    400 `unsupported_parameter` with the field's reason for any other value, 400
    `unknown_parameter` for a field OpenAI does not have either (`check_fields`)."""
    for key, value in body.items():
        if key in no_ops:
            taken, reason = no_ops[key]
            if not asks_for_nothing(value, taken):
                raise APIError(400, f"{where}{key}: {reason} (taken: {describe_no_ops(taken)})",
                               "unsupported_parameter", f"{where}{key}")
    taken_values = {key: taken for key, (taken, _) in no_ops.items()}
    return check_fields(body, RESPONSE_MODELS[where], taken_values, where)


# -- the items ---------------------------------------------------------------------------------

class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier answer's text, sent back as history: its annotations and logprobs are taken
    as they came (the SDK sends them) and do not change the prompt."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict] | None = None
    logprobs: list[dict] | None = None


ContentPart = Annotated[Union[InputText, OutputText], Field(discriminator="type")]
UNSUPPORTED_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio",
                     "refusal": "refusal parts"}


class MessageItem(Strict):
    """OpenAI's EasyInputMessage, InputMessage and (sent back) OutputMessage, in one model."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, Annotated[list[ContentPart], Field(min_length=1)]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    """A tool call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=64)]
    output: Union[str, list[InputText]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]
ITEM_MODELS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                           "function_call_output": FunctionCallOutputItem}
# OpenAI's other input item types: refused by name (any other type is not OpenAI's either)
OTHER_ITEM_TYPES = ("item_reference", "reasoning", "compaction", "file_search_call", "computer_call",
                    "computer_call_output", "web_search_call", "image_generation_call",
                    "code_interpreter_call",
                    "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
                    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
                    "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output",
                    "tool_search_call", "tool_search_output", "additional_tools", "program", "program_output")


# -- the request -------------------------------------------------------------------------------

class TextFormatText(Strict):
    """Plain text: no constraint (the default)."""

    type: Literal["text"]


class TextFormatJsonObject(Strict):
    """Any JSON object."""

    type: Literal["json_object"]


class TextFormatJsonSchema(Strict):
    """JSON valid against `schema`; `name` as OpenAI's (letters, digits, '_' and '-', at most
    64); with `strict` the schema must follow OpenAI's strict rules."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema],
                       Field(discriminator="type")]
TEXT_FORMATS: dict[str, type[BaseModel]] = {"text": TextFormatText, "json_object": TextFormatJsonObject,
                                            "json_schema": TextFormatJsonSchema}


class ResponseText(Strict):
    format: TextFormat | None = None


class FunctionTool(Strict):
    """A function the model may call (OpenAI's FunctionTool); `strict` is taken: labkit checks
    every call's arguments against `parameters` either way."""

    type: Literal["function"]
    name: str
    parameters: dict | None = None
    description: str | None = None
    strict: bool | None = None


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    name: str


class ResponsesStreamOptions(Strict):
    pass


class ResponsesRequest(Strict):
    model: str
    input: Union[str, Annotated[list, Field(min_length=1)]]   # items: read by `parse_item`
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: Metadata | None = None           # informational, as chat's: written to the log
    user: Annotated[str, Field(max_length=256)] | None = None
    text: ResponseText | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    # labkit's own, as on the chat route
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    deadline_ms: Annotated[float, Field(gt=0, le=1e7)] | None = None


RESPONSE_MODELS: dict[str, type[BaseModel]] = {"": ResponsesRequest, "text.": ResponseText,
                                               "stream_options.": ResponsesStreamOptions}


@dataclass(frozen=True)
class ParsedResponsesRequest:
    """The checked request and its items (a string `input` is one user message)."""

    fields: ResponsesRequest
    items: list[InputItem]

    @property
    def uses_tools(self) -> bool:
        return bool(self.fields.tools) or any(not isinstance(item, MessageItem) for item in self.items)


# -- errors in the chat route's words ------------------------------------------------------------

KNOWN_FIELDS = set().union(*(m.model_fields for m in (ResponsesRequest, MessageItem, InputText, OutputText,
                                                       FunctionCallItem, FunctionCallOutputItem, ResponseText,
                                                       FunctionTool, *TEXT_FORMATS.values())), {"schema"})


def param_of(loc: tuple, where: str = "") -> str:
    """`input[2].content[0].text` from pydantic's location, without its union-branch names."""
    out = where
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in KNOWN_FIELDS:
            out += ("." if out else "") + part
    return out


def shown(value) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    except RecursionError:
        return "a value nested too deep to show"
    return text if len(text) <= 60 else text[:57] + "..."


def model_or_400(model: type[BaseModel], value, where: str = ""):
    try:
        return model.model_validate(value)
    except ValidationError as error:
        errors = error.errors()
        field = errors[0]["loc"][:1]
        same = [e for e in errors if e["loc"][:1] == field]
        first = next((e for e in same if not e["type"].endswith("_type")), same[0])
        kind = first["type"]
        code = ("missing_required_parameter" if kind == "missing" else
                "invalid_type" if kind.endswith("_type") or kind.startswith("literal") else "invalid_value")
        param = param_of(first["loc"], where)
        if kind == "extra_forbidden":
            param = f"{param_of(first['loc'][:-1], where)}.{first['loc'][-1]}".lstrip(".")
            raise APIError(400, f"unknown parameter {param}", "unknown_parameter", param) from None
        got = "" if kind == "missing" else f" (got {shown(first.get('input'))})"
        raise invalid(f"{param}: {first['msg']}{got}", param, code) from None


# -- parsing -----------------------------------------------------------------------------------

def parse_item(item, where: str) -> InputItem:
    if not isinstance(item, dict):
        raise invalid(f"{where}: an input item is an object (got {shown(item)})", where, "invalid_type")
    kind = item.get("type")
    kind = "message" if kind is None else kind  # OpenAI's "easy" messages have no type
    if kind in OTHER_ITEM_TYPES:
        raise APIError(400, f"{where}.type: {kind} items are not supported by this server (it keeps no state "
                            "and has no hosted tools)", "unsupported_parameter", f"{where}.type")
    if kind not in ITEM_MODELS:
        raise invalid(f"{where}.type: unknown input item type {shown(kind)}", f"{where}.type")
    if kind == "message" and isinstance(item.get("content"), list):
        for j, part in enumerate(item["content"]):
            if isinstance(part, dict) and part.get("type") in UNSUPPORTED_PARTS:
                what = UNSUPPORTED_PARTS[part["type"]]
                raise APIError(400, f"{where}.content[{j}]: {what} are not supported by this server (its "
                                    "models read text)", "unsupported_parameter",
                               f"{where}.content[{j}].type")
    parsed = model_or_400(ITEM_MODELS[kind], item, where)
    if isinstance(parsed, MessageItem) and not isinstance(parsed.content, str):
        for j, part in enumerate(parsed.content):
            if isinstance(part, OutputText) and parsed.role != "assistant":
                raise invalid(f"{where}.content[{j}]: output_text is an assistant's text; a {parsed.role} "
                              "message holds input_text", f"{where}.content[{j}].type")
    return parsed


def check_text_format(body: dict) -> None:
    """`text.format` read by its `type` (as input items are), so that a wrong one gets 400
    naming its own field rather than the union's."""
    text = body.get("text")
    sent = text.get("format") if isinstance(text, dict) else None
    if not isinstance(sent, dict):
        return
    kind = sent.get("type")
    if kind not in TEXT_FORMATS:
        raise invalid(f"text.format.type: must be one of {sorted(TEXT_FORMATS)} (got {shown(kind)})",
                      "text.format.type", "missing_required_parameter" if kind is None else "invalid_type")
    model = TEXT_FORMATS[kind]
    unknown = [key for key in sent if key not in {f.alias or name for name, f in model.model_fields.items()}]
    if unknown:  # first, as a misplaced field (chat's nested json_schema) is the likelier mistake
        raise APIError(400, f"unknown parameter text.format.{unknown[0]} (in a {kind} format)",
                       "unknown_parameter", f"text.format.{unknown[0]}")
    model_or_400(model, sent, "text.format")


def check_tools_field(body: dict) -> None:
    """400 naming a tool that is not a function tool (OpenAI's hosted tools do not exist here),
    and a tool choice that is not one of function tools'."""
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise APIError(400, f"tools[{i}].type: {kind} tools do not exist on this server (function tools "
                                "only)", "unsupported_parameter", f"tools[{i}].type")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        raise APIError(400, f"tool_choice.type: {shown(choice.get('type'))} is not supported here (\"none\", "
                            "\"auto\", \"required\" or {\"type\": \"function\", \"name\": ...})",
                       "unsupported_parameter", "tool_choice.type")


def parse_request(body: dict) -> ParsedResponsesRequest:
    """The checked request, or a 400 naming the first field it cannot take."""
    body = refuse_what_asks_for_something(body, RESPONSES_NO_OPS)
    check_tools_field(body)
    for name, no_ops in (("text", TEXT_NO_OPS), ("stream_options", STREAM_OPTIONS_NO_OPS)):
        if isinstance(body.get(name), dict):
            body[name] = refuse_what_asks_for_something(body[name], no_ops, f"{name}.")
    check_text_format(body)
    fields = model_or_400(ResponsesRequest, body)
    if fields.stream_options is not None and not fields.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(fields.input, str):
        items: list[InputItem] = [MessageItem(role="user", content=fields.input)]
    else:
        items = [parse_item(item, f"input[{i}]") for i, item in enumerate(fields.input)]
    return ParsedResponsesRequest(fields, items)


# -- the conversation --------------------------------------------------------------------------

def messages_of(request: ParsedResponsesRequest) -> list[dict]:
    """The chat-template conversation of a request without tools or tool items (those go
    through the tool-calling core: `labkit.serve.responses_tools`): `instructions` as the
    system message, then the items, `developer` read as `system` (as the chat route reads it)."""
    messages = []
    if request.fields.instructions is not None:
        messages.append({"role": "system", "content": request.fields.instructions})
    for item in request.items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
    return messages
