"""What an Anthropic Messages request may say (text, structured outputs, client tools), checked
before any work.

    POST /v1/messages               model, max_tokens, messages, system?, stop_sequences?,
                                    temperature?, top_p?, top_k?, metadata.user_id?, stream?,
                                    output_config.format?
    POST /v1/messages/count_tokens  model, messages, system?, output_config.format?

`messages[i].content` is a string or a list of text blocks; `system` is a string or a list of
text blocks; a text block may carry `cache_control: {"type": "ephemeral", "ttl"?: "5m"|"1h"}`
(a cache breakpoint, see labkit/serve/README.md); a top-level `cache_control` puts one after
the last block. `output_config.format` is Anthropic's structured output, `{"type": "json_schema",
"schema": {...}}` (`output_config.effort` is taken only as null: the served models have no
effort setting). The fields and blocks of Anthropic's API
that this service does not implement yet (tools, images, documents, thinking, ...) get a 400
that says so; a field Anthropic does not have either gets a 400 naming it; the models are
strict, as the OpenAI routes' are (`labkit.serve.protocol`).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, ValidationError

from labkit.serve.errors import APIError, invalid
from labkit.serve.protocol import Strict, field_refusal

# Anthropic's request fields, and content block types, that this service does not implement yet
NOT_YET_FIELDS = ("thinking", "service_tier", "container", "mcp_servers",
                  "context_management", "inference_geo", "speed", "diagnostics", "user_profile_id",
                  "workspace_id")
# the structured-outputs beta's names of fields this service takes under their current name
RENAMED_FIELDS = {"output_format": "output_config.format"}
NOT_YET_BLOCKS = ("image", "document", "search_result", "server_tool_use",
                  "web_search_tool_result", "thinking", "redacted_thinking", "container_upload")
MAX_STOP_SEQUENCES = 16


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    """A call an assistant turn made (sent back as history)."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1)]
    input: dict


class ToolResultBlock(Strict):
    """A tool's output for an earlier `tool_use` (`tool_use_id`), in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: Union[str, list[TextBlock], None] = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(b.text for b in self.content)


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]
BLOCK_MODELS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[ContentBlock], Field(min_length=1)]]

    @property
    def text(self) -> str:
        """The text blocks' text joined as the chat route joins content parts (with newlines)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def has_tool_blocks(self) -> bool:
        return not isinstance(self.content, str) and any(not isinstance(b, TextBlock) for b in self.content)


class ToolDefinition(Strict):
    """A client tool: its name, what it does, and a JSON Schema (an object schema) for its
    input. `strict` is taken: labkit checks every call's input against the schema anyway."""

    name: str
    input_schema: dict
    description: str | None = None
    strict: bool | None = None
    type: Literal["custom"] | None = None


class ToolChoiceField(Strict):
    """auto (the model decides), any (at least one call), tool (exactly one call of `name`),
    none (no tools); `disable_parallel_tool_use`: at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(Strict):
    """Anthropic's `output_config.format`: the answer's text is JSON valid against `schema`."""

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutputFormat | None = None
    effort: None = None   # Anthropic's effort levels: the served models have no such setting


OUTPUT_FORMAT_FIELDS = ("type", "schema")


class Metadata(Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class CountTokensRequest(Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    cache_control: CacheControl | None = None   # a breakpoint after the last block (automatic caching)
    output_config: OutputConfig | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceField | None = None

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system) if self.system else None  # []: no system prompt


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]],
                              Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = None


def check_names(body: dict, allowed, where: str = "") -> None:
    """400 for a field this service does not implement yet, or one Anthropic does not have."""
    for key in body:
        name = f"{where}{key}"
        if key in allowed:
            continue
        if not where and key in RENAMED_FIELDS:
            raise APIError(400, f"{name} is the beta's name: send {RENAMED_FIELDS[key]}",
                           "unsupported_parameter", name)
        if not where and key in NOT_YET_FIELDS:
            raise APIError(400, f"{name} is not supported by this service yet", "unsupported_parameter", name)
        raise APIError(400, f"unknown parameter {name}", "unknown_parameter", name)


def check_blocks(blocks, where: str) -> None:
    if not isinstance(blocks, list):
        return
    for j, block in enumerate(blocks):
        if isinstance(block, dict):
            kind = block.get("type")
            if kind in NOT_YET_BLOCKS:
                raise APIError(400, f"{where}[{j}]: {kind} blocks are not supported by this service yet "
                                    "(text blocks only)", "unsupported_content", f"{where}[{j}].type")
            model = BLOCK_MODELS.get(kind, TextBlock)
            if model is not TextBlock and "cache_control" in block:
                raise APIError(400, f"{where}[{j}].cache_control: breakpoints on tool blocks are not "
                                    "supported by this service yet (text blocks only)",
                               "unsupported_parameter", f"{where}[{j}].cache_control")
            check_names(block, model.model_fields, f"{where}[{j}].")
            if isinstance(block.get("cache_control"), dict):
                check_names(block["cache_control"], CacheControl.model_fields, f"{where}[{j}].cache_control.")


def check_tool_fields(body: dict) -> None:
    """400 naming a tool's or tool choice's field this service does not take: server tools
    (Anthropic's hosted ones, with a dated `type`) and the beta's extras."""
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: {kind} tools are Anthropic's server tools, which this service "
                                "does not have (client tools only)", "unsupported_parameter",
                           f"tools[{i}].type")
        if "cache_control" in tool:
            raise APIError(400, f"tools[{i}].cache_control: breakpoints on tools are not supported by this "
                                "service yet (text blocks only)", "unsupported_parameter",
                           f"tools[{i}].cache_control")
        check_names(tool, ToolDefinition.model_fields, f"tools[{i}].")
    if isinstance(body.get("tool_choice"), dict):
        check_names(body["tool_choice"], ToolChoiceField.model_fields, "tool_choice.")


def check_output_config(config) -> None:
    """400 naming a field of `output_config` that is not Anthropic's, or that asks for what
    this service does not do (an effort level)."""
    if not isinstance(config, dict):
        return
    check_names(config, OutputConfig.model_fields, "output_config.")
    if config.get("effort") is not None:
        raise APIError(400, "output_config.effort is not supported by this service: its models have no "
                            "effort setting (null is taken)", "unsupported_parameter", "output_config.effort")
    if isinstance(config.get("format"), dict):
        check_names(config["format"], OUTPUT_FORMAT_FIELDS, "output_config.format.")


def parse(model: type[CountTokensRequest], body: dict) -> CountTokensRequest:
    """The request model, or a 400 in which the first wrong or unsupported field is named."""
    check_names(body, model.model_fields)
    check_blocks(body.get("system"), "system")
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict):
            check_names(message, Message.model_fields, f"messages[{i}].")
            check_blocks(message.get("content"), f"messages[{i}].content")
    for name, fields in (("metadata", Metadata.model_fields), ("cache_control", CacheControl.model_fields)):
        if isinstance(body.get(name), dict):
            check_names(body[name], fields, f"{name}.")
    check_output_config(body.get("output_config"))
    check_tool_fields(body)
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise field_refusal(error) from None
    for i, message in enumerate(request.messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(block, ToolUseBlock) and message.role != "assistant" or \
                    isinstance(block, ToolResultBlock) and message.role != "user":
                raise invalid(f"messages[{i}].content[{j}]: a {block.type} block belongs in "
                              f"{'an assistant' if block.type == 'tool_use' else 'a user'} message",
                              f"messages[{i}].content[{j}].type")
    choice = request.tool_choice
    if choice is not None and (choice.type == "tool") != (choice.name is not None):
        raise invalid("tool_choice.name goes with type tool, and only with it", "tool_choice.name")
    if request.messages[-1].role != "user":
        raise invalid("the last message must be a user message: continuing an assistant message (prefill) "
                      "is not supported by this service yet", f"messages[{len(request.messages) - 1}].role")
    return request
