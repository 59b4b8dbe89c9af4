"""Attention paths agree with a float64 reference that repeats KV heads explicitly."""

import math

import pytest
import torch

from conftest import random_qkv as qkv
from labkit.kernels.attention import (causal_mask, decode_attention, naive_attention,

                                      score_tensor_bytes, sdpa_attention)


def reference(q, k, v, causal=True):
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    steps, kv_len = q.shape[2], k.shape[2]
    if causal:
        allowed = torch.ones(steps, kv_len).tril(kv_len - steps).bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


SHAPES = [  # batch, heads, kv_heads, q_len, kv_len
    (2, 4, 4, 9, 9),     # MHA prefill
    (1, 9, 3, 12, 12),   # GQA prefill (SmolLM2's 9/3 heads)
    (2, 9, 3, 1, 17),    # decode-shaped
    (1, 6, 2, 5, 20),    # a chunk of new queries after a cached prefix
]


@pytest.mark.parametrize("impl", [naive_attention, sdpa_attention])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_paths_match_reference_float32(impl, shape, causal):
    q, k, v = qkv(*shape)
    assert torch.allclose(impl(q, k, v, causal=causal).double(), reference(q, k, v, causal),
                          atol=1e-5)


@pytest.mark.parametrize("impl", [naive_attention, sdpa_attention])
def test_paths_match_reference_bfloat16(impl):
    q, k, v = qkv(1, 9, 3, 16, 16, dim=64, dtype=torch.bfloat16)
    err = (impl(q, k, v).double() - reference(q, k, v)).abs().max().item()
    assert err < 2e-2  # bfloat16 keeps 8 bits of mantissa


def test_decode_attention_with_ragged_lengths():
    q, k, v = qkv(3, 9, 3, 1, 24)
    lengths = [24, 10, 1]
    out = decode_attention(q, k, v, lengths)
    for b, n in enumerate(lengths):
        expected = reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=False)
        assert torch.allclose(out[b:b + 1].double(), expected, atol=1e-5)


def test_decode_attention_refuses_several_queries():
    q, k, v = qkv(1, 4, 4, 2, 8)
    with pytest.raises(ValueError):
        decode_attention(q, k, v)


def test_uneven_grouping_is_refused():
    q, k, v = qkv(1, 5, 2, 3, 3)
    with pytest.raises(ValueError, match="evenly"):
        naive_attention(q, k, v)


def test_causal_mask_is_end_aligned():
    mask = causal_mask(2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_score_tensor_bytes_closed_form():
    # The source's example: 16,384 tokens, 12 heads, fp16 -> 6 GiB for one score tensor.
    assert score_tensor_bytes(1, 12, 16384, 16384, torch.float16) == 6 * 2**30
