"""`labkit.engine.output.OutputProcessor`: what a stream is handed, token by token, under stop
strings, stop token ids, EOS and the length limit.

The reference is the closed form: the final text is the whole decoded text cut before the
earliest stop string (or whole), and the pieces handed out add up to it at every finish, since
a stream cannot take back a piece it sent. A stand-in tokenizer whose tokens are fixed strings
makes every case exact.
"""

from __future__ import annotations

import pytest

from labkit.engine.output import OutputProcessor
from labkit.sampling import SamplingParams

PIECES = ["The", " capital", " of", " France", " is", " Paris", ".", "\n\n", "It", " is", " big", "."]
EOS = len(PIECES)


class WordTokenizer:
    """Token i is PIECES[i]; the detokenizer's protocol (`decode` of a whole id list)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] for i in ids if i != EOS)


def run(params: SamplingParams, tokens):
    out = OutputProcessor(WordTokenizer(), params)
    handed, reason = [], None
    for token in tokens:
        delta = out.add(token)
        handed.append(delta.text)
        if delta.finish_reason is not None:
            reason = delta.finish_reason
            break
    return handed, out.text, reason


ALL = list(range(len(PIECES)))
WHOLE = "".join(PIECES)


@pytest.mark.parametrize("stop", [["France is"], ["ance i"], ["Paris.\n\nIt"], [" is"], ["\n\n", "Fr"],
                                  ["big.!"], ["zzz", "of F"]])
def test_pieces_add_up_to_the_text_cut_before_the_earliest_stop(stop):
    handed, text, reason = run(SamplingParams(stop=stop, max_tokens=50), ALL + [EOS])
    hits = [WHOLE.find(s) for s in stop if s in WHOLE]
    want = WHOLE[:min(hits)] if hits else WHOLE
    assert text == want and "".join(handed) == want
    assert reason == "stop"
    for k in range(1, len(handed) + 1):  # no prefix of what was handed out ever ran past the final text
        assert want.startswith("".join(handed[:k]))


def test_a_piece_waits_only_while_a_stop_string_could_still_begin_in_it():
    handed, _, _ = run(SamplingParams(stop=["France is"], max_tokens=50), ALL)
    # held back: the last len("France is") - 1 = 8 characters of "The", "The capital", "The capital of"
    assert handed[:3] == ["", "The", " ca"]
    no_stop, _, _ = run(SamplingParams(max_tokens=50), ALL)
    assert no_stop[:3] == ["The", " capital", " of"]  # without stop strings nothing waits


@pytest.mark.parametrize("finish, tokens, params", [
    ("length", ALL[:5], SamplingParams(stop=["zzzzzzzzzzzz"], max_tokens=5)),
    ("stop", ALL[:5] + [EOS], SamplingParams(stop=["zzzzzzzzzzzz"], max_tokens=50)),
    ("stop", ALL[:5] + [7], SamplingParams(stop=["zzzzzzzzzzzz"], stop_token_ids=(7,), max_tokens=50)),
])
def test_every_finish_hands_out_what_was_held_back(finish, tokens, params):
    handed, text, reason = run(params, tokens)
    assert reason == finish and text == "".join(PIECES[:5]) == "".join(handed)
