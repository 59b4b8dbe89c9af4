"""labkit.experiments.moe_layer: the five MoE implementations agree with each other and with
transformers' Mixtral block; the bytes-read count and its closed form; capacity drops."""

import itertools

import pytest
import torch

from labkit.experiments import moe_layer as moe

HIDDEN, FFN = 64, 128


@pytest.fixture(scope="module")
def weights():
    return moe.random_moe(HIDDEN, FFN, experts=8, top_k=2, seed=0)


def hand_routing(experts: list[list[int]], num_experts: int) -> moe.Routing:
    """A routing given by its expert lists, with unequal weights summing to 1 per token."""
    chosen = torch.tensor(experts)
    tokens, k = chosen.shape
    w = torch.linspace(1.0, 2.0, tokens * k).view(tokens, k)
    return moe.Routing(logits=torch.zeros(tokens, num_experts), experts=chosen,
                       weights=w / w.sum(dim=1, keepdim=True))


def all_implementations():
    impls = dict(moe.IMPLEMENTATIONS)
    # The segment-loop fallback of the grouped path, so it is tested where _grouped_mm exists.
    impls["grouped, segment loop"] = lambda x, w, r: moe.grouped(x, w, r, use_grouped_mm=False)
    return impls


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_every_implementation_equals_the_dense_loop(weights, tokens):
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    routing = moe.route(x, weights)
    reference = moe.dense_loop(x, weights, routing)
    assert reference.shape == (tokens, HIDDEN) and reference.abs().max() > 0.1
    for name, run in all_implementations().items():
        torch.testing.assert_close(run(x, weights, routing), reference, rtol=0, atol=1e-5, msg=name)


def test_implementations_agree_when_some_experts_get_no_token(weights):
    routing = hand_routing([[0, 1], [1, 0], [2, 0], [0, 7], [7, 2], [1, 2], [0, 1]], 8)
    assert (moe.expert_load(routing, 8)[3:7] == 0).all()
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    reference = moe.dense_loop(x, weights, routing)
    for name, run in all_implementations().items():
        torch.testing.assert_close(run(x, weights, routing), reference, rtol=0, atol=1e-5, msg=name)
    assert moe.padding_fraction(routing, 8) == pytest.approx(1 - 14 / (8 * 5))


def test_routing_is_softmax_topk_renormalised(weights):
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    routing = moe.route(x, weights)
    torch.testing.assert_close(routing.weights.sum(dim=1), torch.ones(5))
    # By hand: the k largest logits, softmax over just those (the same as renormalising).
    top_logits, top_experts = torch.topk(x @ weights.router.T, 2, dim=-1)
    assert torch.equal(routing.experts, top_experts)
    torch.testing.assert_close(routing.weights, torch.softmax(top_logits, dim=-1))


def test_transformers_mixtral_block_is_the_same_layer(weights):
    block = moe.to_transformers(weights)
    x = torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(3))
    flat = x.view(-1, HIDDEN)
    with torch.no_grad():
        theirs = block(x).view(-1, HIDDEN)
        logits, scores, indices = block.gate(flat)
    routing = moe.route(flat, weights)
    torch.testing.assert_close(routing.logits, logits, rtol=0, atol=1e-6)
    assert torch.equal(routing.experts, indices)
    torch.testing.assert_close(routing.weights, scores, rtol=0, atol=1e-7)
    for name, run in all_implementations().items():
        torch.testing.assert_close(run(flat, weights, routing), theirs, rtol=0, atol=1e-5, msg=name)


def test_round_trip_through_transformers(weights):
    back = moe.from_transformers(moe.to_transformers(weights))
    for name in ("router", "w1", "w3", "w2"):
        assert torch.equal(getattr(back, name), getattr(weights, name)), name
    assert back.top_k == weights.top_k
    # And the other way: a block made by transformers, read and written back.
    block = moe.to_transformers(moe.random_moe(HIDDEN, FFN, seed=5))
    torch.nn.init.normal_(block.experts.gate_up_proj)
    again = moe.to_transformers(moe.from_transformers(block))
    for (name, p), (_, q) in zip(block.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), name


def test_expert_bytes_read_counts_distinct_experts(weights):
    routing = hand_routing([[0, 3], [3, 0], [5, 0]], 8)
    per_expert = 3 * FFN * HIDDEN * 4  # w1, w3, w2 in float32
    assert weights.bytes_per_expert == per_expert
    assert moe.distinct_experts(routing) == 3
    assert moe.expert_bytes_read(routing, weights) == 3 * per_expert + 8 * HIDDEN * 4


def test_closed_form_union_by_exact_enumeration():
    subsets = list(itertools.combinations(range(8), 2))
    for tokens in (1, 2, 3):
        sizes = [len(set().union(*pick)) for pick in itertools.product(subsets, repeat=tokens)]
        assert sum(sizes) / len(sizes) == pytest.approx(moe.expected_distinct_experts(tokens))


@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
def test_measured_union_matches_the_closed_form(tokens):
    measured = moe.mean_distinct_experts(tokens, trials=20000, seed=tokens)
    assert measured == pytest.approx(moe.expected_distinct_experts(tokens), rel=0.02)


def test_uniform_random_routing_picks_distinct_experts():
    routing = moe.uniform_random_routing(500, generator=torch.Generator().manual_seed(0))
    assert (routing.experts[:, 0] != routing.experts[:, 1]).all()
    assert moe.expert_load(routing, 8).min() > 80  # about 125 each


def test_dense_equivalent_is_k_experts_side_by_side(weights):
    dense = moe.dense_equivalent(weights)
    assert dense.ffn == 2 * FFN and dense.nbytes == 2 * weights.bytes_per_expert
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(4))
    both = sum(moe.swiglu(x, weights.w1[e], weights.w3[e], weights.w2[e]) for e in (0, 1))
    torch.testing.assert_close(moe.dense_forward(x, dense), both, rtol=0, atol=1e-5)


def test_a_large_capacity_changes_nothing(weights):
    x = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(5))
    # Factor E / k makes C = T: no expert can receive more than T tokens.
    out, record = moe.capacity_forward(x, weights, capacity_factor=4.0)
    assert record.capacity == 32 and record.dropped == 0
    assert torch.equal(out, moe.gather_by_expert(x, weights))


def test_dropped_count_on_a_hand_built_routing():
    w = moe.random_moe(16, 32, experts=4, top_k=2, seed=6)
    routing = hand_routing([[0, 1], [1, 0], [0, 2], [0, 3], [1, 2], [0, 1]], 4)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(6))
    out, record = moe.capacity_forward(x, w, capacity_factor=1.0, routing=routing)
    # C = ceil(1 * 6 * 2 / 4) = 3; loads 5, 4, 2, 1: expert 0 drops 2 and expert 1 drops 1.
    assert record.capacity == 3 and record.load.tolist() == [5, 4, 2, 1]
    assert record.dropped == moe.expected_drops(record.load, 3) == 3
    assert record.dropped_assignments == [(3, 0), (5, 0), (5, 1)]
    assert torch.equal(out[5], torch.zeros(16))  # both of token 5's experts were full
    only_expert_3 = moe.swiglu(x[3:4], w.w1[3], w.w3[3], w.w2[3])[0] * routing.weights[3, 1]
    torch.testing.assert_close(out[3], only_expert_3, rtol=0, atol=1e-6)
    full = moe.dense_loop(x, w, routing)
    torch.testing.assert_close(out[:3], full[:3], rtol=0, atol=1e-6)


def test_with_a_capacity_the_same_token_depends_on_its_neighbours(weights):
    g = torch.Generator().manual_seed(7)
    token = torch.randn(HIDDEN, generator=g)
    # Neighbours that crowd the token's experts (copies of it) among unrelated tokens.
    neighbours = torch.cat([token.repeat(4, 1), torch.randn(11, HIDDEN, generator=g)])
    tight = moe.neighbour_dependence(token, neighbours, weights, capacity_factor=1.0)
    assert tight.dropped_first == 0 and tight.dropped_last == 2
    assert torch.equal(tight.last, torch.zeros(HIDDEN))
    assert tight.max_abs_diff > 0.1
    loose = moe.neighbour_dependence(token, neighbours, weights, capacity_factor=4.0)
    assert loose.dropped_last == 0 and loose.max_abs_diff < 1e-5
    torch.testing.assert_close(tight.first, loose.first, rtol=0, atol=1e-6)


def test_time_layers_records_every_layer_within_its_limit(weights):
    layers = {"moe": lambda x: moe.grouped(x, weights),
              "loop": lambda x: moe.dense_loop(x, weights)}
    records = moe.time_layers(layers, HIDDEN, [1, 4], rounds=2, max_tokens={"loop": 1})
    assert [(r["tokens"], r["layer"]) for r in records] == [(1, "moe"), (1, "loop"), (4, "moe")]
    for r in records:
        assert r["repeats"] == 2 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert "samples_ms" not in r
    kept = moe.time_layers(layers, HIDDEN, [1], rounds=3, keep_samples=True)
    for r in kept:
        assert len(r["samples_ms"]) == 3 and min(r["samples_ms"]) == r["min_ms"]


def test_cache_fit_counts_whole_experts_and_a_tokens_k(weights):
    size = weights.bytes_per_expert
    fit = moe.cache_fit(weights, 2 * size + 1)
    assert (fit.experts_that_fit, fit.token_experts_fit, fit.layer_fits) == (2, True, False)
    fit = moe.cache_fit(weights, size - 1)
    assert (fit.experts_that_fit, fit.token_experts_fit, fit.expert_over_cache) == (0, False, size / (size - 1))
    assert moe.cache_fit(weights, 8 * size).layer_fits
    assert moe.cache_fit(weights, None) is None


def test_router_distinct_experts_is_k_for_one_token_and_at_most_e(weights):
    assert moe.router_distinct_experts(weights, 1, trials=5) == [2] * 5
    many = moe.router_distinct_experts(weights, 64, trials=5, seed=1)
    assert all(2 <= n <= 8 for n in many) and max(many) == 8


def test_capacity_drops_counts_agree_with_the_loads(weights):
    records = moe.capacity_drops(weights, 32, [1.0, 4.0], batches=3)
    assert len(records) == 6 and all(r["as_expected"] for r in records)
    loose = [r for r in records if r["factor"] == 4.0]
    assert all(r["capacity"] == 32 and r["dropped"] == 0 and r["tokens_lost"] == 0 for r in loose)
    tight = [r for r in records if r["factor"] == 1.0]
    assert all(r["capacity"] == 8 for r in tight) and sum(r["dropped"] for r in tight) > 0
    for r in tight:
        assert r["dropped_share"] == r["dropped"] / 64
