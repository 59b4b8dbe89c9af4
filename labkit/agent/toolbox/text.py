"""word_count: lines, words and characters of a text, as `wc` counts them."""

from __future__ import annotations

import json

from labkit.agent.sandbox import ToolResult
from labkit.agent.tools import Tool


def count(text: str) -> ToolResult:
    # wc: lines are newline characters, words are runs of non-space, characters are code points
    return ToolResult.success(json.dumps({"lines": text.count("\n"), "words": len(text.split()),
                                          "characters": len(text)}))


def word_count() -> Tool:
    return Tool("word_count", "Count the lines, words and characters of a text.",
                {"type": "object", "properties": {"text": {"type": "string", "maxLength": 1_000_000}},
                 "required": ["text"], "additionalProperties": False},
                lambda args: count(args["text"]))
