"""A generated reply back into a message: the end marker cut off, reasoning and tool calls split out.

What a model writes after the generation prompt is the text of one assistant turn, in the
format its chat template taught it, ending with the template's end-of-turn marker. Reading it
back is the template run backwards:

* the turn ends at the first end marker (``<|im_end|>`` for ChatML models such as SmolLM2,
  ``<end_of_turn>`` for Gemma 3; each model's EOS too); what follows it is not part of the
  turn, and a reply without one was cut short (by ``max_tokens`` or a stop string);
* a reasoning block (``<think>...</think>`` in the Qwen 3 / DeepSeek R1 format) is the
  message's ``reasoning_content``, not its text;
* a tool call in the Hermes format, which Qwen 2.5 / Qwen 3 and many fine-tunes use, is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; any number of them, with the
  whitespace before each one dropped. SmolLM2 and Gemma 3 270M were not trained with tool
  calls, so their formats have none; the Hermes format is here for the tool-calling service.

The content and the reasoning are stripped of surrounding whitespace, as transformers'
parser does (a template may add a newline after a tag; Gemma's trims every message anyway).

A tool call that is not JSON, not an object with a string ``name`` and an object of
``arguments``, or not closed is a :class:`ReplyParseError` (a ValueError) when ``strict``;
otherwise its raw text stays in the content and is listed in ``unparsed``, never dropped and
never guessed at. ``tests/test_protocols_replies.py`` holds the parser to transformers'
``parse_response`` with its response template for the Qwen family.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from labkit.protocols.tool_use import BodyScanner


class ReplyParseError(ValueError):
    """The reply claims a structure (a tool call) that it does not have."""


@dataclass(frozen=True)
class ReplyFormat:
    """How a model's assistant turn is written: its end markers, and the tags of its tool
    calls and reasoning where it has them."""

    name: str
    end_markers: tuple[str, ...]
    tool_call_tags: tuple[str, str] | None = None
    reasoning_tags: tuple[str, str] | None = None


CHATML = ReplyFormat("chatml", ("<|im_end|>", "<|endoftext|>"))
GEMMA3 = ReplyFormat("gemma3", ("<end_of_turn>", "<eos>"))
HERMES = ReplyFormat("hermes", ("<|im_end|>", "<|endoftext|>"), ("<tool_call>", "</tool_call>"),
                     ("<think>", "</think>"))


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (as OpenAI's API sends them)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedReply:
    """The assistant message a reply holds."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    finished: bool = False  # an end marker closed the turn
    unparsed: tuple[str, ...] = field(default_factory=tuple)  # tool-call blocks kept as text

    def message(self) -> dict[str, Any]:
        """The OpenAI chat message: content None when the reply is only tool calls."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.content if self.content or not self.tool_calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        return message


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def cut_at_end_marker(text: str, markers: tuple[str, ...]) -> tuple[str, bool]:
    """The turn's text before its first end marker (trailing whitespace off), and whether one came."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if not found:
        return text, False
    return text[:min(found)].rstrip(), True


def split_reasoning(text: str, tags: tuple[str, str] | None) -> tuple[str, str | None]:
    """(text without the reasoning block, the block's text); an unclosed block runs to the end."""
    if tags is None:
        return text, None
    start = text.find(tags[0])
    if start < 0:
        return text, None
    inside = start + len(tags[0])
    end = text.find(tags[1], inside)
    if end < 0:
        return text[:start], text[inside:]
    return text[:start] + text[end + len(tags[1]):], text[inside:end]


def tool_call_of(body: str, make_id: Callable[[], str]) -> ToolCall:
    """The call a tool-call block's JSON describes, or ReplyParseError saying what is wrong."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        raise ReplyParseError(
            f"a tool call is not JSON ({error.msg} at {error.pos}): {body[:80]!r}") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ReplyParseError(f"a tool call must be an object with a string 'name': {body[:80]!r}")
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ReplyParseError(f"a tool call's 'arguments' must be an object: {body[:80]!r}")
    return ToolCall(make_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_reply(text: str, reply_format: ReplyFormat, *, strict: bool = True,
                make_id: Callable[[], str] = new_call_id) -> ParsedReply:
    """The message a generated reply's text holds (decode it with special tokens kept, so
    that the end marker is there to be seen)."""
    body, finished = cut_at_end_marker(text, reply_format.end_markers)
    body, reasoning = split_reasoning(body, reply_format.reasoning_tags)
    reasoning = None if reasoning is None else reasoning.strip()
    if reply_format.tool_call_tags is None:
        return ParsedReply(body.strip(), (), reasoning, finished)
    open_tag, close_tag = reply_format.tool_call_tags
    pieces, calls, unparsed, at = [], [], [], 0
    while (start := body.find(open_tag, at)) >= 0:
        # the closing tag counts only outside the call's JSON strings, as the service reads it
        end = BodyScanner(close_tag).end(body[start + len(open_tag):])
        end = end if end < 0 else end + start + len(open_tag)
        block = body[start:] if end < 0 else body[start:end + len(close_tag)]
        try:
            if end < 0:
                raise ReplyParseError(f"a tool call is not closed with {close_tag}: {block[:80]!r}")
            call = tool_call_of(body[start + len(open_tag):end].strip(), make_id)
        except ReplyParseError:
            if strict:
                raise
            pieces.append(body[at:start] + block)
            unparsed.append(block)
        else:
            pieces.append(body[at:start].rstrip())
            calls.append(call)
        at = start + len(block)
    pieces.append(body[at:])
    return ParsedReply("".join(pieces).strip(), tuple(calls), reasoning, finished, tuple(unparsed))


def parse_reply_ids(ids: list[int], tokenizer, reply_format: ReplyFormat, **options: Any) -> ParsedReply:
    """The same from generated token ids, decoded with special tokens kept."""
    return parse_reply(tokenizer.decode(ids, skip_special_tokens=False), reply_format, **options)


def reply_format_for(chat_template: str | None) -> ReplyFormat:
    """The reply format a chat template writes turns in (ValueError for one not known here)."""
    template = chat_template or ""
    if "<start_of_turn>" in template:
        return GEMMA3
    if "<|im_start|>" in template:
        return HERMES if "<tool_call>" in template else CHATML
    raise ValueError("no reply format known for this chat template")
