"""The KV-head experiments of chapter 21: cache arithmetic, GQA kernels, pooling, MLA."""

import pytest
import torch
import torch.nn.functional as F

from labkit.experiments.kv_heads import (
    LatentAttention,
    LatentCache,
    MLAShape,
    absorb,
    context_bytes_table,
    context_cache_bytes,
    gqa_inputs,
    gqa_read_once,
    gqa_repeat_kv,
    gqa_runners,
    kv_bytes_per_token,
    llama_parameters,
    merge_groups,
    mla_absorbed,
    mla_decode_runners,
    mla_naive,
    pool_kv_heads,
    read_once_bytes_moved,
    repeat_buffers,
    repeat_kv_bytes_moved,
    sequences_that_fit,
)
from labkit.models.window_cache import RollingKVCache


@pytest.fixture(scope="module")
def gemma_config():
    from labkit.models import load_model

    return load_model("gemma3-270m").config


# -- the arithmetic -----------------------------------------------------------------------

def test_smollm2_bytes_per_token(model):
    c = model.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (30, 3, 64)
    assert kv_bytes_per_token(c) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(c, dtype_bytes=2) == 23_040
    # no windows: rolling changes nothing, and the cache is linear in the context
    assert context_cache_bytes(c, 1000, rolling=True) == context_cache_bytes(c, 1000) == 46_080_000
    assert model.new_cache(1, 16).nbytes(1) == kv_bytes_per_token(c)
    assert sequences_that_fit(2**30, 2048, c) == 2**30 // (2048 * 46_080) == 11


def test_llama_parameters_from_the_config(model):
    from conftest import make_tiny_llama

    # the closed form against the tensors really loaded (SmolLM2) and a tiny random model
    assert llama_parameters(model.config) == model.num_parameters() == 134_515_008
    tiny = make_tiny_llama(heads=8, kv_heads=4)
    assert llama_parameters(tiny.config) == tiny.num_parameters()
    # Llama-3.2-3B's published config: the model card's 3.21B parameters
    from labkit.models.gguf_file import LlamaConfig

    llama3b = LlamaConfig(vocab_size=128_256, hidden_size=3072, intermediate_size=8192,
                          num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
                          rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=131_072)
    assert round(llama_parameters(llama3b) / 1e9, 2) == 3.21
    assert kv_bytes_per_token(llama3b, dtype_bytes=2) == 112 * 1024


@pytest.mark.slow
def test_gemma_full_and_rolling_bytes(gemma_config):
    c = gemma_config
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (18, 1, 256)
    local = sum(w is not None for w in c.layer_windows)
    assert local == 15 and set(w for w in c.layer_windows if w is not None) == {512}
    assert kv_bytes_per_token(c) == 2 * 18 * 1 * 256 * 4 == 36_864
    # within the window, rolling keeps everything; past it, 15 layers stop growing
    assert context_cache_bytes(c, 512, rolling=True) == context_cache_bytes(c, 512) == 512 * 36_864
    n = 4096
    per_layer_position = 2 * 256 * 4
    assert context_cache_bytes(c, n) == n * 36_864
    assert context_cache_bytes(c, n, rolling=True) == per_layer_position * (3 * n + 15 * 512)
    # the ring the engine really allocates holds exactly that many bytes
    for context in (100, 1024):
        assert RollingKVCache(c, 1, context).nbytes() == context_cache_bytes(c, context, rolling=True)
    assert sequences_that_fit(2**30, n, c, rolling=True) == 2**30 // (per_layer_position * (3 * n + 15 * 512))
    assert sequences_that_fit(2**30, n, c, rolling=True) > sequences_that_fit(2**30, n, c)
    table = context_bytes_table(c, [256, 8192])
    assert table[0].saving == 1.0 and table[1].saving == pytest.approx(18 * 8192 / (3 * 8192 + 15 * 512))


# -- two grouped-query kernels ------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [1, 3, 9])
def test_gqa_kernels_equal_sdpa(kv_heads):
    x = gqa_inputs(batch=2, q_heads=9, kv_heads=kv_heads, context=37, head_dim=64, seed=kv_heads)
    assert x.q.shape == (2, 9, 64) and x.k.shape == (2, kv_heads, 37, 64) and x.group == 9 // kv_heads
    expected = F.scaled_dot_product_attention(x.q[:, :, None], x.k, x.v, enable_gqa=True)[:, :, 0]
    for kernel in (gqa_repeat_kv, gqa_read_once):
        out = kernel(x.q, x.k, x.v)
        assert out.shape == (2, 9, 64)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # and against attention written out in float64, head h reading KV head h // group
    q, k, v = (t.double() for t in (x.q, x.k, x.v))
    head_to_kv = torch.arange(9) // (9 // kv_heads)
    scores = torch.einsum("bhd,bhsd->bhs", q, k[:, head_to_kv]) / 8.0
    exact = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v[:, head_to_kv])
    torch.testing.assert_close(gqa_read_once(q, k, v), exact, atol=1e-12, rtol=1e-12)


def test_gqa_runners_run_the_kernels():
    x = gqa_inputs(1, 8, 2, 5, 4, seed=3)
    runners = gqa_runners(x)
    assert list(runners) == ["repeat, fresh memory", "repeat, reused memory", "read once"]
    expected = gqa_read_once(x.q, x.k, x.v)
    for run in runners.values():
        torch.testing.assert_close(run(), expected, atol=1e-6, rtol=1e-6)


def test_repeat_into_reused_buffers_writes_the_copy_there():
    x = gqa_inputs(2, 9, 3, 11, 8, seed=4)
    keys, values = repeat_buffers(x)
    assert keys.shape == values.shape == (2, 9, 11, 8)
    expected = F.scaled_dot_product_attention(x.q[:, :, None], x.k, x.v, enable_gqa=True)[:, :, 0]
    for _ in range(2):  # the second step writes over the first step's copy
        out = gqa_repeat_kv(x.q, x.k, x.v, (keys, values))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the buffers hold what repeat_kv would have returned: query head h's copy of KV head h // 3
    torch.testing.assert_close(keys, x.k.repeat_interleave(3, dim=1), atol=0, rtol=0)
    torch.testing.assert_close(values, x.v.repeat_interleave(3, dim=1), atol=0, rtol=0)


def test_repeat_copies_nothing_with_one_kv_head_per_query_head(monkeypatch):
    # transformers' repeat_kv returns its input at n_rep == 1; so does ours, and no buffer is made
    from transformers.models.llama.modeling_llama import repeat_kv

    x = gqa_inputs(1, 4, 4, 6, 8, seed=5)
    assert repeat_kv(x.k, 1) is x.k and repeat_buffers(x) is None
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(k)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    gqa_repeat_kv(x.q, x.k, x.v)
    assert seen[0] is x.k  # the cached keys themselves reach attention, not a copy


def test_gqa_inputs_need_a_divisor():
    for kv_heads in (2, 4, 5, 6, 7, 8):
        with pytest.raises(ValueError):
            gqa_inputs(1, 9, kv_heads, 4, 8)
    with pytest.raises(ValueError):
        repeat_kv_bytes_moved(1, 9, 2, 4, 8)


def test_bytes_moved():
    cache = 2 * 4 * 3 * 1000 * 64 * 4
    small = 2 * 4 * 9 * 64 * 4
    once = read_once_bytes_moved(4, 9, 3, 1000, 64)
    repeat = repeat_kv_bytes_moved(4, 9, 3, 1000, 64)
    assert (once.cache_read, once.copy_written, once.copy_read, once.total) == (cache, 0, 0, cache + small)
    assert repeat.cache_read == cache and repeat.copy_written == repeat.copy_read == 3 * cache
    assert repeat.total == 7 * cache + small  # 1 + 2 x group times the cache
    # with as many KV heads as query heads nothing is copied: the step reads the cache only
    mha_once, mha_repeat = read_once_bytes_moved(1, 9, 9, 10, 64), repeat_kv_bytes_moved(1, 9, 9, 10, 64)
    assert mha_repeat.copy_written == mha_repeat.copy_read == 0 and mha_repeat == mha_once
    # a copy really is made: the repeated tensor's storage is the group times the cache
    x = gqa_inputs(1, 9, 3, 16, 8)
    assert x.k.repeat_interleave(3, dim=1).untyped_storage().nbytes() == 3 * x.k.untyped_storage().nbytes()


# -- fewer KV heads by pooling ------------------------------------------------------------

def test_merge_groups():
    assert merge_groups(3, 1) == [[0, 1, 2]]
    assert merge_groups(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        merge_groups(3, 2)


def _repeated_means(model, new_kv_heads):
    """The independent construction: the original model, its KV head count kept, each KV
    head's key and value rows replaced by the mean over its merge group (written with
    explicit loops). Query head h then sees exactly the key and value the pooled model's
    head h // new_group gives it."""
    from labkit.models.llama import shallow_copy

    c = model.config
    size = c.num_kv_heads // new_kv_heads
    d, q_rows = c.head_dim, c.num_heads * c.head_dim
    copy = shallow_copy(model)
    layers = []
    for layer in model.layers:
        w = layer.qkv.detach().clone()
        for part in (0, 1):  # keys, then values
            base = q_rows + part * c.num_kv_heads * d
            rows = [w[base + i * d: base + (i + 1) * d].clone() for i in range(c.num_kv_heads)]
            for i in range(c.num_kv_heads):
                first = (i // size) * size
                w[base + i * d: base + (i + 1) * d] = sum(rows[first:first + size]) / size
        layers.append(layer.replaced(qkv=w))
    copy.layers = layers
    return copy


@pytest.fixture(scope="module")
def few_tokens(model):
    return torch.tensor([model.tokenizer.encode("The cache holds one key and one value per head.")[:12]])


def test_pooling_a_tiny_model_four_kv_heads_to_two():
    """SmolLM2's 3 KV heads pool only to 1 (every head merges, so the merge order cannot
    show); 4 heads into 2 is where pairing the wrong heads would."""
    from conftest import make_tiny_llama

    tiny = make_tiny_llama(heads=8, kv_heads=4)
    ids = torch.tensor([[5, 17, 3, 88, 41, 2, 60]])
    pooled = pool_kv_heads(tiny, 2)
    assert pooled.config.num_kv_heads == 2 and tiny.config.num_kv_heads == 4
    out = pooled(ids)
    assert (out - tiny(ids)).abs().max() > 1e-3
    torch.testing.assert_close(out, _repeated_means(tiny, 2)(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_pooling_unchanged_is_identity(model, few_tokens):
    before = model(few_tokens)
    same = pool_kv_heads(model, model.config.num_kv_heads)
    assert same.config == model.config
    torch.testing.assert_close(same(few_tokens), before, atol=0, rtol=0)


@pytest.mark.slow
def test_pooling_to_one_kv_head(model, few_tokens):
    c = model.config
    original_qkv = model.layers[0].qkv.detach().clone()
    before = model(few_tokens)
    pooled = pool_kv_heads(model, 1)
    assert pooled.config.num_kv_heads == 1 and pooled.config.group_size == 9
    assert pooled.layers[0].qkv.shape == ((9 + 2) * 64, c.hidden_size)
    assert pooled.new_cache(1, 8).nbytes(1) * 3 == model.new_cache(1, 8).nbytes(1)
    after = pooled(few_tokens)
    assert (after - before).abs().max() > 0.1  # the logits do change
    # ... exactly as the independent construction says they should
    reference = _repeated_means(model, 1)(few_tokens)
    torch.testing.assert_close(after, reference, atol=2e-4, rtol=1e-4)
    # and the original is untouched
    assert model.config.num_kv_heads == 3
    assert torch.equal(model.layers[0].qkv, original_qkv)
    torch.testing.assert_close(model(few_tokens), before, atol=0, rtol=0)
    # the pooled model decodes through its (smaller) cache like any other
    cache = pooled.new_cache(1, 16)
    pooled(few_tokens[:, :-1], cache=cache)
    torch.testing.assert_close(pooled(few_tokens[:, -1:], cache=cache)[0, -1], after[0, -1],
                               atol=2e-4, rtol=1e-4)


# -- multi-head latent attention ----------------------------------------------------------

SHAPE = MLAShape(d_model=48, n_heads=4, head_dim=16, kv_lora_rank=12, rope_dim=8)


def test_mla_cache_bytes():
    assert SHAPE.cache_bytes_per_token() == (12 + 8) * 4
    assert SHAPE.mha_cache_bytes_per_token() == 2 * 4 * 16 * 4
    # DeepSeek-V2's own sizes: d_c = 4 d_h, d_h^R = d_h / 2, 128 heads of 128
    big = MLAShape(d_model=5120, n_heads=128, head_dim=128, kv_lora_rank=512, rope_dim=64)
    assert big.cache_bytes_per_token(2) == 576 * 2
    assert big.mha_cache_bytes_per_token(2) / big.cache_bytes_per_token(2) == pytest.approx(56.9, abs=0.1)
    cache = LatentCache.empty(SHAPE, 2, 10)
    cache.length = 3
    assert cache.nbytes() == 2 * 3 * SHAPE.cache_bytes_per_token()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_mla_absorbed_equals_naive_over_decode_steps(dtype, tol):
    layer = LatentAttention.random(SHAPE, seed=1, dtype=dtype)
    absorbed = absorb(layer)
    xs = torch.randn(9, 3, SHAPE.d_model, generator=torch.Generator().manual_seed(2), dtype=dtype)
    naive_cache, absorbed_cache = LatentCache.empty(SHAPE, 3, 9, dtype), LatentCache.empty(SHAPE, 3, 9, dtype)
    for x in xs:  # the latent caches grow by one token a step
        a = mla_naive(layer, x, naive_cache)
        b = mla_absorbed(layer, x, absorbed_cache, absorbed)
        assert a.shape == (3, SHAPE.d_model)
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    assert naive_cache.length == 9 and torch.equal(naive_cache.latents, absorbed_cache.latents)


def test_mla_naive_matches_transformers_deepseek_v2():
    """Our naive path, step by step, against transformers' DeepseekV2Attention over the
    whole sequence with a causal mask, the weights copied into its layout."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2Attention, DeepseekV2RotaryEmbedding)

    s = SHAPE
    config = DeepseekV2Config(
        vocab_size=32, hidden_size=s.d_model, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=s.n_heads, num_key_value_heads=s.n_heads,
        q_lora_rank=None, kv_lora_rank=s.kv_lora_rank, qk_nope_head_dim=s.head_dim,
        qk_rope_head_dim=s.rope_dim, v_head_dim=s.head_dim, attention_bias=False,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta})
    config._attn_implementation = "eager"
    attention = DeepseekV2Attention(config, layer_idx=0).eval()
    layer = LatentAttention.random(s, seed=3)
    with torch.no_grad():
        # q_proj rows: per head, content then RoPE; kv_a rows: latent then RoPE key;
        # kv_b rows: per head, key then value
        per_head_q = torch.cat([layer.w_q.view(s.n_heads, s.head_dim, -1),
                                layer.w_qr.view(s.n_heads, s.rope_dim, -1)], dim=1)
        attention.q_proj.weight.copy_(per_head_q.reshape(-1, s.d_model))
        attention.kv_a_proj_with_mqa.weight.copy_(torch.cat([layer.w_dkv, layer.w_kr]))
        attention.kv_a_layernorm.weight.copy_(layer.latent_norm)
        attention.kv_a_layernorm.variance_epsilon = s.norm_eps
        per_head_kv = torch.cat([layer.w_uk.view(s.n_heads, s.head_dim, -1),
                                 layer.w_uv.view(s.n_heads, s.head_dim, -1)], dim=1)
        attention.kv_b_proj.weight.copy_(per_head_kv.reshape(-1, s.kv_lora_rank))
        attention.o_proj.weight.copy_(layer.w_o)
    assert attention.scaling == pytest.approx(s.scale)
    steps, batch = 7, 2
    x = torch.randn(batch, steps, s.d_model, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(steps)[None].expand(batch, -1)
    freqs = DeepseekV2RotaryEmbedding(config)(x, positions)
    mask = torch.full((steps, steps), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = attention(x, attention_mask=mask, position_embeddings=freqs)
    cache = LatentCache.empty(s, batch, steps)
    ours = torch.stack([mla_naive(layer, x[:, t], cache) for t in range(steps)], dim=1)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_mla_decode_runners_repeat_one_step():
    layer = LatentAttention.random(SHAPE, seed=5, dtype=torch.float64)
    runners = mla_decode_runners(layer, context=11, batch=2, seed=6)
    assert list(runners) == ["naive", "absorbed"]
    first = runners["naive"]()
    assert first.shape == (2, SHAPE.d_model)
    # every call is the same step: same position, same cache length afterwards
    torch.testing.assert_close(runners["naive"](), first, atol=0, rtol=0)
    torch.testing.assert_close(runners["absorbed"](), first, atol=1e-12, rtol=1e-12)
