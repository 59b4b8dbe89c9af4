"""Chapter 32's conversation workload on a real `labkit serve`: the contract written from the
engine's code predicts the cached tokens the server reports (a consistency check of code
against code) and, once the pool evicts, bounds them from above; cold sends find nothing;
another API key finds nothing of the first key's prompts in the same `cache_salt`."""

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


@pytest.mark.slow
def test_another_api_key_finds_nothing_of_the_first_keys_prompts(model, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "8192", "--api-key-file", str(keys)) as server:
        system = cw.system_prompt(model.tokenizer, 200)
        played = cw.play(server.url, MODEL, system, conversations=1, turns=2, max_tokens=8, api_key="key-a",
                         scope="shared", cold=False)
        probes = cw.probe_keys(server.url, MODEL, played[-1].messages, "shared",
                               [("a", "key-a"), ("b", "key-b"), ("b again", "key-b")])
        sweep = cw.cold_sweep(server.url, MODEL, model.tokenizer, [32, 96, 160], repeats=1, api_key="key-a")
    assert played[1].cached_tokens > 0 and probes[0].cached_tokens >= played[1].cached_tokens
    assert probes[1].cached_tokens == 0 and probes[1].prompt_tokens == probes[0].prompt_tokens > 200
    assert probes[2].cached_tokens == probes[0].cached_tokens  # the same prompt, now in B's own scope
    lengths = [n for n, _ in sweep]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1] and all(s > 0 for _, s in sweep)


@pytest.mark.slow
def test_under_eviction_the_contract_is_an_upper_bound_and_some_turns_fall_short(model):
    """Three conversations in a pool of 18 blocks, which holds any one turn but not what they
    leave behind together: least-recently-used blocks are given back, so a later turn reads
    less than the contract (which keeps everything) predicts, and none reads more."""
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "288", "--max-model-len", "288") as server:
        system = cw.system_prompt(model.tokenizer, 200)
        played = cw.play(server.url, MODEL, system, conversations=3, turns=2, max_tokens=8, cold=False)
    requests = cw.as_cache_requests(played, model.tokenizer)
    predicted = [b.read for b in pc.predict(pc.labkit_contract(16), requests)]
    reported = [t.cached_tokens for t in played]
    assert all(r <= p for r, p in zip(reported, predicted)), (reported, predicted)
    assert any(r < p for r, p in zip(reported, predicted)), (reported, predicted)
