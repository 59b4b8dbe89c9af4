"""labkit.experiments.moe_training: the MoE layer against a per-token loop, the auxiliary
loss against its closed form, the bias update, capacity drops against moe_layer's count,
placement, and a checkpoint round trip."""

import random

import pytest
import torch

from labkit.experiments import moe_layer as ml
from labkit.experiments import moe_training as mt

TINY = dict(d_model=16, layers=2, heads=2, context=16, experts=8, ffn=16, steps=3, batch=2,
            warmup=1, threads=1)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    return mt.MoEFeedForward(mt.Config(**TINY))


def test_forward_equals_per_token_loop(layer):
    x = torch.randn(24, 16)
    with torch.no_grad():
        out, routing, stats = layer(x)
        ref = ml.dense_loop(x, layer.weights(), routing)
        mixtral = ml.route(x, layer.weights())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # with no bias the routing is moe_layer's (Mixtral's)
    assert torch.equal(routing.experts, mixtral.experts)
    torch.testing.assert_close(routing.weights, mixtral.weights)
    assert int(stats.load.sum()) == 24 * 2 and stats.dropped == 0


def test_aux_loss_closed_form():
    # 4 tokens, 4 experts, top-2: loads 3, 3, 1, 1 of the 8 assignments
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1],
                                     [0.5, 0.2, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]]))
    experts = torch.tensor([[0, 1], [1, 2], [0, 3], [0, 1]])
    f = torch.tensor([3, 3, 1, 1]) / 8
    p = torch.tensor([1.25, 1.35, 0.75, 0.65]) / 4
    assert float(mt.aux_loss(logits, experts, 4)) == pytest.approx(4 * float((f * p).sum()))
    # uniform routing and probabilities give exactly 1
    uniform = torch.zeros(8, 4)
    spread = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(mt.aux_loss(uniform, spread, 4)) == pytest.approx(1.0)


def test_bias_moves_load_toward_balance_and_keeps_combine_weights():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    router = torch.randn(8, 16, generator=g)
    router[0] += 2 * x.mean(0)  # expert 0 is popular
    logits = x @ router.T
    bias = torch.zeros(8)

    def spread(b):
        load = ml.expert_load(mt.route_with_bias(logits, 2, b), 8).float()
        return float(load.max() / load.mean())

    before = spread(bias)
    for _ in range(200):
        mt.update_bias(bias, ml.expert_load(mt.route_with_bias(logits, 2, bias), 8), 1e-3)
    assert spread(bias) < before
    # combine weights: the unbiased probabilities of the chosen experts, renormalised
    r = mt.route_with_bias(logits, 2, bias)
    probs = torch.softmax(logits, -1).gather(-1, r.experts)
    torch.testing.assert_close(r.weights, probs / probs.sum(-1, keepdim=True))
    assert torch.equal(mt.route_with_bias(logits, 2, None).experts, ml.route(x, ml.MoEWeights(
        router, torch.zeros(8, 1, 16), torch.zeros(8, 1, 16), torch.zeros(8, 16, 1))).experts)


def test_capacity_drops_match_expected_drops(layer):
    x = torch.randn(64, 16)
    with torch.no_grad():
        for factor in (0.5, 1.0, 1.25, 2.0):
            _, routing, stats = layer(x, capacity_factor=factor, group=16)
            expected = 0
            for s in range(0, 64, 16):
                load = torch.bincount(routing.experts[s:s + 16].reshape(-1), minlength=8)
                expected += ml.expected_drops(load, ml.expert_capacity(16, 8, 2, factor))
            assert stats.dropped == expected
            assert len(stats.stragglers) == 4


def test_large_capacity_changes_nothing(layer):
    x = torch.randn(32, 16)
    with torch.no_grad():
        free, _, _ = layer(x)
        limited, _, stats = layer(x, capacity_factor=8.0, group=8)
    assert stats.dropped == 0
    torch.testing.assert_close(limited, free)


def test_lpt_never_worse_than_contiguous():
    rng = random.Random(0)
    for _ in range(200):
        load = [rng.expovariate(1.0) for _ in range(8)]
        lpt = mt.place_lpt(load, 4)
        assert sorted(e for w in lpt for e in w) == list(range(8))
        assert all(len(w) == 2 for w in lpt)
        assert mt.busiest_share(load, lpt) <= mt.busiest_share(load, mt.place_contiguous(8, 4)) + 1e-12


def test_all_to_all_bytes():
    assert mt.all_to_all_bytes_per_token(2, 4096, 2, layers=32) == 2 * 4096 * 2 * 2 * 32


def test_train_evaluate_and_checkpoint_round_trip(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    for method in mt.METHODS:
        trained = mt.train(mt.Config(method=method, **TINY), text)
        assert trained.meta["text_sha256"] == mt.text_sha256(text)
    # the last one trained is the bias method: its bias must have moved
    assert any(b.moe.selection_bias.abs().sum() > 0 for b in trained.model.blocks)
    path = mt.save_checkpoint(trained, tmp_path)
    back = mt.load_checkpoint(path)
    _, held = mt.split_text(text)
    windows = mt.eval_windows(held, 16)
    a = mt.evaluate(trained.model.half().float(), windows)
    b = mt.evaluate(back.model, windows)
    assert a.bits_per_char == pytest.approx(b.bits_per_char, abs=1e-6)
    assert back.meta == trained.meta
    models, origin = mt.obtain_models([back.model.cfg], text, [tmp_path])
    assert origin[back.model.cfg.name] == str(tmp_path)


def test_training_is_deterministic_on_one_thread():
    text = "abcdefghij" * 60
    cfg = mt.Config(method="aux", **TINY)
    a, b = mt.train(cfg, text), mt.train(cfg, text)
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(va, vb), k


def test_ci_never_trains_the_real_models(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "DATA_DIR", tmp_path / "absent")
    text = "a small text for a toy model, " * 100
    models, origin = mt.models_for_profile(False, [0], text, toy_steps=1)
    assert set(models) == {f"{m}-seed0" for m in mt.METHODS}
    assert all(t.model.cfg.steps == 1 for t in models.values())
    assert all(o.startswith("toy") for o in origin.values())
    assert not (tmp_path / "absent").exists()


def test_window_bits_pair_the_windows_and_average_to_evaluate(tmp_path):
    torch.manual_seed(0)
    model = mt.TinyMoELM(mt.Config(**TINY)).eval()
    g = torch.Generator().manual_seed(2)
    windows = torch.randint(0, 256, (5, TINY["context"] + 1), generator=g)
    bits = mt.window_bits(model, windows, batch=2)
    assert len(bits) == 5
    assert sum(bits) / 5 == pytest.approx(mt.evaluate(model, windows).bits_per_char, rel=1e-5)
    # each window's score is its own: scoring one window alone gives the same number
    assert bits[3] == pytest.approx(mt.evaluate(model, windows[3:4]).bits_per_char, rel=1e-5)


def test_share_difference_needs_more_than_the_binomial_noise():
    # 0.400 vs 0.401 of 20,000 assignments each: SE about 0.0049, so noise
    assert mt.share_difference(0.400, 20_000, 0.401, 20_000) == "within the noise"
    assert mt.share_difference(0.40, 20_000, 0.42, 20_000) == "lower"
    assert mt.share_difference(0.42, 20_000, 0.40, 20_000) == "higher"
    # the same gap on few assignments is noise
    assert mt.share_difference(0.40, 100, 0.42, 100) == "within the noise"
