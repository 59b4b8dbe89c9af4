"""labkit.experiments.token_costs: the table's arithmetic on a stub, and how real text is cut."""

import pytest

from labkit.experiments.token_costs import token_bytes, token_cost_table, token_pieces


class StubTokenizer:
    """One token per whitespace-separated word and one per character of every other run.

    "ab cd" -> ["ab", " cd"]: two tokens; a text with no spaces is one token per 2 characters.
    """

    def encode(self, text):
        words = text.split(" ")
        if len(words) > 1:
            return list(range(len(words)))
        return list(range((len(text) + 1) // 2))


def test_table_arithmetic_on_a_stub():
    samples = {"prose": "one two three four", "cjk": "東京大阪", "emoji": "🙂🙂"}
    rows = token_cost_table(StubTokenizer(), samples, words_for={"prose"}, relative_to="prose")
    by = {r["sample"]: r for r in rows}
    prose, cjk, emoji = by["prose"], by["cjk"], by["emoji"]
    assert [r["sample"] for r in rows] == ["prose", "cjk", "emoji"]
    assert (prose["characters"], prose["bytes"], prose["tokens"], prose["words"]) == (18, 18, 4, 4)
    assert prose["chars_per_token"] == 4.5 and prose["bytes_per_token"] == 4.5
    assert prose["tokens_per_word"] == 1.0 and prose["tokens_vs_prose"] == 1.0
    # four CJK characters, three UTF-8 bytes each, two stub tokens
    assert (cjk["characters"], cjk["bytes"], cjk["tokens"]) == (4, 12, 2)
    assert cjk["chars_per_token"] == 2.0 and cjk["bytes_per_token"] == 6.0
    assert cjk["words"] is None and cjk["tokens_per_word"] is None
    assert cjk["tokens_vs_prose"] == 0.5
    # two emoji of one code point and four bytes each
    assert (emoji["characters"], emoji["bytes"], emoji["tokens"]) == (2, 8, 1)


def test_words_default_to_all_samples_and_relative_to_must_exist():
    rows = token_cost_table(StubTokenizer(), {"a": "x y z"})
    assert rows[0]["words"] == 3 and rows[0]["tokens_per_word"] == 1.0
    assert "tokens_vs_a" not in rows[0]
    with pytest.raises(ValueError):
        token_cost_table(StubTokenizer(), {"a": "x"}, relative_to="b")


@pytest.fixture(scope="module")
def tokenizer():
    from labkit.models.loader import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_pieces_show_leading_spaces_digits_and_partial_characters(tokenizer):
    assert token_pieces(tokenizer, " Paris") == [(7042, " Paris")]
    assert token_pieces(tokenizer, "Paris") == [(38634, "Paris")]
    assert [p for _, p in token_pieces(tokenizer, "2025")] == ["2", "0", "2", "5"]
    pieces = token_pieces(tokenizer, "🙂")
    assert [p for _, p in pieces] == ["<f0 9f>", "<99 82>"]
    assert b"".join(token_bytes(tokenizer, i) for i, _ in pieces) == "🙂".encode()


def test_token_bytes_round_trip_a_mixed_text(tokenizer):
    text = "def f(x):\n    return x  # Привет, 世界 👩‍💻 🇮🇪"
    ids = tokenizer.encode(text)
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode("utf-8")
    assert token_bytes(tokenizer, tokenizer.encode("<|im_start|>")[0]) == b"<|im_start|>"
