"""Gemma 3 270M: our dequantized cache against the GGUF, our forward pass against `transformers`.

The prompts are token ids (Gemma's tokenizer, read by transformers from the same GGUF; the
text is beside each), so these tests do not depend on labkit's tokenizer. The reference is
transformers reading the GGUF itself (about 45 s to load, once for the module).
"""

import numpy as np
import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from conftest import assert_argmax_near, assert_greedy_near, greedy_reference_scores
from labkit.models import registry
from labkit.models.gemma3 import hf_name
from labkit.models.window_cache import windowed_attention

BOS = 2
PROMPTS = {
    "The capital of France is": [BOS, 818, 5279, 529, 7001, 563],
    "def fibonacci(n):\\n    if n < 2:\\n        return n\\n": [
        BOS, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 584, 538, 655, 236743, 236778,
        236787, 107, 144, 2060, 538, 107],
    "Les modèles de langage prédisent le prochain mot. 東京は日本の首都です。": [
        BOS, 15192, 90672, 569, 158604, 8399, 2763, 533, 674, 89183, 2417, 236761, 86459,
        237048, 76444, 120211, 3652, 236924],
    "1, 2, 3, 5, 8, 13, 21,": [
        BOS, 236770, 236764, 236743, 236778, 236764, 236743, 236800, 236764, 236743, 236810,
        236764, 236743, 236828, 236764, 236743, 236770, 236800, 236764, 236743, 236778, 236770,
        236764],
}
# "An inference engine takes a trained model and a request, and it must decide which tokens
# to compute next, keep the keys and values of earlier tokens in a cache, and stream the
# answer back." (39 tokens) over and over: the long prompts run past the 512-token window.
PARAGRAPH = [2267, 34711, 3958, 4716, 496, 15453, 2028, 532, 496, 2864, 236764, 532, 625, 1921,
             10741, 837, 21739, 531, 16333, 2148, 236764, 2514, 506, 13272, 532, 2979, 529, 6517,
             21739, 528, 496, 15612, 236764, 532, 6381, 506, 3890, 1063, 236761]


# The largest logit difference allowed between our forward pass and transformers' on the same
# weights (float32 sums in other orders; held below): the near-tie rule's tolerance is twice it.
GEMMA_LOGIT_ERROR = 1e-3


def long_prompt(length: int) -> list[int]:
    return ([BOS] + PARAGRAPH * (length // len(PARAGRAPH) + 1))[:length]


@pytest.fixture(scope="module")
def gemma():
    from labkit.models import load_model

    return load_model("gemma3-270m", with_tokenizer=False)


@pytest.fixture(scope="module")
def reader():
    from labkit.models.gguf_file import open_reader

    return open_reader(registry.fetch("gemma3-270m"))


@pytest.fixture(scope="module")
def hf_gemma():
    from labkit.models.reference import load_reference_from_gguf

    return load_reference_from_gguf("gemma3-270m")


# -- the GGUF and our cache ------------------------------------------------------------------
def test_config_reads_the_gguf_and_transformers_defaults(gemma, reader):
    from labkit.models.gguf_file import field_value

    c = gemma.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (18, 640, 2048, 262_144)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 1, 256)
    assert [i for i, window in enumerate(c.layer_windows) if window is None] == [5, 11, 17]
    assert set(c.layer_windows) == {512, None}
    assert (c.local_rope_theta, c.global_rope_theta) == (10_000.0, 1_000_000.0)
    assert c.attention_scale == 256 ** -0.5
    # Q4_K_M: llama.cpp's file type 15 (LLAMA_FTYPE_MOSTLY_Q4_K_M), as the registry states
    assert registry.get_spec("gemma3-270m").quantization == "Q4_K_M"
    assert field_value(reader, "general.file_type") == 15


def test_cache_holds_the_gguf_tensors_dequantized(reader):
    """Every tensor of our float32 cache is `gguf.quants.dequantize` of the file's bytes,
    less the 1 llama.cpp adds to Gemma's norm weights, and nothing else."""
    import gguf
    from safetensors import safe_open

    from labkit.models.loader import ensure_dequantized

    path, _, _ = ensure_dequantized("gemma3-270m")
    types = set()
    with safe_open(str(path), framework="numpy") as cache:
        assert len(cache.keys()) == len(reader.tensors)
        for t in reader.tensors:
            expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            expected = expected.reshape(tuple(reversed(t.shape.tolist())))
            if t.name.endswith("norm.weight"):
                expected = expected - np.float32(1.0)
            assert np.array_equal(cache.get_tensor(hf_name(t.name)), expected), t.name
            types.add(t.tensor_type.name)
    assert types == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}


# -- attention --------------------------------------------------------------------------------
def test_sliding_window_mask_is_transformers():
    """A query at position i sees keys i - window < j <= i: the mask transformers builds."""
    torch.manual_seed(0)
    steps, window, dim = 12, 4, 8
    q = torch.randn(1, 1, 2, steps, dim)
    k, v = torch.randn(1, 1, steps, dim), torch.randn(1, 1, steps, dim)
    positions = torch.arange(steps)
    mask = sliding_window_causal_mask_function(window)(
        torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])
    assert mask.sum(-1).tolist() == [1, 2, 3] + [window] * (steps - 3)
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * 0.3
    expected = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.unsqueeze(2)
    assert torch.allclose(windowed_attention(q, k, v, 0, window, 0.3), expected, atol=1e-6)
    # decode: the last query alone, against every cached key, sees the same window
    last = windowed_attention(q[..., -1:, :], k, v, steps - 1, window, 0.3)
    assert torch.allclose(last, expected[..., -1:, :], atol=1e-6)
    # a chunk after cached positions: queries 6..8 over keys 0..8
    chunk = windowed_attention(q[..., 6:9, :], k[:, :, :9], v[:, :, :9], 6, window, 0.3)
    assert torch.allclose(chunk, expected[..., 6:9, :], atol=1e-6)
    # a window wider than the prompt hides nothing (the causal kernel's path): plain causal
    causal = scores.masked_fill(positions[None, :] > positions[:, None], float("-inf"))
    wide = windowed_attention(q, k, v, 0, steps, 0.3)
    assert torch.allclose(wide, causal.softmax(-1) @ v.unsqueeze(2), atol=1e-6)


def test_kv_cache_across_the_window_equals_full_pass(gemma):
    """Prefill 500 tokens, then decode one at a time past position 512, where the sliding
    window starts to drop keys: the same logits as one pass over the whole sequence."""
    ids = torch.tensor([long_prompt(530)])
    full = gemma(ids, rows=torch.arange(499, 530))
    cache = gemma.new_cache(batch=1, max_len=ids.shape[1])
    pieces = [gemma(ids[:, :500], cache=cache, last_only=True)]
    pieces += [gemma(ids[:, t:t + 1], cache=cache) for t in range(500, 530)]
    assert cache.length == 530
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() <= 1e-3


def test_parameters_are_counted_once(gemma):
    assert gemma.lm_head is gemma.embed
    assert gemma.num_parameters() == 268_098_176
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in gemma.parameters())


# -- against transformers ---------------------------------------------------------------------
@pytest.mark.slow
def test_weights_are_what_transformers_reads(hf_gemma):
    from labkit.models.loader import load_state_dict

    ours, _ = load_state_dict("gemma3-270m")
    theirs = hf_gemma.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [*PROMPTS, "600 tokens"])
def test_logits_match_transformers(gemma, hf_gemma, prompt):
    ids = torch.tensor([PROMPTS.get(prompt) or long_prompt(600)])
    ours = gemma(ids)
    with torch.no_grad():
        theirs = hf_gemma(ids).logits
    assert ours.shape == (1, ids.shape[1], 262_144)
    assert (ours - theirs).abs().max().item() <= GEMMA_LOGIT_ERROR
    assert_argmax_near(theirs, ours, GEMMA_LOGIT_ERROR, what="Gemma's logits against transformers'")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The capital of France is", "500 tokens"])
def test_greedy_decode_matches_transformers_generate(gemma, hf_gemma, prompt):
    """16 greedy steps through our KV cache; from 500 tokens they cross the window's edge.
    Two implementations: equal up to the near-tie rule, the error measured on the shared steps."""
    ids = PROMPTS.get(prompt) or long_prompt(500)
    with torch.no_grad():
        out = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    theirs = out.sequences[0, len(ids):].tolist()
    assert len(theirs) == 16  # no end-of-sequence token on these prompts
    their_scores = torch.log_softmax(torch.cat(out.logits).float(), -1)
    ours, our_scores = greedy_reference_scores(gemma, ids, 16)
    assert_greedy_near([theirs], [ours], [their_scores], GEMMA_LOGIT_ERROR, [our_scores],
                       what="Gemma's greedy decode against transformers'")

