"""Replies back into messages: end markers, reasoning and Hermes tool calls, held to
transformers' parse_response with its response template for the Qwen family (the same
Hermes format), and a real SmolLM2 turn rendered by its template read back."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.models.registry import fetch
from labkit.protocols.replies import (
    CHATML, GEMMA3, HERMES, ParsedReply, ReplyParseError, parse_reply, parse_reply_ids, reply_format_for,
)
from labkit.protocols.templates import encode_conversation, published_template
from labkit.tokenizer import Tokenizer

PROMPT = "<|im_start|>assistant\n"


def counter_ids():
    count = iter(range(1000))
    return lambda: f"call_{next(count)}"


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf(fetch("smollm2-135m"))


@pytest.fixture(scope="module")
def hf_parse(smol):
    """transformers' parse_response with its own response template for Qwen 2/3 (Hermes tool
    calls, <think> reasoning, ChatML end markers)."""
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except ImportError:
        pytest.skip("this transformers has no response templates")
    schema = next(spec for models, spec in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in models)
    path = fetch("smollm2-135m")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return lambda text: hf.parse_response(text, schema=schema, prefix=PROMPT)


def comparable(parsed: ParsedReply) -> dict:
    """Our message in the shape transformers' parser gives: no ids, arguments as objects, no
    empty content."""
    message = {"role": "assistant"}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.content:
        message["content"] = parsed.content
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
            for c in parsed.tool_calls]
    return message


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
REPLIES = [
    "Hello there!<|im_end|>",
    "Hello there!",
    "  two lines\nof text  <|im_end|>\n<|endoftext|>",
    f"{CALL}<|im_end|>",
    f"Let me check.\n{CALL}\n{CALL}<|im_end|>",
    "<think>The user wants weather.</think>" + CALL + "<|im_end|>",
    "<think>\nshort thought\n</think>\n\nThe answer is 4.<|im_end|>",
    '<tool_call>{"name": "no_args", "arguments": {}}</tool_call><|endoftext|>',
    '<tool_call>{"name": "nested", "arguments": {"q": {"a": [1, 2, {"b": null}]}, "s": "東京 <x>"}}'
    '</tool_call>',
]


@pytest.mark.slow
@pytest.mark.parametrize("text", REPLIES)
def test_hermes_parse_matches_transformers(hf_parse, text):
    assert comparable(parse_reply(text, HERMES)) == hf_parse(text)


PIECES = ["Hi", " ", "\n", "ok.", "東京", CALL, "<think>why</think>", "<|im_end|>",
          '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>']


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8))
def test_hermes_parse_matches_transformers_on_any_arrangement(hf_parse, pieces):
    text = "".join(pieces)
    if text.count("<think>") > 1 or text.strip() == "" or re.fullmatch(r"\s*<\|im_end\|>.*", text, re.S):
        return  # one reasoning block per turn; an empty turn is not a reply
    if "<think>" in text and "<tool_call>" in text.split("<think>")[0]:
        return  # reasoning comes first in this format
    turn, _, after = text.partition("<|im_end|>")
    if after:
        return  # transformers reads on past the end of the turn (where even a blank stretch
        # overwrites the content); the turn ends at its marker (test_the_turn_ends_at_...)
    ours, theirs = parse_reply(text, HERMES), hf_parse(text)
    stretches = re.split(r"<tool_call>.*?</tool_call>|<think>.*?</think>", turn, flags=re.S)
    regions = [r for r in stretches if r.strip()]
    if "<|im_end|>" not in text and stretches[-1] and not stretches[-1].strip() and regions:
        # transformers: a blank stretch after the last call, with no end marker, overwrites the content
        assert "content" not in theirs
        theirs["content"] = ours.content
    elif len(regions) > 1:
        # transformers keeps only the last stretch of text between tool calls; we keep them all
        assert theirs.get("content") == regions[-1].strip()
        assert all(r.strip() in ours.content for r in regions)
        theirs["content"] = ours.content
    assert comparable(ours) == theirs


def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call():
    # the forced grammar lets a string argument hold any text; transformers' reader (a regex
    # to the first closing tag) would cut this call into broken JSON, the service's reader
    # (labkit.protocols.tool_use) reads it whole, and so does this one
    arguments = {"path": "notes.txt", "text": "a literal </tool_call> tag, then more"}
    call = json.dumps({"name": "write_file", "arguments": arguments})
    parsed = parse_reply(f"Saving.\n<tool_call>{call}</tool_call><|im_end|>", HERMES)
    assert parsed.content == "Saving." and len(parsed.tool_calls) == 1
    assert json.loads(parsed.tool_calls[0].arguments) == arguments
    unclosed = parse_reply(f"<tool_call>{call}", HERMES, strict=False)
    assert unclosed.tool_calls == () and unclosed.unparsed == (f"<tool_call>{call}",)


def test_the_turn_ends_at_its_first_end_marker():
    parsed = parse_reply(f"Done.<|im_end|>\n<|im_start|>user\n{CALL}", HERMES)
    assert parsed == ParsedReply("Done.", finished=True)


def test_text_around_tool_calls_is_all_kept():
    parsed = parse_reply(f"Checking the weather. {CALL} Done.<|im_end|>", HERMES)
    assert parsed.content == "Checking the weather. Done." and len(parsed.tool_calls) == 1


def test_tool_calls_become_openai_tool_calls():
    parsed = parse_reply(f"Checking.\n{CALL}<|im_end|>", HERMES, make_id=counter_ids())
    assert parsed.finished
    assert parsed.message() == {
        "role": "assistant", "content": "Checking.",
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}],
    }
    only_call = parse_reply(CALL, HERMES).message()
    assert only_call["content"] is None and not parse_reply(CALL, HERMES).finished
    assert only_call["tool_calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize("block, problem", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ('<tool_call>["get_weather"]</tool_call>', "string 'name'"),
    ('<tool_call>{"name": 3}</tool_call>', "string 'name'"),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', "'arguments' must be an object"),
    ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
])
def test_malformed_tool_calls_are_errors_or_kept_as_text(block, problem):
    text = f"Before {block} after<|im_end|>"
    with pytest.raises(ReplyParseError, match=problem):
        parse_reply(text, HERMES)
    kept = parse_reply(text, HERMES, strict=False)
    assert kept.tool_calls == () and len(kept.unparsed) == 1 and kept.unparsed[0].startswith(block)
    assert kept.content == text[:-len("<|im_end|>")]  # nothing dropped, nothing guessed


def test_chatml_and_gemma_have_no_tool_calls():
    assert parse_reply(f"{CALL}<|im_end|>", CHATML) == ParsedReply(CALL, finished=True)
    gemma = parse_reply("Sure.<end_of_turn>\n<start_of_turn>user\nmore", GEMMA3)
    assert gemma == ParsedReply("Sure.", finished=True)
    assert parse_reply("cut sho", GEMMA3) == ParsedReply("cut sho", finished=False)


def test_reply_format_follows_the_template(smol):
    assert reply_format_for(smol.chat_template) is CHATML
    assert reply_format_for(published_template("gemma3")) is GEMMA3
    assert reply_format_for("{{ '<|im_start|>' }}{% if tools %}<tool_call>{% endif %}") is HERMES
    with pytest.raises(ValueError, match="no reply format"):
        reply_format_for("{{ messages }}")


@pytest.mark.parametrize("content", ["Paris is the capital.", "Line one\nline two", "  spaced  "])
def test_a_turn_the_template_wrote_reads_back_as_its_message(smol, content):
    """Round trip on ids: the assistant turn SmolLM2's template renders, after the generation
    prompt, parses back into the message, stripped as transformers' parser strips it."""
    user = [{"role": "user", "content": "Capital of France?"}]
    prompt = encode_conversation(smol, user, True)
    whole = encode_conversation(smol, user + [{"role": "assistant", "content": content}], False)
    assert smol.decode(whole).startswith(smol.decode(prompt))
    reply = smol.decode(whole)[len(smol.decode(prompt)):]
    assert parse_reply(reply, CHATML) == ParsedReply(content.strip(), finished=True)
    if whole[:len(prompt)] == prompt:  # ids too, where the turn's first piece does not merge with "\n"
        assert parse_reply_ids(whole[len(prompt):], smol, CHATML).content == content.strip()
