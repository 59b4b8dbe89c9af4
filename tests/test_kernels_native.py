"""labkit's C kernels against PyTorch: the matrix-vector product against F.linear, paged
attention (decode rows, whole prompts, prompt chunks after a cached prefix, all packed in
one call) against gathering each sequence's blocks and calling SDPA; bad tables and tiles
are refused before the kernel reads anything; without a compiler everything falls back."""

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
    with pytest.raises(ValueError, match="table row"):
        native.paged_decode_attention(keys, values, tables[:2], lengths, q)
    with pytest.raises(ValueError, match="contiguous"):
        native.paged_decode_attention(keys.transpose(2, 3), values, tables, lengths, q)


def packed_case(seed, block_size, kv_heads, group, dim, segments, blocks=64, spread=1.0):
    """A pool, tables and packed query rows for `segments` of (new rows, cached positions
    before them): decode rows (1, n), whole prompts (n, 0), chunks after a prefix (n, m)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, kv_heads, dim, block_size, generator=g)
    values = torch.randn(blocks, kv_heads, block_size, dim, generator=g)
    width = max(-(-(n + start) // block_size) for n, start in segments)
    tables = torch.randint(0, blocks, (len(segments), width), generator=g)
    rows = sum(n for n, _ in segments)
    q = torch.randn(rows, kv_heads, group, dim, generator=g) * spread
    spans, row = [], 0
    for b, (n, start) in enumerate(segments):
        spans.append((b, row, n, start))
        row += n
    return keys, values, tables, spans, q


def reference_packed(keys, values, tables, spans, q):
    """Each segment alone: gather its blocks, then causal SDPA with the query rows placed
    after their cached prefix (an explicit mask: row i sees positions 0 .. start + i)."""
    kv_heads, dim = keys.shape[1], keys.shape[2]
    out = torch.empty_like(q)
    for b, row, n, start in spans:
        k = keys[tables[b]].permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :start + n]
        v = values[tables[b]].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :start + n]
        qq = q[row:row + n].permute(1, 2, 0, 3)  # [kv_heads, group, n, D]
        mask = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(qq, k[:, None], v[:, None], attn_mask=mask)
        out[row:row + n] = o.permute(2, 0, 1, 3)
    return out


@pytest.mark.parametrize("block_size, kv_heads, group, dim", [(16, 3, 3, 64), (4, 2, 1, 8), (1, 1, 4, 16), (8, 4, 2, 12)])
@pytest.mark.parametrize("tile_rows", [1, 5, 16])
def test_paged_attention_of_a_packed_step_equals_sdpa_per_sequence(block_size, kv_heads, group, dim, tile_rows):
    # Decode rows, whole prompts and chunks after a cached prefix, packed in one step; the
    # prefixes start and end inside blocks as well as on their edges.
    segments = [(1, 40), (37, 0), (1, 0), (20, 19), (block_size, block_size), (3, 61), (1, 7)]
    keys, values, tables, spans, q = packed_case(dim + group, block_size, kv_heads, group, dim, segments)
    tiles = native.tiles_for(spans, tile_rows)
    got = native.paged_attention(keys, values, tables, tiles, q)
    torch.testing.assert_close(got, reference_packed(keys, values, tables, spans, q), rtol=1e-5, atol=2e-6)


def test_paged_attention_with_peaked_softmax_over_long_prompts():
    segments = [(130, 0), (77, 50), (1, 200)]
    keys, values, tables, spans, q = packed_case(9, 16, 3, 3, 64, segments, spread=6.0)
    got = native.paged_attention(keys, values, tables, native.tiles_for(spans), q)
    torch.testing.assert_close(got, reference_packed(keys, values, tables, spans, q), rtol=1e-4, atol=1e-5)


def test_tiles_cut_segments_and_bad_tiles_are_refused():
    assert native.tiles_for([(0, 0, 5, 3), (1, 5, 1, 9)], tile_rows=2).tolist() == [
        [0, 0, 2, 3], [0, 2, 2, 5], [0, 4, 1, 7], [1, 5, 1, 9]]
    keys, values, tables, spans, q = packed_case(2, 4, 2, 2, 8, [(6, 0), (1, 5)], blocks=8)
    tiles = native.tiles_for(spans, 4)  # rows 0-3, 4-5 of sequence 0; row 6 of sequence 1
    cases = {
        "table row": [[0, 0, 4, 0], [0, 4, 2, 4], [2, 6, 1, 5]],
        "exactly once": [[0, 0, 4, 0], [0, 3, 2, 3], [1, 6, 1, 5]],
        "capacity": [[0, 0, 4, 0], [0, 4, 2, 4], [1, 6, 1, 4 * tables.shape[1]]],
        "at least one row": [[0, 0, 4, 0], [0, 4, 0, 4], [0, 4, 2, 4], [1, 6, 1, 5]],
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            native.paged_attention(keys, values, tables, torch.tensor(bad), q)
    bad_table = tables.clone()
    bad_table[0, 0] = -1
    with pytest.raises(ValueError, match="block id"):
        native.paged_attention(keys, values, bad_table, tiles, q)


def test_a_tile_too_big_for_the_kernels_scratch_is_refused(monkeypatch):
    keys, values, tables, spans, q = packed_case(3, 4, 2, 2, 8, [(6, 0)], blocks=8)
    monkeypatch.setattr(native, "TILE_SCRATCH_BYTES", 5 * 2 * (2 * 8 + 4) * 4)  # five rows' worth
    native.paged_attention(keys, values, tables, native.tiles_for(spans, 5), q)
    with pytest.raises(ValueError, match="scratch"):
        native.paged_attention(keys, values, tables, native.tiles_for(spans, 6), q)


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
