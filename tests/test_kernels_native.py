"""labkit's C decode kernels against PyTorch: the matrix-vector product against F.linear,
paged decode attention against gathering the blocks and calling SDPA; bad tables are
refused before the kernel reads anything; without a compiler everything falls back."""

import pytest
import torch
import torch.nn.functional as F

from labkit.kernels import native

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no C kernels: {native.why_unavailable()}")


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("out_features, in_features", [(7, 5), (96, 64), (300, 1000)])
def test_gemv_equals_linear(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(1, rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    got = native.gemv(x, w)
    assert got.shape == (1, rows, out_features)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_gemv_takes_non_contiguous_input_and_refuses_bad_input():
    w = torch.randn(16, 8)
    x = torch.randn(8, 3)[:, 0]  # strided
    torch.testing.assert_close(native.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        native.gemv(x.double(), w.double())
    with pytest.raises(ValueError, match="features"):
        native.gemv(torch.randn(9), w)


def reference_attention(keys, values, tables, lengths, q):
    """Gather every sequence's blocks, pad to the longest, one SDPA call with a mask."""
    batch, kv_heads, dim = q.shape[0], q.shape[1], q.shape[3]
    k = keys[tables].permute(0, 2, 1, 4, 3).reshape(batch, kv_heads, -1, dim)  # [B, kv_heads, S, D]
    v = values[tables].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, dim)
    mask = torch.arange(k.shape[2])[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


def random_paged(seed, batch, block_size, kv_heads, group, dim, longest, blocks=64, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, kv_heads, dim, block_size, generator=g)
    values = torch.randn(blocks, kv_heads, block_size, dim, generator=g)
    lengths = torch.randint(1, longest + 1, (batch,), generator=g)
    width = -(-int(lengths.max()) // block_size)
    # Tables may share blocks (a shared prefix) and list them in any order.
    tables = torch.randint(0, blocks, (batch, width), generator=g)
    q = torch.randn(batch, kv_heads, group, dim, generator=g) * spread
    return keys, values, tables, lengths, q


@pytest.mark.parametrize("block_size, kv_heads, group, dim", [(16, 3, 3, 64), (4, 2, 1, 8), (1, 1, 4, 16), (8, 4, 2, 12)])
def test_paged_decode_attention_equals_gather_and_sdpa(block_size, kv_heads, group, dim):
    keys, values, tables, lengths, q = random_paged(block_size + dim, 9, block_size, kv_heads, group, dim,
                                                    longest=70)
    lengths[0] = 1  # a one-token context
    got = native.paged_decode_attention(keys, values, tables, lengths, q)
    torch.testing.assert_close(got, reference_attention(keys, values, tables, lengths, q), rtol=1e-5, atol=2e-6)


def test_paged_decode_attention_with_peaked_softmax():
    # Large scores: the weights span exp(-80) .. 1, and the running maximum moves between
    # blocks, which exercises the kernel's exponential and its rescaling.
    keys, values, tables, lengths, q = random_paged(5, 6, 16, 3, 3, 64, longest=200, spread=6.0)
    got = native.paged_decode_attention(keys, values, tables, lengths, q)
    torch.testing.assert_close(got, reference_attention(keys, values, tables, lengths, q), rtol=1e-4, atol=1e-5)


def test_bad_tables_are_refused_before_the_kernel_reads():
    keys, values, tables, lengths, q = random_paged(1, 3, 4, 2, 2, 8, longest=10, blocks=8)
    bad_block = tables.clone()
    bad_block[1, 0] = 8
    with pytest.raises(ValueError, match="block id"):
        native.paged_decode_attention(keys, values, bad_block, lengths, q)
    for bad in (torch.tensor([0, 1, 1]), torch.tensor([1, 1, tables.shape[1] * 4 + 1])):
        with pytest.raises(ValueError, match="length"):
            native.paged_decode_attention(keys, values, tables, bad, q)
    with pytest.raises(ValueError, match="one table row"):
        native.paged_decode_attention(keys, values, tables[:2], lengths, q)
    with pytest.raises(ValueError, match="contiguous"):
        native.paged_decode_attention(keys.transpose(2, 3), values, tables, lengths, q)


def test_without_a_compiler_load_says_why(tmp_path, monkeypatch):
    saved = dict(native._state)
    try:
        native._state.clear()
        monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))  # no kernel built there yet
        monkeypatch.setenv("CC", "no-such-compiler")
        assert native.load() is None
        assert "no-such-compiler" in native.why_unavailable()
        with pytest.raises(RuntimeError, match="unavailable"):
            native.gemv(torch.randn(4), torch.randn(2, 4))
    finally:
        native._state.clear()
        native._state.update(saved)
