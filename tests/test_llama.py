"""Our hand-written Llama against `transformers` on the same weights."""

import pytest
import torch

from conftest import PROMPTS, assert_argmax_near, make_tiny_llama
from labkit.models.llama import KVCache, LayerWeights, grouped_attention, shallow_copy


# The largest logit difference allowed between two float32 computations of this model (ours and
# transformers', or a cached and an uncached pass): float32 sums in other orders. The argmax is
# compared under the near-tie rule with twice this as its tolerance.
LOGIT_ERROR = 1e-3


def _ids(model, text):
    return torch.tensor([model.tokenizer.encode(text)])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(model, reference, prompt):
    ids = _ids(model, prompt)
    ours = model(ids)
    with torch.no_grad():
        theirs = reference(ids).logits
    assert ours.shape == (1, ids.shape[1], model.config.vocab_size)
    assert (ours - theirs).abs().max().item() <= LOGIT_ERROR
    assert_argmax_near(theirs, ours, LOGIT_ERROR, what="labkit's logits against transformers'")


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
    assert (stepwise - full).abs().max().item() <= LOGIT_ERROR
    assert_argmax_near(full, stepwise, LOGIT_ERROR, what="cached steps against one full pass")


def naive_grouped_attention(q, k, v, q_start, window=None, scale=None):
    """Reference: each KV head copied `group` times (what we avoid), the scores materialised
    and the causal (and window) mask written out as -inf."""
    batch, kv_heads, group, steps, dim = q.shape
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.reshape(batch, kv_heads * group, steps, dim) @ k_rep.transpose(-1, -2)
    scores = scores * (dim ** -0.5 if scale is None else scale)
    i = torch.arange(q_start, q_start + steps)[:, None]
    j = torch.arange(k.shape[2])[None, :]
    hidden = (j > i) | ((j <= i - window) if window is not None else torch.zeros_like(j > i))
    expected = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v_rep
    return expected.reshape(q.shape)


@pytest.mark.parametrize("steps, q_start", [(5, 0), (3, 5), (1, 7)], ids=["prompt", "chunk", "decode"])
def test_grouped_attention_equals_repeated_kv_heads(steps, q_start):
    torch.manual_seed(0)
    batch, kv_heads, group, dim = 2, 3, 3, 8
    q = torch.randn(batch, kv_heads, group, steps, dim)
    k = torch.randn(batch, kv_heads, q_start + steps, dim)
    v = torch.randn(batch, kv_heads, q_start + steps, dim)
    ours = grouped_attention(q, k, v, q_start=q_start)
    assert torch.allclose(ours, naive_grouped_attention(q, k, v, q_start), atol=1e-5)


def test_a_prompt_attends_through_the_causal_kernel_without_a_mask(monkeypatch):
    """The guard for chapter 8's finding: a whole prompt handed SDPA as an explicit mask costs
    2.3-2.7x the causal flag at 2,048-4,096 tokens; it must take the flag, with K/V unrepeated."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 3, 3, 16, 8), torch.randn(1, 3, 16, 8)
    grouped_attention(q, k, k, q_start=0)
    (query_heads, kv_heads, kwargs), = calls
    assert (query_heads, kv_heads) == (9, 3) and kwargs.get("enable_gqa") is True
    assert kwargs.get("is_causal") is True and kwargs.get("attn_mask") is None


def test_queries_must_end_at_the_last_key():
    q, k = torch.randn(1, 3, 3, 2, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="must end at the last"):
        grouped_attention(q, k, k, q_start=0)


def test_parameter_count_matches_reference(model, reference):
    assert model.num_parameters() == reference.num_parameters() == 134_515_008


def test_weights_are_64_byte_aligned(model):
    tensors = [model.embed, model.final_norm] + [t for layer in model.layers
                                                for t in layer.weights().values()]
    assert all(t.data_ptr() % 64 == 0 for t in tensors)


def test_weights_are_parameters_buffers_and_state(model):
    layer_keys = [f"layers.{i}.{n}" for i in range(model.config.num_layers) for n in LayerWeights.WEIGHTS]
    assert sorted(model.state_dict()) == sorted(["embed", "lm_head", "final_norm"] + layer_keys)
    assert model.lm_head is model.embed  # tied: one Parameter under two names ...
    assert len(list(model.parameters())) == 2 + len(layer_keys)  # ... listed once
    assert sum(p.numel() for p in model.parameters()) == model.num_parameters()
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in model.parameters())
    assert [n for n, _ in model.named_buffers()] == ["rope_cos", "rope_sin"]


def test_to_bfloat16_converts_everything_and_keeps_the_tie():
    model = make_tiny_llama(seed=1)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    want = model(ids)
    copy = shallow_copy(model)
    assert model.to(torch.bfloat16) is model and model.dtype == torch.bfloat16
    tensors = list(model.parameters()) + list(model.buffers())
    assert len(tensors) == 2 + 2 + 6 * model.config.num_layers  # embed, final_norm, rope tables
    assert all(t.dtype == torch.bfloat16 for t in tensors)
    assert model.lm_head is model.embed and model._parameters["lm_head"] is model.embed
    assert model.new_cache(1, 8).keys.dtype == torch.bfloat16
    out = model(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - want).abs().max() < 0.1 * want.abs().max()
    # a copy made before keeps its own float32 tensors (and the reverse: see below)
    assert copy.dtype == torch.float32 and copy.layers[0].qkv.dtype == torch.float32
    assert torch.equal(copy(ids), want)
    small = shallow_copy(copy, 1).to(torch.bfloat16)
    assert small.lm_head is small.embed and small.layers[0].down.dtype == torch.bfloat16
    assert copy.dtype == torch.float32 and copy.layers[0].down.dtype == torch.float32


def test_packed_copy_leaves_the_original_layers_alone():
    from labkit.kernels.packed import PackedLinear, available, pack_model

    model = make_tiny_llama(seed=2)
    if not available(model.embed):
        pytest.skip("no oneDNN in this torch")
    before = [dict(layer.weights()) for layer in model.layers]
    layers, embed = list(model.layers), model.embed
    packed = pack_model(model)
    assert packed is not model and isinstance(packed.layers[0].qkv, PackedLinear)
    assert isinstance(packed.lm_head, PackedLinear) and packed.embed is embed
    assert list(model.layers) == layers and model.lm_head is model.embed is embed
    for layer, weights in zip(model.layers, before, strict=True):
        assert all(getattr(layer, n) is w and type(w) is torch.nn.Parameter for n, w in weights.items())
    assert sorted(model.state_dict()) == sorted(shallow_copy(model).state_dict())
    assert packed.layers[0].qkv.weight is model.layers[0].qkv  # shared, not copied


def test_layer_replaced_and_slot_assignment():
    model = make_tiny_llama(seed=3)
    layer = model.layers[0]
    doubled = layer.replaced(down=layer.down * 2)
    assert doubled is not layer and doubled.qkv is layer.qkv and torch.equal(doubled.down, 2 * layer.down)
    assert isinstance(doubled.down, torch.nn.Parameter) and not doubled.down.requires_grad
    module = torch.nn.Identity()
    swapped = layer.replaced(qkv=module)
    assert swapped.qkv is module and "qkv" not in dict(swapped.named_parameters())
    assert isinstance(layer.qkv, torch.nn.Parameter)  # the original keeps its tensor
    with pytest.raises(TypeError):
        layer.replaced(bias=layer.down)
    copy = shallow_copy(model)
    copy.lm_head = module  # a module in place of the tied head, on the copy only
    assert copy.lm_head is module and copy.embed is model.embed and model.lm_head is model.embed
    copy.lm_head = copy.embed  # and back: tied again
    assert copy.lm_head is copy.embed and "lm_head" not in copy._modules


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
        assert (ours - theirs).abs().max().item() <= LOGIT_ERROR
        assert_argmax_near(theirs, ours, LOGIT_ERROR, what="labkit's GGUF loading against transformers'")
