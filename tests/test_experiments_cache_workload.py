"""Chapter 32's conversation workload on a real `labkit serve`: the contract written from the
engine's code predicts the cached tokens the server reports; cold sends find nothing."""

from __future__ import annotations

import pytest

from labkit.experiments import cache_workload as cw
from labkit.experiments import prompt_cache_pricing as pc
from tests.live_server import LiveServer

MODEL = "smollm2-135m"


def test_fit_line_recovers_a_line_and_refuses_a_point():
    xs = [1.0, 2.0, 4.0, 8.0]
    assert cw.fit_line(xs, [3 + 0.5 * x for x in xs]) == pytest.approx((3.0, 0.5))
    with pytest.raises(ValueError):
        cw.fit_line([2.0, 2.0], [1.0, 3.0])


@pytest.mark.slow
def test_the_served_cached_tokens_are_what_our_contract_predicts(model):
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "16384") as server:
        system = cw.system_prompt(model.tokenizer, 200)
        played = cw.play(server.url, MODEL, system, conversations=2, turns=2, max_tokens=8)
    requests = cw.as_cache_requests(played, model.tokenizer)
    assert [t.prompt_tokens for t in played] == [len(r.prompt) for r in requests]
    predicted = [b.read for b in pc.predict(pc.labkit_contract(16), requests)]
    assert [t.cached_tokens for t in played] == predicted
    assert predicted[0] == 0 and predicted[1] >= 192      # the second conversation hits the system prompt
    assert predicted[2] > predicted[1]                     # a second turn hits its own first turn too
    assert all(t.cold_cached_tokens == 0 for t in played)  # a scope of its own: nothing to hit
