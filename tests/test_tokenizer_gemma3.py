"""Gemma 3's SentencePiece tokenizer from its GGUF: same ids as transformers, llama.cpp and SentencePiece.

The references agree with each other except in narrow places, documented in
``labkit/tokenizer/sentencepiece.py`` and pinned here: runs of more than 31 spaces (transformers differs),
a literal "▁" next to a space (llama.cpp differs) and the decoding of invalid UTF-8 from byte
tokens (transformers differs). We follow SentencePiece, which sides with llama.cpp on the first
and third and with transformers on the second. Besides, llama.cpp makes Gemma's user-defined
"</s>" (an HTML tag) a control, end-of-generation token by name; we keep the file's type.

The whole module is slow: the fixtures read 262,144 tokens from the GGUF (about 12 s) and build
transformers' tokenizer (about 20 s).
"""

import ctypes
import json
import random
import re
import time
from pathlib import Path

import pytest

from labkit import tokenizer as tkmod
from labkit.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerBuildError, build_backend, cache_key

# Where the GGUF was assembled before the registry entry existed; used if the cache lacks it.
FALLBACK_GGUF = Path("/tmp/gemma_dl/gemma.gguf")

BOS, EOS, UNK, PAD = 2, 1, 3, 0
START_OF_TURN, END_OF_TURN = 105, 106
NEWLINE, TWO_SPACES, FOUR_SPACES, TAB = 107, 138, 140, 255968
FIRST_BYTE_TOKEN = 238  # <0x00>; the 256 byte tokens are 238..493
HTML_STRIKE_CLOSE = 212  # "</s>", a user-defined token

pytestmark = pytest.mark.slow

CORPUS = [
    "",
    " ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's what they'd've wanted, isn't it?",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple   internal    spaces and\ttabs\t\there",
    "line one\nline two\n\n\nline five\r\nwindows line\n",
    " \n \t mixed whitespace \n\t ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'a': [1, 2, 3]}  # comment\n",
    "numbers: 1234567 and 3.14159, -42, 1e-9, 0x1F, 2024-06-01, $1,000,000.00",
    "½ ² ٣٤ Ⅻ 1",
    "東京は日本の首都です。中文字符测试，한국어 텍스트입니다",
    "مرحبا بالعالم، هذا اختبار.",
    "Здравствуй, мир! Ελληνικά. עברית",
    "emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵🇺🇸 rainbow 🏳️‍🌈 keycap 1️⃣",
    "Les modèles de langage prédisent le prochain mot. Ça va? naïve café, Ångström, ﬁ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><pad><eos><unk><mask><unused0><unused6241> [multimodal] <start_of_image>",
    "almost special <start_of_turn and <end_of_turn>> and <unused>",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <code>x</code>",
    "https://example.com/path?q=1&r=two#frag `code` **bold**",
    "a\ufffdb literal replacement character",
    "control bytes a\x00b\x04c\x7fd",
    # Characters with no piece of their own: spelled with byte tokens.
    "rare: \U000e0041 \U0010fffd \U00057fc8 \u2028 \U0001d11e \U00013000 ꙮ",
    "<0x41> looks like a byte token but is text",
    "x" + " " * 31 + "y",  # the longest space piece
    "\t" * 35 + "x",
    "\n" * 40 + "x",
]

# transformers splits runs of 32 or more spaces differently (see labkit/tokenizer/sentencepiece.py).
LONG_SPACE_RUNS = [" " * 32 + "x", " " * 33 + "x", " " * 40, "if x:\n" + " " * 64 + "return"]
# llama.cpp tokenizes a literal "▁" next to a space differently (see labkit/tokenizer/sentencepiece.py).
LITERAL_SPACE_MARKS = ["literal ▁ and ▁▁ and ▁▁▁x", "a ▁b", "▁ ", "  ▁▁  "]


def _is_byte_token(token_id: int) -> bool:
    return FIRST_BYTE_TOKEN <= token_id < FIRST_BYTE_TOKEN + 256


def _long_space_run(text: str) -> bool:
    return re.search(" {32,}", text) is not None


def _space_mark_next_to_space(text: str) -> bool:
    return re.search("[ ▁]▁|▁ ", text) is not None


def _random_texts(seed: int, count: int) -> list[str]:
    """Short texts mixing real fragments, whitespace, special tokens and random code points."""
    rng = random.Random(seed)
    fragments = [" ", "  ", "    ", "\n", "\n\n", "\t", "\r\n", "▁", "<start_of_turn>", "<end_of_turn>", "<bos>",
                 "<unused5>", "<b>", "<", "é", "e\u0301", "😀", "👍🏽", "東京", "the", " the", "The", "ing", "123",
                 "3.14", "def ", "<0x41>"]
    ranges = [(0x20, 0x7F), (0xA0, 0x3000), (0x3000, 0xA000), (0x1F300, 0x1FB00), (0x10000, 0x110000), (0, 0x20)]

    def random_char() -> str:
        while True:
            low, high = rng.choice(ranges)
            code = rng.randrange(low, high)
            if not 0xD800 <= code < 0xE000:  # surrogates cannot be encoded
                return chr(code)

    return [
        "".join(rng.choice(fragments) if rng.random() < 0.4 else random_char() for _ in range(rng.randrange(30)))
        for _ in range(count)
    ]


RANDOM_TEXTS = _random_texts(seed=2024, count=1500)


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF: the registry's cached copy, else the assembled one; skip if neither."""
    try:
        from labkit.models.registry import gguf_path

        cached = gguf_path("gemma3-270m")
    except (ImportError, KeyError, ValueError):
        cached = None
    for candidate in (cached, FALLBACK_GGUF):
        if candidate is not None and candidate.is_file():
            return candidate
    pytest.skip("no Gemma 3 270M GGUF: run labkit.models.registry.fetch('gemma3-270m') to get it")


@pytest.fixture(scope="module")
def gguf_path():
    return gemma3_gguf()


@pytest.fixture(scope="module")
def fields(gguf_path):
    """The GGUF's tokenizer fields, read once (reading 262,144 tokens takes about 12 s)."""
    return tkmod.read_gguf_tokenizer_fields(gguf_path)


@pytest.fixture(scope="module")
def tok(gguf_path, fields):
    # Built afresh, not loaded from the cache, so that the tests see the builder as it is now
    # (a cache entry is keyed by the file, not by the code that built it).
    # test_cache_cold_then_warm checks that from_gguf gives the same tokenizer.
    return Tokenizer(*build_backend(fields, source=str(gguf_path)))


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _llama_cpp_vocab(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (an optional extra) is not installed")
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def llama(gguf_path):
    return _llama_cpp_vocab(gguf_path)


# --------------------------------------------------------------------------------------------
# Basics
# --------------------------------------------------------------------------------------------


def test_metadata(tok):
    assert tok.vocab_size == len(tok) == 262144
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.meta.unk_token_id) == (BOS, EOS, PAD, UNK)
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
    assert (tok.meta.tokenizer_model, tok.meta.pre_tokenizer) == ("llama", "default")
    assert tok.meta.add_bos_token is True and tok.meta.add_eos_token is False
    assert tok.meta.add_space_prefix is False
    assert tok.chat_template is None  # the base model has none
    assert {BOS, EOS, PAD, UNK, START_OF_TURN, END_OF_TURN} <= tok.special_token_ids
    assert len(tok.special_token_ids) == 6249  # every control token, the <unusedN> included
    assert NEWLINE not in tok.special_token_ids  # user-defined, so skip_special_tokens keeps it
    assert tok.id_to_token(START_OF_TURN) == "<start_of_turn>"
    assert tok.id_to_token(TWO_SPACES) == "▁▁"  # the file has "  ", for llama.cpp
    assert tok.id_to_token(FIRST_BYTE_TOKEN) == "<0x00>"
    assert tok.token_to_id("▁the") is not None


def test_pipeline_is_sentencepiece_bpe(tok):
    spec = json.loads(tok.backend.to_str())
    assert spec["normalizer"] == {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    assert spec["pre_tokenizer"] is None
    assert [d["type"] for d in spec["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse"]
    model = spec["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] is True and model["unk_token"] == "<unk>"
    assert len(model["merges"]) == 513511
    added = spec["added_tokens"]
    assert sum(t["special"] for t in added) == 6249
    user_defined = [t for t in added if not t["special"]]
    assert len(user_defined) == 165 and all(t["normalized"] for t in user_defined)


def test_encode_and_bos(tok):
    ids = tok.encode("Hello world")
    assert [tok.id_to_token(i) for i in ids] == ["Hello", "▁world"]
    # Like SmolLM2's: BOS only on request, and then because the file asks for it.
    assert tok.encode("Hello world", add_special_tokens=True) == [BOS, *ids]
    assert tok.encode("") == [] and tok.encode("", add_special_tokens=True) == [BOS]
    assert EOS not in tok.encode("x", add_special_tokens=True)
    assert tok.encode_batch(["Hello world", "x"], add_special_tokens=True) == [[BOS, *ids], [BOS, *tok.encode("x")]]
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>") == [
        START_OF_TURN, tok.token_to_id("user"), NEWLINE, tok.token_to_id("hi"), END_OF_TURN
    ]
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_whitespace_pieces_are_matched_whole(tok):
    assert tok.encode("a  b") == [tok.token_to_id("a"), TWO_SPACES, tok.token_to_id("b")]
    assert tok.encode("    return") == [FOUR_SPACES, tok.token_to_id("return")]
    assert tok.encode("\n\n\n") == [NEWLINE + 2]
    assert tok.encode("\t") == [TAB]
    # Greedy, longest first: 31 spaces, then the rest, the last space joining the next word.
    assert tok.encode(" " * 32 + "x") == [TWO_SPACES + 29, tok.token_to_id("▁x")]


def test_rare_characters_fall_back_to_bytes(tok):
    for char in ["\U000e0041", "\U0010fffd", "\U00057fc8", "\u2028"]:
        ids = tok.encode(char)
        assert ids == [FIRST_BYTE_TOKEN + b for b in char.encode("utf-8")], char
        assert tok.decode(ids) == char
    assert tok.decode([FIRST_BYTE_TOKEN + 0xE6]) == "\ufffd"  # a lone lead byte is invalid UTF-8
    # A stray byte after a character spelled in bytes spoils only itself (see labkit/tokenizer/sentencepiece.py).
    ids = tok.encode("\u416b") + [FIRST_BYTE_TOKEN + 0xB3] + tok.encode("é")
    assert tok.decode(ids) == "\u416b\ufffdé"


@pytest.mark.parametrize("text", CORPUS + LONG_SPACE_RUNS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_text(tok):
    for text in RANDOM_TEXTS:
        # A literal "▁" is how SentencePiece writes a space, so it comes back as one.
        assert tok.decode(tok.encode(text)) == text.replace("▁", " "), text


def test_decode_skips_control_tokens_only(tok):
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=True)
    assert tok.decode(ids) == "<bos><start_of_turn>user\nhi<end_of_turn>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def _random_ids(seed: int, count: int) -> list[list[int]]:
    """Arbitrary id sequences, half of them from the first 600 ids (specials, whitespace, bytes)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(600 if trial % 2 else 262144) for _ in range(rng.randrange(1, 40))] for trial in range(count)
    ]


def _stream(tok, ids, skip):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_stream_matches_decode(tok):
    # Runs of byte tokens (rare characters) stream out character by character.
    texts = ["emoji 😀👍🏽 👨‍👩‍👧‍👦 and 東京 \U000e0041\U0010fffd", "<start_of_turn>model\n  indented\tcode\n"]
    for text in texts + RANDOM_TEXTS[:300]:
        ids = tok.encode(text)
        for skip in (False, True):
            pieces = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), text
            if "\ufffd" not in text:
                assert not any("\ufffd" in piece for piece in pieces), text


def test_stream_matches_decode_for_arbitrary_ids(tok):
    """Invalid UTF-8 included: later ids never change the text of earlier ones (see labkit/tokenizer/sentencepiece.py)."""
    for ids in _random_ids(seed=7, count=300):
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip), ids


def test_unsupported_files_are_clear_errors(fields):
    with pytest.raises(TokenizerBuildError, match="SentencePiece BPE"):
        build_backend({**fields, "tokenizer.ggml.model": "t5"})
    with pytest.raises(TokenizerBuildError, match="tokenizer.ggml.scores"):
        build_backend({k: v for k, v in fields.items() if k != "tokenizer.ggml.scores"})


# --------------------------------------------------------------------------------------------
# Build time and cache
# --------------------------------------------------------------------------------------------


def test_build_is_quick(fields):
    start = time.perf_counter()
    backend, _ = build_backend(fields)
    elapsed = time.perf_counter() - start
    # About 2 s on two cores (deriving 513,511 merges is most of it); reading the GGUF, which
    # the cache saves, takes longer. The bound only catches a blow-up.
    assert elapsed < 20, f"building took {elapsed:.1f} s"
    assert backend.get_vocab_size(with_added_tokens=True) == 262144


def test_cache_cold_then_warm(gguf_path, fields, tmp_path, monkeypatch, tok):
    monkeypatch.setattr(tkmod, "read_gguf_tokenizer_fields", lambda path: fields)
    cold = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    entry = tmp_path / cache_key(gguf_path)
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokenizer.json"]

    def fail(path):
        raise AssertionError("a warm load must not read the GGUF")

    monkeypatch.setattr(tkmod, "read_gguf_tokenizer_fields", fail)
    start = time.perf_counter()
    warm = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"warm load took {elapsed:.1f} s"  # about 1.2 s: a 262k-token tokenizer.json
    assert warm.meta == cold.meta == tok.meta
    for text in CORPUS + LONG_SPACE_RUNS + RANDOM_TEXTS[:200]:
        assert warm.encode(text) == cold.encode(text) == tok.encode(text), text


# --------------------------------------------------------------------------------------------
# Against transformers (building its tokenizer from the GGUF takes about 20 s)
# --------------------------------------------------------------------------------------------


def test_same_vocabulary_and_merges_as_transformers(tok, hf):
    theirs = hf.backend_tokenizer
    assert tok.backend.get_vocab(with_added_tokens=True) == theirs.get_vocab(with_added_tokens=True)
    ours_added = {i: (t.content, t.special) for i, t in tok.backend.get_added_tokens_decoder().items()}
    theirs_added = {i: (t.content, t.special) for i, t in theirs.get_added_tokens_decoder().items()}
    # transformers reaches the space runs by merges instead of adding them; the rest is the same.
    space_runs = {i: ("▁" * n, False) for i, n in zip(range(TWO_SPACES, TWO_SPACES + 30), range(2, 32))}
    assert ours_added == {**theirs_added, **space_runs}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    # Our merges are theirs, in the same order, less those that make control or user-defined tokens.
    ours_merges = json.loads(tok.backend.to_str())["model"]["merges"]
    theirs_merges = json.loads(theirs.to_str())["model"]["merges"]
    added = {t.content for t in theirs.get_added_tokens_decoder().values()} | {c for c, _ in space_runs.values()}
    assert ours_merges == [m for m in theirs_merges if m[0] + m[1] not in added]


def test_encode_matches_transformers(tok, hf):
    for text in CORPUS + LITERAL_SPACE_MARKS + RANDOM_TEXTS:
        assert not _long_space_run(text)
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
    for text in CORPUS:
        assert tok.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text  # BOS included


@pytest.mark.parametrize("text", LONG_SPACE_RUNS)
def test_long_space_runs_differ_from_transformers(tok, hf, text):
    ours, theirs = tok.encode(text), hf(text, add_special_tokens=False)["input_ids"]
    assert ours != theirs
    assert hf.decode(theirs) == tok.decode(ours) == text
    # We cut greedily, 31 spaces at a time, as SentencePiece and llama.cpp do.
    assert TWO_SPACES + 29 in ours


def test_decode_matches_transformers(tok, hf):
    sequences = [tok.encode(text) for text in CORPUS + LONG_SPACE_RUNS + RANDOM_TEXTS]
    sequences += [[i for i in ids if not _is_byte_token(i)] for ids in _random_ids(seed=1234, count=300)]
    for ids in sequences:
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_invalid_bytes_decode_unlike_transformers(tok, hf):
    ids = tok.encode("\u416b") + [FIRST_BYTE_TOKEN + 0xB3] + tok.encode("é")
    assert hf.decode(ids) == "\ufffd" * 4 + "é"  # ByteFallback: the whole run of bytes is lost
    assert tok.decode(ids) == "\u416b\ufffdé"


# --------------------------------------------------------------------------------------------
# Against llama.cpp (skipped without llama-cpp-python)
# --------------------------------------------------------------------------------------------


def test_encode_matches_llama_cpp(tok, llama):
    for text in CORPUS + LONG_SPACE_RUNS + RANDOM_TEXTS:
        if _space_mark_next_to_space(text):
            continue  # the documented difference, checked below
        # special=True: control-token text is parsed as the token, as our encode does.
        theirs = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert tok.encode(text) == theirs, text
    for text in CORPUS:
        with_bos = llama.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert tok.encode(text, add_special_tokens=True) == with_bos, text


def test_literal_space_marks_differ_from_llama_cpp(tok, llama):
    for text in LITERAL_SPACE_MARKS:
        ours, theirs = tok.encode(text), llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert ours != theirs, text
        # Both decode to the text with "▁" read as a space.
        assert tok.decode(ours) == _llama_cpp_decode(llama, theirs, False) == text.replace("▁", " ")
    assert tok.encode("▁ ") == [TWO_SPACES]  # SentencePiece's and transformers' answer


def _llama_cpp_decode(llama, ids: list[int], skip_special_tokens: bool) -> str:
    """llama.cpp's bytes for ``ids``, decoded with one U+FFFD per invalid byte (SentencePiece's rule).

    Each piece comes from ``llama_token_to_piece`` itself: llama-cpp-python's ``detokenize``
    reads pieces into a 32-byte buffer (longer ones, like "▁চট্টগ্রামের", are lost) and
    drops a space after a leading BOS.
    """
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    buffer = ctypes.create_string_buffer(1024)
    pieces = []
    for token_id in ids:
        length = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, len(buffer), 0, not skip_special_tokens)
        assert length >= 0, token_id
        pieces.append(buffer.raw[:length])
    text = b"".join(pieces).decode("utf-8", errors="surrogateescape")
    return re.sub("[\udc80-\udcff]", "\ufffd", text)


def test_decode_matches_llama_cpp(tok, llama):
    sequences = [tok.encode(text) for text in CORPUS + LONG_SPACE_RUNS + RANDOM_TEXTS]
    sequences += _random_ids(seed=99, count=300)
    for ids in sequences:
        assert tok.decode(ids) == _llama_cpp_decode(llama, ids, False), ids
        # llama.cpp also drops "</s>" here (see the next test).
        kept = [i for i in ids if i != HTML_STRIKE_CLOSE]
        assert tok.decode(kept, skip_special_tokens=True) == _llama_cpp_decode(llama, ids, True), ids


def test_llama_cpp_makes_html_close_tag_a_control_token(tok, llama):
    """llama.cpp retypes any token spelled "</s>" as control and end-of-generation; Gemma's is HTML."""
    assert tok.id_to_token(HTML_STRIKE_CLOSE) == "</s>"
    assert HTML_STRIKE_CLOSE not in tok.special_token_ids  # the file says user-defined; we keep that
    assert tok.decode([HTML_STRIKE_CLOSE], skip_special_tokens=True) == "</s>"
    assert _llama_cpp_decode(llama, [HTML_STRIKE_CLOSE], True) == ""


@pytest.fixture(scope="module")
def prefix_gguf(fields, tmp_path_factory):
    """Gemma's vocabulary in a tensor-less GGUF that sets add_space_prefix (Gemma's own does not)."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("prefix") / "space-prefix.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gemma3")
    # llama.cpp reads these hyperparameters even when it loads the vocabulary alone.
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores([float(s) for s in fields["tokenizer.ggml.scores"]])
    writer.add_token_types([int(t) for t in fields["tokenizer.ggml.token_type"]])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_space_prefix_follows_llama_cpp(fields, prefix_gguf):
    llama = _llama_cpp_vocab(prefix_gguf)
    tok = Tokenizer(*build_backend({**fields, "tokenizer.ggml.add_space_prefix": True}))
    assert tok.meta.add_space_prefix is True
    assert [tok.id_to_token(i) for i in tok.encode("Hello world")] == ["▁Hello", "▁world"]
    assert tok.decode(tok.encode("Hello world")) == "Hello world"  # the decoder strips the prefix
    # llama.cpp puts a "▁" before every stretch of text between added tokens, and so do we.
    assert [tok.id_to_token(i) for i in tok.encode("x\ny")] == ["▁x", "\n", "▁y"]
    for text in CORPUS + LONG_SPACE_RUNS + LITERAL_SPACE_MARKS + RANDOM_TEXTS:
        assert tok.encode(text) == llama.tokenize(text.encode("utf-8"), add_bos=False, special=True), text


# --------------------------------------------------------------------------------------------
# Against SentencePiece itself (skipped unless sentencepiece and protobuf are installed; they
# are not labkit dependencies)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentencepiece_model(fields):
    """A SentencePiece BPE model with Gemma's pieces, scores and types, as the GGUF records them."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (not a labkit dependency)")
    pytest.importorskip("google.protobuf", reason="protobuf is not installed (sentencepiece needs it here)")
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto()
    unknown_type = 2
    for i, (piece, score, kind) in enumerate(
        zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"], fields["tokenizer.ggml.token_type"])
    ):
        entry = proto.pieces.add()
        # The GGUF writes user-defined pieces with real spaces for llama.cpp; SentencePiece uses "▁".
        entry.piece = piece.replace(" ", "▁") if kind == 4 else piece
        entry.score = float(score)
        entry.type = unknown_type if i == UNK else int(kind)
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(proto.pieces)
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id = UNK, BOS
    proto.trainer_spec.eos_id, proto.trainer_spec.pad_id = EOS, PAD
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False  # add_space_prefix is false
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def test_encode_matches_sentencepiece(tok, sentencepiece_model):
    control = re.compile(r"<(bos|eos|pad|unk|mask|start_of_turn|end_of_turn|unused\d+)>")
    checked = 0
    for text in CORPUS + LONG_SPACE_RUNS + LITERAL_SPACE_MARKS + RANDOM_TEXTS:
        if control.search(text):
            continue  # SentencePiece does not parse control tokens in text
        assert tok.encode(text) == sentencepiece_model.encode(text), text
        checked += 1
    assert checked > 500


def test_decode_matches_sentencepiece(tok, sentencepiece_model):
    # Without control tokens: SentencePiece writes none of them (but <unk>, as " ⁇ "), and one
    # between two byte tokens breaks its run of bytes, where llama.cpp and transformers join them.
    for ids in _random_ids(seed=5, count=300):
        ids = [i for i in ids if i not in tok.special_token_ids]
        assert tok.decode(ids) == sentencepiece_model.decode(ids), ids
