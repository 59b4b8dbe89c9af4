"""OpenAI's request fields that this service does not implement, and the values at which each
asks for nothing.

Official clients and frameworks send some of these fields at their documented defaults
(`store: false`, `modalities: ["text"]`, `service_tier: "auto"`, ...). Such
a value changes nothing, so it is taken and the answer is the one without it; any other value
is refused (400 `unsupported_parameter`, naming the field), and null means "not given" as
everywhere. The values are those of OpenAI's OpenAPI document (vendored in
`tests/openai_openapi/`: `CreateCompletionRequest`, `CreateChatCompletionRequest` and the
schemas they reference): the field's `default:`, or, where it has none, the value its
description says changes nothing. `tests/test_serve_defaults.py` sends each of them to a live
server and checks the answer against the one without the field.
"""

from __future__ import annotations

import json

ONLY_NULL = ()  # every value of the field asks for something this service does not do

COMPLETION_NO_OPS: dict[str, tuple] = {
    "best_of": (1,),             # default 1: one candidate for each returned choice
    "suffix": ("",),             # default null; an empty suffix puts nothing after the text
}

CHAT_NO_OPS: dict[str, tuple] = {
    "audio": ONLY_NULL,
    "function_call": ("none",),            # "`none` is the default when no functions are present"
    "functions": ONLY_NULL,                # minItems 1: there is no empty list to send
    "modalities": (["text"],),             # "text, which is the default"
    "moderation": ONLY_NULL,
    "prediction": ONLY_NULL,
    "prompt_cache_key": ONLY_NULL,
    "prompt_cache_options": ONLY_NULL,
    "prompt_cache_retention": ONLY_NULL,
    "reasoning_effort": ("medium",),       # default "medium"
    "safety_identifier": ONLY_NULL,
    "service_tier": ("auto", "default"),   # default "auto"; this server has one tier, the default
    "store": (False,),                     # default false: nothing is stored
    "verbosity": ("medium",),              # default "medium"
    "web_search_options": ONLY_NULL,       # sent at all, even {}, it turns web search on
}

MESSAGE_NO_OPS: dict[str, tuple] = {name: ONLY_NULL for name in
                                    ("name", "refusal", "audio", "function_call")}

# Obfuscation pads streamed deltas with an `obfuscation` field; labkit's chunks never carry one,
# so `false` is what this service does anyway and `true` (OpenAI's default) would be ignored.
STREAM_OPTIONS_NO_OPS: dict[str, tuple] = {"include_obfuscation": (False,)}


def canonical(value) -> str:
    """JSON text that tells `true` from `1` and `1` from `1.0`, and ignores key order."""
    return json.dumps(value, sort_keys=True)


def asks_for_nothing(value, no_ops: tuple) -> bool:
    if value is None:
        return True
    try:
        sent = canonical(value)
    except RecursionError:  # nested about as deep as the parser goes: no no-op value is
        return False
    return any(sent == canonical(accepted) for accepted in no_ops)


def describe_no_ops(no_ops: tuple) -> str:
    return " or ".join(["null", *(canonical(v) for v in no_ops)])
