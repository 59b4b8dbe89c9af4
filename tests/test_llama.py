"""Our hand-written Llama against `transformers` on the same weights."""

import pytest
import torch

from conftest import PROMPTS
from labkit.models.llama import KVCache, grouped_attention


def _ids(model, text):
    return torch.tensor([model.tokenizer.encode(text)])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(model, reference, prompt):
    ids = _ids(model, prompt)
    ours = model(ids)
    with torch.no_grad():
        theirs = reference(ids).logits
    assert ours.shape == (1, ids.shape[1], model.config.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_batch_of_two_matches_each_alone(model):
    a, b = _ids(model, PROMPTS[0])[:, :10], _ids(model, PROMPTS[1])[:, :5]
    b = torch.cat([b, b], dim=1)
    both = model(torch.cat([a, b]))
    assert torch.allclose(both[0], model(a)[0], atol=1e-4)
    assert torch.allclose(both[1], model(b)[0], atol=1e-4)


def test_kv_cache_prefill_then_decode_equals_full_pass(model):
    ids = _ids(model, PROMPTS[0])
    full = model(ids)
    cache = model.new_cache(batch=1, max_len=ids.shape[1])
    split = 7
    pieces = [model(ids[:, :split], cache=cache)]
    for t in range(split, ids.shape[1]):
        pieces.append(model(ids[:, t:t + 1], cache=cache))
    stepwise = torch.cat(pieces, dim=1)
    assert cache.length == ids.shape[1]
    assert (stepwise - full).abs().max().item() <= 1e-3
    assert torch.equal(stepwise.argmax(-1), full.argmax(-1))


def test_grouped_attention_equals_repeated_kv_heads():
    torch.manual_seed(0)
    batch, kv_heads, group, steps, dim = 2, 3, 3, 5, 8
    q = torch.randn(batch, kv_heads, group, steps, dim)
    k = torch.randn(batch, kv_heads, steps, dim)
    v = torch.randn(batch, kv_heads, steps, dim)
    ours = grouped_attention(q, k, v, q_start=0)
    # Reference: copy each KV head `group` times (what we avoid), one head per query head.
    q_heads = q.reshape(batch, kv_heads * group, steps, dim)
    k_rep = k.repeat_interleave(group, dim=1)
    v_rep = v.repeat_interleave(group, dim=1)
    scores = q_heads @ k_rep.transpose(-1, -2) / dim**0.5
    scores = scores.masked_fill(torch.ones(steps, steps).triu(1).bool(), float("-inf"))
    expected = (scores.softmax(-1) @ v_rep).reshape(batch, kv_heads, group, steps, dim)
    assert torch.allclose(ours, expected, atol=1e-5)


def test_parameter_count_matches_reference(model, reference):
    assert model.num_parameters() == reference.num_parameters() == 134_515_008


def test_weights_are_64_byte_aligned(model):
    tensors = [model.embed, model.final_norm] + [t for layer in model.layers
                                                for t in vars(layer).values()]
    assert all(t.data_ptr() % 64 == 0 for t in tensors)


def test_cache_bytes_per_token(model):
    c = model.config
    cache = KVCache.empty(c, batch=1, max_len=4)
    assert cache.nbytes(positions=1) == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def test_too_long_input_is_refused(model):
    with pytest.raises(ValueError, match="RoPE table"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=KVCache(
            torch.zeros(1), torch.zeros(1), length=model.config.max_position_embeddings))


@pytest.mark.slow
def test_our_gguf_loading_matches_transformers_gguf_loading(model):
    """transformers reads the GGUF itself (dequantize + un-permute): an independent loader."""
    from labkit.models.reference import load_reference_from_gguf

    independent = load_reference_from_gguf("smollm2-135m")
    for prompt in PROMPTS[:4]:
        ids = _ids(model, prompt)
        with torch.no_grad():
            theirs = independent(ids).logits
        ours = model(ids)
        assert (ours - theirs).abs().max().item() <= 1e-3
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
