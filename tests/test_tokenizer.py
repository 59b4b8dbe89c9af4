"""The GGUF tokenizer: same ids as transformers, chat template, cache, streaming detokenization."""

import dataclasses
import json
import os
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit import tokenizer as tkmod
from labkit.models.registry import fetch
from labkit.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerBuildError, build_backend, cache_key

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
    "x  1",
    "\n\n2",
    "items = [\n        10,\n        200,\n    ]",
    "½ ² ٣٤ Ⅻ 1",
    "東京は日本の首都です。中文字符测试，한국어 텍스트입니다",
    "مرحبا بالعالم، هذا اختبار.",
    "Здравствуй, мир! Ελληνικά. עברית",
    "emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵🇺🇸 rainbow 🏳️‍🌈 keycap 1️⃣",
    "special tokens <|im_end|> inside <|im_start|>user\ntext<|endoftext|>",
    "<|im_start|>assistant\nSure!<|im_end|>\n",
    "almost special <|im_end| and <im_end|> and <|unknown|>",
    "Les modèles de langage prédisent le prochain mot. Ça va? naïve café",
    "a\ufffdb literal replacement character",
    "control bytes a\x04b\x7fc",
    "https://example.com/path?q=1&r=two#frag <b>html</b> `code` **bold**",
]

# Characters that have no token in this vocabulary (byte-level BPE with no unknown token): both
# our tokenizer and transformers' drop them, so they do not survive a round trip.
UNTOKENIZABLE = "\x04\x06\x13\x14\x16\x1d"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ],
    [
        {"role": "user", "content": "Write 2+2."},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Now in words, with emoji 🎉 and 東京"},
    ],
    [
        {"role": "system", "content": "Line one\nline two  "},
        {"role": "user", "content": "  leading spaces and <|im_end|> inside"},
        {"role": "assistant", "content": ""},
    ],
]


def _whitespace_then_numeric(text: str) -> bool:
    """Where transformers' GGUF tokenizer (no Digits step) may differ from SmolLM2's own."""
    return any(a.isspace() and b.isnumeric() for a, b in zip(text, text[1:]))


@pytest.fixture(scope="module")
def gguf_path():
    return fetch("smollm2-135m")


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def fields(gguf_path):
    """The GGUF's tokenizer fields, read once (reading takes about 2 s)."""
    return tkmod.read_gguf_tokenizer_fields(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_smollm(hf, tok):
    """transformers' tokenizer with only its pre-tokenizer swapped for SmolLM2's own."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = tok.backend.pre_tokenizer
    return backend


# --------------------------------------------------------------------------------------------
# Basics
# --------------------------------------------------------------------------------------------


def test_metadata(tok):
    assert tok.vocab_size == len(tok) == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.id_to_token(0) == "<|endoftext|>"
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("Ġthe") is not None
    assert tok.id_to_token(tok.token_to_id("Ġthe")) == "Ġthe"
    assert tok.id_to_token(10**9) is None
    assert tok.meta.add_bos_token is False
    assert "<|im_start|>" in tok.chat_template


def test_pipeline_is_smollm2s_own(tok):
    spec = json.loads(tok.backend.to_str())
    assert spec["normalizer"] is None
    assert spec["pre_tokenizer"] == {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    assert spec["decoder"]["type"] == "ByteLevel"
    assert spec["model"]["type"] == "BPE" and len(spec["model"]["merges"]) == 48900
    added = {t["content"]: t["special"] for t in spec["added_tokens"]}
    assert len(added) == 17 and all(added.values())


def test_encode_basics(tok):
    assert tok.encode("") == []
    ids = tok.encode("Hello world")
    assert [tok.id_to_token(i) for i in ids] == ["Hello", "Ġworld"]
    assert tok.encode("Hello world", add_special_tokens=True) == ids  # this model adds no BOS
    assert tok.encode("a<|im_end|>b") == [tok.encode("a")[0], 2, tok.encode("b")[0]]
    assert tok.encode_batch(["Hello world", "x"]) == [ids, tok.encode("x")]
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_whitespace_before_digits_stays_together(tok):
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm") split digits off first, so a run of
    # whitespace before a number is one piece; transformers' GGUF loader splits off its last space.
    assert [tok.id_to_token(i) for i in tok.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("\n\n2")] == ["ĊĊ", "2"]
    assert [tok.id_to_token(i) for i in tok.encode("1234567")] == list("1234567")


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    expected = text.translate({ord(c): None for c in UNTOKENIZABLE})
    assert tok.decode(ids) == expected


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def test_cache_cold_then_warm(gguf_path, fields, tmp_path, monkeypatch, tok):
    monkeypatch.setattr(tkmod, "read_gguf_tokenizer_fields", lambda path: fields)
    cold = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    entry = tmp_path / cache_key(gguf_path)
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no temporary folder left behind

    def fail(path):
        raise AssertionError("a warm load must not read the GGUF")

    monkeypatch.setattr(tkmod, "read_gguf_tokenizer_fields", fail)
    start = time.perf_counter()
    warm = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"warm load took {elapsed:.3f} s"
    assert warm.meta == cold.meta
    assert warm.meta.chat_template == tok.meta.chat_template
    for text in CORPUS:
        assert warm.encode(text) == cold.encode(text) == tok.encode(text)


def test_corrupt_cache_is_rebuilt(gguf_path, fields, tmp_path, monkeypatch, tok):
    monkeypatch.setattr(tkmod, "read_gguf_tokenizer_fields", lambda path: fields)
    entry = tmp_path / cache_key(gguf_path)
    entry.mkdir()
    (entry / "tokenizer.json").write_text("{ not json")
    (entry / "meta.json").write_text("{}")
    rebuilt = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    expected = tok.encode("Hello world 12")
    assert rebuilt.encode("Hello world 12") == expected
    assert Tokenizer.from_file(entry / "tokenizer.json", entry / "meta.json").encode("Hello world 12") == expected


def test_cache_key_follows_size_and_mtime(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    first = cache_key(path)
    assert cache_key(path) == first
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    second = cache_key(path)
    assert second != first
    path.write_bytes(b"GGUF" + bytes(61))
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert cache_key(path) not in (first, second)


def test_from_file_accepts_meta_forms(tok, tmp_path):
    tok.save(tmp_path)
    meta_dict = json.loads((tmp_path / "meta.json").read_text())
    for meta in (tok.meta, meta_dict, tmp_path / "meta.json"):
        loaded = Tokenizer.from_file(tmp_path / "tokenizer.json", meta)
        assert loaded.meta == tok.meta
        assert loaded.encode("héllo 12") == tok.encode("héllo 12")


def test_unsupported_files_are_clear_errors(fields):
    with pytest.raises(TokenizerBuildError, match="byte-level BPE"):
        build_backend({**fields, "tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerBuildError, match="qwen2"):
        build_backend({**fields, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(TokenizerBuildError, match="merges"):
        build_backend({k: v for k, v in fields.items() if k != "tokenizer.ggml.merges"})


# --------------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------------


def test_chat_template_renders_smollm2_format(tok):
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )
    ids = tok.encode_chat(with_system)
    assert ids == tok.encode(tok.apply_chat_template(with_system))
    tail = tok.encode("<|im_start|>assistant\n")
    assert ids[0] == tok.bos_token_id and ids[-len(tail) :] == tail
    assert ids.count(tok.eos_token_id) == 2


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"content": "x"}], "unknown role None"),
        ([{"role": "user", "content": ["a", "b"]}], "str content, got list"),
        ([{"role": "user", "content": None}], "str content, got NoneType"),
        ([{"role": "user"}], "missing 'content'"),
        (["just a string"], "must be a dict"),
        ("hello", "list of"),
        ({"role": "user", "content": "x"}, "list of"),
    ],
)
def test_chat_template_rejects_bad_messages(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=match):
        tok.encode_chat(messages)


def test_no_chat_template_is_a_clear_error(tok):
    bare = Tokenizer(tok.backend, dataclasses.replace(tok.meta, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_is_sandboxed(tok):
    import jinja2

    evil = Tokenizer(tok.backend, dataclasses.replace(tok.meta, chat_template="{{ messages.append(1) }}"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------------------------
# Against transformers (slow: building its tokenizer takes several seconds)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_same_vocabulary_and_special_tokens_as_transformers(tok, hf):
    assert tok.backend.get_vocab(with_added_tokens=True) == hf.backend_tokenizer.get_vocab(with_added_tokens=True)
    ours = {i: (t.content, t.special) for i, t in tok.backend.get_added_tokens_decoder().items()}
    theirs = {i: (t.content, t.special) for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items()}
    assert ours == theirs
    assert (tok.bos_token, tok.eos_token) == (hf.bos_token, hf.eos_token)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)


@pytest.mark.slow
def test_encode_matches_transformers(tok, hf, hf_smollm):
    differ = []
    for text in CORPUS:
        ours = tok.encode(text)
        # Identical vocabulary, merges and added tokens: equal ids everywhere.
        assert ours == hf_smollm.encode(text, add_special_tokens=False).ids, text
        theirs = hf(text, add_special_tokens=False)["input_ids"]
        if _whitespace_then_numeric(text):
            differ.append(ours != theirs)
        else:
            # transformers' own GGUF tokenizer, pre-tokenizer included.
            assert ours == theirs, text
            assert tok.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
    assert any(differ)  # the corpus does exercise the documented difference


@pytest.mark.slow
def test_decode_matches_transformers(tok, hf):
    rng = random.Random(1234)
    sequences = [tok.encode(text) for text in CORPUS]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(100)]
    sequences += [[rng.randrange(300) for _ in range(20)] for _ in range(50)]  # bytes and specials
    for ids in sequences:
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, hf_smollm, messages, add_generation_prompt):
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == theirs
    ids = tok.encode_chat(messages, add_generation_prompt)
    if not any("<|im_end|>" in m["content"] for m in messages):
        assert ids == hf_smollm.encode(theirs, add_special_tokens=False).ids
    else:  # a spelling in a message is plain text (tests/test_protocols_templates.py), same text
        assert tok.decode(ids) == theirs
        assert ids.count(tok.token_to_id("<|im_end|>")) == len(messages)


# --------------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------------

STREAM_TEXTS = [
    "Hello world, how are you today?",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 rainbow 🏳️‍🌈",
    "東京は日本の首都です。中文字符测试，한국어",
    "def f(x):\n    return {'a': [1, 2, 3]}\n\n\nprint(f(1))  # 😀\n",
    "Mixed: café 3.14159 مرحبا 🎉<|im_end|>\n<|im_start|>assistant\n  done",
    "a\ufffdb and ¿ñ?",
]


def _stream(tokenizer, ids, chunks=None, **kwargs):
    """Feed ``ids`` in pieces of the given sizes (1 by default); return the pieces of text out."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    out, i = [], 0
    sizes = iter(chunks or [])
    while i < len(ids):
        n = next(sizes, 1)
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    return out, detok


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_stream_every_prefix(tok, text, skip):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    emitted = ""
    for n, token in enumerate(ids, start=1):
        piece = detok.add(token)
        prefix_text = tok.decode(ids[:n], skip_special_tokens=skip)
        if "\ufffd" not in full:
            assert "\ufffd" not in piece
        emitted += piece
        # What is out is final: a prefix of both this prefix's decode and the whole decode.
        assert prefix_text.startswith(emitted) and full.startswith(emitted)
        # Stopping here and flushing gives exactly this prefix's decode.
        pieces, _ = _stream(tok, ids[:n], skip_special_tokens=skip)
        assert "".join(pieces) == prefix_text
    assert emitted + detok.flush() == full


def test_stream_gets_leading_spaces_right(tok):
    ids = tok.encode("Hello world and  more")
    pieces, _ = _stream(tok, ids)
    assert pieces[: len(ids)] == [tok.decode([i]) for i in ids] == ["Hello", " world", " and", " ", " more"]


def test_stream_holds_partial_characters(tok):
    ids = tok.encode("😀")  # four bytes, several byte tokens
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detok.flush() == ""


def test_stream_with_context(tok):
    prompt = tok.encode("The answer is")
    gen = tok.encode("The answer is 42, 東京 😀.")[len(prompt) :]
    assert tok.encode("The answer is 42, 東京 😀.")[: len(prompt)] == prompt
    pieces, _ = _stream(tok, gen, context_ids=prompt)
    assert "".join(pieces) == tok.decode(prompt + gen)[len(tok.decode(prompt)) :]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(
        st.one_of(
            st.characters(codec="utf-8"),
            st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
            st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
            st.sampled_from(["\u200d", "\ufe0f", " ", "  ", "\n", "\t", "7", "<|im_end|>", "🇫🇷", "👍🏽", "é"]),
        ),
        max_size=40,
    ).map("".join),
    chunks=st.lists(st.integers(min_value=1, max_value=4), max_size=80),
    skip=st.booleans(),
)
def test_stream_property_random_text(tok, text, chunks, skip):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=skip)
    pieces, _ = _stream(tok, ids, chunks, skip_special_tokens=skip)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)


def test_stream_random_ids(tok):
    """Arbitrary ids (byte tokens that form invalid UTF-8 included) still add up to the full decode."""
    rng = random.Random(7)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.id_to_token(i)) == 1]  # one byte each
    assert len(byte_tokens) > 200
    for trial in range(300):
        pool = byte_tokens if trial % 2 else None
        n = rng.randrange(1, 60)
        ids = [rng.choice(pool) if pool else rng.randrange(tok.vocab_size) for _ in range(n)]
        chunks = [rng.randrange(1, 5) for _ in range(n)]
        skip = rng.random() < 0.3
        kwargs = {"max_pending": rng.choice([4, 16]), "context": rng.randrange(1, 5)}
        pieces, _ = _stream(tok, ids, chunks, skip_special_tokens=skip, **kwargs)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


def test_stream_of_invalid_bytes_stays_bounded(tok):
    """A stream that never forms valid UTF-8 is still released piece by piece, in bounded memory."""
    rng = random.Random(3)
    high_bytes = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    ids = [rng.choice(high_bytes) for _ in range(5000)]
    detok = IncrementalDetokenizer(tok, max_pending=16, context=4)
    out, largest = [], 0
    start = time.perf_counter()
    for i in ids:
        out.append(detok.add(i))
        largest = max(largest, detok.window_size)
    out.append(detok.flush())
    elapsed = time.perf_counter() - start
    assert "".join(out) == tok.decode(ids)
    assert largest <= 4 + 16 + 1
    assert elapsed < 5.0


def test_stream_accepts_array_like_ids(tok):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    ids = tok.encode("東京 😀 ok")
    detok = IncrementalDetokenizer(tok)
    out = [detok.add(np.int64(ids[0])), detok.add(torch.tensor(ids[1])), detok.add(np.array(ids[2:4]))]
    out += [detok.add(torch.tensor(ids[4:])), detok.flush()]
    assert "".join(out) == tok.decode(ids)
