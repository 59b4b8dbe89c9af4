"""The Harmony format of gpt-oss: messages with roles, channels and recipients, rendered and parsed.

Written by hand, at the level of text. OpenAI's renderer (the ``openai-harmony`` package)
cannot be used here: its encoding loads the ``o200k_base`` vocabulary from tiktoken's cache or
downloads it (``load_harmony_encoding`` fails offline with "error downloading or loading vocab
file"), and no package ships that file. So this module renders and parses the format as
OpenAI publishes it (``docs/format.md`` of github.com/openai/harmony, and the behaviour of its
renderer, ``src/encoding.rs``), and ``tests/test_protocols_harmony.py`` checks it against the
examples of that document and the repository's test data, character for character.

The format. A message is ``<|start|>{header}<|message|>{content}<|end|>``. The header is the
author's role (``system``, ``developer``, ``user``, ``assistant``; a tool's message carries the
tool's name instead, such as ``functions.get_weather``), then `` to={recipient}`` where the
message is addressed (a tool call: ``to=functions.get_weather``), then
``<|channel|>{channel}`` for assistant messages (``analysis`` for the chain of thought,
``commentary`` for tool calls and preambles, ``final`` for the answer), then the content type
(`` <|constrain|>json`` for JSON arguments). An assistant message to a tool ends with
``<|call|>`` instead of ``<|end|>``; the model ends its turn with ``<|return|>``. Both are where
sampling stops. In a prompt, the analysis messages before a final answer are dropped (the
renderer's ``auto_drop_analysis``), except in a turn still calling tools.

Only the format's own structure may hold its special tokens: :func:`message_pieces` marks which
parts of a rendered message are the format's and which are the caller's text, so that a
tokenizer can encode the caller's with special-token matching off (as
:mod:`labkit.protocols.templates` does for Jinja templates).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOPS = (END, CALL, RETURN)  # a message's content ends at any of these
ROLES = ("system", "developer", "user", "assistant", "tool")
CHANNELS = ("analysis", "commentary", "final")
REASONING_EFFORTS = ("low", "medium", "high")


class HarmonyParseError(ValueError):
    """Text that is not Harmony messages."""


@dataclass(frozen=True)
class HarmonyMessage:
    """One message. ``name`` is a tool's name (the author of a ``tool`` message) or a user's;
    ``content_type`` is as rendered after the channel (``"<|constrain|>json"`` or ``"json"``)."""

    role: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    name: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown Harmony role {self.role!r}; expected one of {', '.join(ROLES)}")
        if self.role == "tool" and not self.name:
            raise ValueError("a tool message needs the tool's name (e.g. 'functions.get_weather')")


# --------------------------------------------------------------------------------------------
# System and developer contents
# --------------------------------------------------------------------------------------------


DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def system_content(*, model_identity: str | None = DEFAULT_IDENTITY,
                   knowledge_cutoff: str | None = "2024-06", current_date: str | None = None,
                   reasoning_effort: str | None = "medium", channels: Sequence[str] = CHANNELS,
                   channel_required: bool = True, has_function_tools: bool = False) -> str:
    """The system message's text: identity and dates, reasoning effort, valid channels."""
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
    sections = []
    top = [model_identity] if model_identity else []
    top += [f"Knowledge cutoff: {knowledge_cutoff}"] if knowledge_cutoff else []
    top += [f"Current date: {current_date}"] if current_date else []
    if top:
        sections.append("\n".join(top))
    if reasoning_effort:
        sections.append(f"Reasoning: {reasoning_effort}")
    if channels:
        header = f"# Valid channels: {', '.join(channels)}."
        if channel_required:
            header += " Channel must be included for every message."
        if has_function_tools:
            header += "\nCalls to these tools must go to the commentary channel: 'functions'."
        sections.append(header)
    return "\n\n".join(sections)


def developer_content(instructions: str | None = None, tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """The developer message's text: ``# Instructions`` and the function tools (OpenAI's
    ``{"type": "function", "function": {...}}`` or the inner ``{"name", "description",
    "parameters"}``) as a TypeScript namespace."""
    sections = ["# Instructions", instructions] if instructions is not None else []
    if tools:
        sections.append("# Tools\n\n" + tools_namespace("functions", tools))
    return "\n\n".join(sections)


def tools_namespace(namespace: str, tools: Sequence[Mapping[str, Any]]) -> str:
    lines = [f"## {namespace}\n", f"namespace {namespace} {{\n"]
    for tool in tools:
        function = tool.get("function", tool) if tool.get("type") == "function" else tool
        if not isinstance(function.get("name"), str):
            raise ValueError("a tool needs a string 'name'")
        lines += [f"// {line}" for line in str(function.get("description", "")).splitlines()]
        parameters = function.get("parameters")
        if parameters is None:
            lines.append(f"type {function['name']} = () => any;\n")
        else:
            lines.append(f"type {function['name']} = (_: {typescript_of(parameters, '')}) => any;\n")
    lines.append(f"}} // namespace {namespace}")
    return "\n".join(lines)


def default_comment(schema: Mapping[str, Any]) -> str:
    default = schema["default"]
    if isinstance(default, str):
        return f'default: "{default}"' if not schema.get("enum") else f"default: {default}"
    return "default: " + json.dumps(default, separators=(",", ":"), ensure_ascii=False)


def typescript_of(schema: Mapping[str, Any], indent: str) -> str:
    """A JSON schema as the TypeScript type Harmony's renderer writes (objects, strings and
    their enums, numbers, booleans, arrays, type lists, nullable); ``oneOf`` and ``anyOf``
    are refused rather than rendered differently from it."""
    if "oneOf" in schema or "anyOf" in schema:
        raise ValueError("oneOf / anyOf parameters are not supported by this Harmony renderer")
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join("number" if k == "integer" else k for k in kind if isinstance(k, str)) or "any"
    if kind == "object":
        out = f"{indent}// {schema['description']}\n" if "description" in schema else ""
        out += "{\n"
        required = set(schema.get("required", ()))
        for key, value in schema.get("properties", {}).items():
            if "title" in value:
                out += f"{indent}// {value['title']}\n{indent}//\n"
            if "description" in value:
                out += f"{indent}// {value['description']}\n"
            examples = [e for e in value.get("examples", ()) if isinstance(e, str)]
            if examples:
                out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples)
            type_text = typescript_of(value, indent + "    ")
            if value.get("nullable") and "null" not in type_text:
                type_text += " | null"
            out += f"{indent}{key}{'' if key in required else '?'}: {type_text},"
            out += f" // {default_comment(value)}\n" if "default" in value else "\n"
        return out + f"{indent}}}"
    if kind == "string":
        enum = [f'"{v}"' for v in schema.get("enum", ()) if isinstance(v, str)]
        return " | ".join(enum) if enum else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return typescript_of(schema["items"], indent) + "[]" if "items" in schema else "Array<any>"
    return "any"


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def message_pieces(message: HarmonyMessage, recipient_first: bool = True) -> list[tuple[str, bool]]:
    """The rendered message as (text, is_the_format's_own) pieces: the caller's text (content,
    names, recipients, channels) is never the format's own, so it may not become a special token.

    The recipient goes right after the author, as openai-harmony's renderer now writes it;
    ``recipient_first=False`` puts it after the channel, as its earlier releases (and the
    model, sometimes) did. The parser reads both."""
    author = message.name if message.role == "tool" else message.role
    if message.role != "tool" and message.name:
        author += f":{message.name}"
    pieces = [(START, True), (author, False)]
    addressed = message.recipient and message.recipient != "all"
    recipient = [(f" to={message.recipient}", False)] if addressed else []
    channel = [(CHANNEL, True), (message.channel, False)] if message.channel else []
    pieces += recipient + channel if recipient_first else channel + recipient
    if message.content_type:
        if message.content_type.startswith(CONSTRAIN):
            pieces += [(" ", False), (CONSTRAIN, True), (message.content_type[len(CONSTRAIN):], False)]
        else:
            pieces.append((f" {message.content_type}", False))
    pieces += [(MESSAGE, True), (message.content, False)]
    pieces.append((CALL if message.role == "assistant" and message.recipient else END, True))
    return [(text, own) for text, own in pieces if text]


def render_message(message: HarmonyMessage, recipient_first: bool = True) -> str:
    return "".join(text for text, _ in message_pieces(message, recipient_first))


def kept_for_prompt(messages: Sequence[HarmonyMessage]) -> list[HarmonyMessage]:
    """Drop the analysis messages before the first final answer, when the last assistant
    message is a final answer (a turn still calling tools keeps its chain of thought)."""
    assistant = [m for m in messages if m.role == "assistant"]
    if not assistant or assistant[-1].channel != "final":
        return list(messages)
    first_final = next(i for i, m in enumerate(messages) if m.channel == "final")
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]


def render_conversation(messages: Sequence[HarmonyMessage], next_role: str | None = "assistant",
                        drop_analysis: bool = True, recipient_first: bool = True) -> str:
    """A prompt: the messages, then ``<|start|>{next_role}`` for the model to continue."""
    kept = kept_for_prompt(messages) if drop_analysis else list(messages)
    text = "".join(render_message(m, recipient_first) for m in kept)
    return text + (START + next_role if next_role else "")


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

_STOP = re.compile("|".join(re.escape(s) for s in STOPS))


def parse_header(header: str, role: str | None) -> tuple[str, str | None, str | None, str | None, str | None]:
    """(role, name, channel, recipient, content_type) of a header, as Harmony's parser reads it:
    the channel is the word after <|channel|>; the rest split on whitespace is the role (any
    other first word is a tool's name), then an optional recipient (``to=`` or bare) and an
    optional content type, last."""
    channel = None
    at = header.find(CHANNEL)
    if at >= 0:
        after = header[at + len(CHANNEL):]
        value = re.match(r"[^\s<]*", after).group()
        if not value:
            raise HarmonyParseError(f"a channel marker without a channel in the header {header!r}")
        channel, header = value, header[:at] + after[len(value):]
    header = header.strip().replace(CONSTRAIN, " " + CONSTRAIN).strip()
    parts = header.split()
    name = None
    if role is None:
        if not parts:
            raise HarmonyParseError("a message header without a role")
        first = parts[0]
        if first in ROLES:
            role = first
        elif first.startswith("to="):
            raise HarmonyParseError(f"a message header without an author: {header!r}")
        else:  # a tool's message is headed with the tool's name ("functions.get_weather", "python")
            role, name = "tool", parts.pop(0)
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        count, last = len(parts), parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif count == 1 and not last.startswith(CONSTRAIN):
            recipient = last
        else:
            content_type = last
            if parts:
                raw = parts.pop()
                recipient = raw[3:] if raw.startswith("to=") else raw
    if parts:
        raise HarmonyParseError(f"unexpected words left in the message header: {' '.join(parts)!r}")
    return role, name, channel, recipient, content_type


def parse_messages(text: str, role: str | None = None) -> list[HarmonyMessage]:
    """The messages in ``text``. With ``role`` (a completion after ``<|start|>{role}``), the
    text begins inside the first message's header; without it, it begins with ``<|start|>``.
    A message's content runs to <|end|>, <|call|> or <|return|>, or to the end of the text (a
    reply cut short); a header not closed by <|message|> is an error."""
    messages, at = [], 0
    expect_start = role is None
    while at < len(text):
        if expect_start:
            if not text.startswith(START, at):
                raise HarmonyParseError(f"expected {START} at {at}, found {text[at:at + 20]!r}")
            at += len(START)
        body = text.find(MESSAGE, at)
        if body < 0:
            raise HarmonyParseError(f"a message header not closed by {MESSAGE}: {text[at:at + 60]!r}")
        author, name, channel, recipient, content_type = parse_header(text[at:body], role)
        stop = _STOP.search(text, body + len(MESSAGE))
        end = stop.start() if stop else len(text)
        messages.append(HarmonyMessage(author, text[body + len(MESSAGE):end], channel, recipient,
                                       content_type, name))
        at = stop.end() if stop else len(text)
        role, expect_start = None, True
    return messages


@dataclass(frozen=True)
class HarmonyReply:
    """What an assistant turn said, as an API returns it: reasoning (the analysis channel),
    the final text, and the tool calls (commentary messages to ``functions.*``)."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[tuple[str, str], ...]  # (function name, arguments as written)
    preambles: tuple[str, ...] = ()  # commentary to the user before tool calls


def reply_of(messages: Iterable[HarmonyMessage]) -> HarmonyReply:
    reasoning, final, calls, preambles = [], [], [], []
    for m in messages:
        if m.role != "assistant":
            raise HarmonyParseError(f"a reply holds only assistant messages, not {m.role!r}")
        if m.recipient and m.recipient.startswith("functions."):
            calls.append((m.recipient[len("functions."):], m.content))
        elif m.channel == "analysis":
            reasoning.append(m.content)
        elif m.channel == "final":
            final.append(m.content)
        elif m.channel == "commentary":
            preambles.append(m.content)
        else:
            raise HarmonyParseError(f"an assistant message on no known channel: {m.channel!r}")
    return HarmonyReply("\n".join(reasoning) if reasoning else None, "".join(final) if final else None,
                        tuple(calls), tuple(preambles))

