"""Pre-packed (oneDNN) weights compute what F.linear computes; a packed model gives the
logits of the plain one; the engine with fast kernels gives the tokens of the reference
path (F.linear, gather + SDPA) and of the plain model's own greedy loop, up to the near-tie
rule (three numerical paths of one model)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_solo_greedy, make_tiny_llama
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.kernels import native
from labkit.kernels.packed import PackedLinear, available, is_packed, pack_model
from labkit.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not available(torch.zeros(1)), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [1, 3, 5, 64])
def test_packed_linear_equals_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(2, rows, 40, generator=g)
    layer = PackedLinear(w)
    assert layer.weight is w and layer.shape == w.shape
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError):  # as F.linear does for mismatched dtypes
        layer(x.double())


def test_the_gemv_cutoff_is_a_setting_with_a_default(monkeypatch):
    monkeypatch.delenv(native.GEMV_ROWS_ENV, raising=False)
    assert native.gemv_max_rows() == native.GEMV_MAX_ROWS
    monkeypatch.setenv(native.GEMV_ROWS_ENV, " 5 ")
    assert native.gemv_max_rows() == 5 and PackedLinear(torch.ones(3, 2)).max_rows == 5
    monkeypatch.setenv(native.GEMV_ROWS_ENV, "0")
    assert native.gemv_max_rows() == 0
    for bad in ("-1", "two", "2.5", "²"):  # a typo must not silently keep the default
        monkeypatch.setenv(native.GEMV_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=native.GEMV_ROWS_ENV):
            native.gemv_max_rows()
    with pytest.raises(ValueError, match="max_rows"):
        PackedLinear(torch.ones(3, 2), max_rows=-1)


def test_rows_up_to_the_cutoff_take_the_c_kernel_and_more_take_onednn(monkeypatch):
    """Each product is routed by its row count: the fake gemv and gemm record who got what;
    a packed model made with another cutoff is another copy, routed by its own cutoff."""
    taken = []

    def fake_gemv(x, weight):
        taken.append(("gemv", x.numel() // x.shape[-1]))
        return F.linear(x, weight)

    real_gemm = PackedLinear.gemm

    def recording_gemm(self, x):
        taken.append(("gemm", x.numel() // x.shape[-1]))
        return real_gemm(self, x)

    monkeypatch.setitem(native._state, "lib", object())  # a (fake) C library is loaded
    monkeypatch.setattr(native, "gemv", fake_gemv)
    monkeypatch.setattr(PackedLinear, "gemm", recording_gemm)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(24, 16, generator=g)
    for cutoff in (0, 1, 3):
        layer = PackedLinear(w, max_rows=cutoff)
        for rows in range(1, 6):
            taken.clear()
            x = torch.randn(1, rows, 16, generator=g)
            torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
            assert taken == [("gemv" if rows <= cutoff else "gemm", rows)], (cutoff, rows)
    model = make_tiny_llama(seed=8)
    two, three = pack_model(model, max_rows=2), pack_model(model, max_rows=3)
    assert two is not three and pack_model(model, max_rows=2) is two
    assert {m.max_rows for m in (two.lm_head, two.layers[0].qkv, three.lm_head)} == {2, 3}
    monkeypatch.setenv(native.GEMV_ROWS_ENV, "3")
    assert pack_model(model) is three  # the default is the setting when the model is packed


def test_pack_model_keeps_the_logits_and_leaves_the_original_alone():
    model = make_tiny_llama(seed=3)
    packed = pack_model(model)
    assert is_packed(packed) and not is_packed(model)
    assert isinstance(model.layers[0].qkv, torch.Tensor) and isinstance(model.lm_head, torch.Tensor)
    assert "lm_head" not in model._modules
    model.lm_head = model.lm_head  # still an ordinary tensor attribute
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-4)
    cache_a, cache_b = model.new_cache(1, 32), packed.new_cache(1, 32)
    for step in (ids[:1, :6], ids[:1, 6:7], ids[:1, 7:8]):  # prefill, then one-row decode steps
        torch.testing.assert_close(packed(step, cache=cache_b), model(step, cache=cache_a), rtol=1e-5, atol=1e-4)


def test_pack_model_is_reused_until_a_weight_changes():
    model = make_tiny_llama(seed=4)
    packed = pack_model(model)
    assert pack_model(model) is packed
    model.layers[1].down = model.layers[1].down * 2
    repacked = pack_model(model)
    assert repacked is not packed and repacked.layers[1].down.weight is model.layers[1].down
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(repacked(ids), model(ids), rtol=1e-5, atol=1e-4)


def test_pack_model_returns_models_it_cannot_pack_unchanged():
    model = make_tiny_llama(seed=5)
    model.layers[0].qkv = PackedLinear(model.layers[0].qkv)  # already a module: not a tensor
    assert pack_model(model) is model

    class NotALlama:
        pass

    other = NotALlama()
    assert pack_model(other) is other


@pytest.mark.parametrize("native_available", [True, False])
def test_engine_fast_kernels_give_the_reference_tokens(native_available, monkeypatch):
    if native_available and native.load() is None:
        pytest.skip(f"no C kernels: {native.why_unavailable()}")
    if not native_available:
        monkeypatch.setitem(native._state, "lib", None)
        monkeypatch.setitem(native._state, "why", "switched off by the test")
    model = make_tiny_llama(seed=6, hidden=48, heads=6, kv_heads=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in (1, 5, 17, 33, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)
    outputs = {}
    for fast in (True, False):
        engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=512, fast_kernels=fast))
        assert engine.pool.native == (fast and native_available)
        assert is_packed(engine.model) == fast
        outputs[fast] = [o.samples[0] for o in engine.generate(prompts, params)]
        engine.check_invariants()
    for fast, samples in outputs.items():
        assert_solo_greedy(model, prompts, samples, 10, what=f"the engine (fast_kernels={fast}) against the plain loop")
