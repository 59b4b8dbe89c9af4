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


def test_fit_quadratic_recovers_a_bending_curve_and_refuses_two_lengths():
    xs = [0.0, 16.0, 64.0, 256.0, 512.0, 1024.0]
    truth = (0.05, 1.2e-3, 6e-7)
    ys = [truth[0] + truth[1] * x + truth[2] * x * x for x in xs]
    assert cw.fit_quadratic(xs, ys) == pytest.approx(truth, rel=1e-6)
    # 2% noise on the long prompts barely moves the fixed cost, because the fit weighs relative
    # error (ordinary least squares would put it at 0.0535, 7% off)
    noisy = [y * f for y, f in zip(ys, [1, 1, 1, 1.02, 0.98, 1.02])]
    assert cw.fit_quadratic(xs, noisy)[0] == pytest.approx(truth[0], rel=0.01)
    with pytest.raises(ValueError):
        cw.fit_quadratic([2.0, 2.0, 5.0], [1.0, 3.0, 4.0])


def test_forecast_ttft_charges_the_new_tokens_attention_to_the_cached_prefix():
    """Worked by hand: a = 30 ms, b = 1.2 ms/token, c = 0.5 us/token^2. 20 new tokens from an
    empty context: 30 + 24 + 0.2 = 54.2 ms. The same 20 on 1,200 cached tokens:
    30 + 24 + 0.5e-3 * (1220^2 - 1200^2) = 30 + 24 + 24.2 = 78.2 ms."""
    fit = (30e-3, 1.2e-3, 0.5e-6)
    assert cw.forecast_ttft(fit, 20) == pytest.approx(54.2e-3)
    assert cw.forecast_ttft(fit, 20, cached=1200) == pytest.approx(78.2e-3)
    # a whole prompt from nothing is the fit itself
    assert cw.forecast_ttft(fit, 1220) == pytest.approx(30e-3 + 1.2e-3 * 1220 + 0.5e-6 * 1220**2)
    with pytest.raises(ValueError):
        cw.forecast_ttft(fit, -1)


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


@pytest.mark.slow
def test_the_messages_route_reports_cache_fields_that_add_up_and_read_what_our_contract_predicts(model):
    """The workload over /v1/messages with the official `anthropic` client, `cache_control` on
    the system block and on the last user block: the server's three usage fields add up to the
    prompt as our tokenizer renders it, the read is what the contract written from the engine's
    code predicts, and what was written is the rest of the prompt up to the last breakpoint (the
    conversation without the assistant turn's opening)."""
    tok = model.tokenizer
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "8192") as server:
        system = cw.system_prompt(tok, 200)
        played = cw.play_messages(server.url, MODEL, system, conversations=2, turns=2, max_tokens=8)
    requests = cw.as_cache_requests(played, tok)
    assert [t.prompt_tokens for t in played] == [len(r.prompt) for r in requests]
    predicted = [b.read for b in pc.predict(pc.labkit_contract(16), requests)]
    assert [t.cache_read_input_tokens for t in played] == predicted
    assert predicted[0] == 0 and predicted[1] >= 192 and predicted[2] > predicted[1]
    for turn in played:
        marked = len(tok.encode_chat([{"role": r, "content": c} for r, c in turn.messages],
                                     add_generation_prompt=False))
        assert turn.cache_creation_input_tokens == marked - turn.cache_read_input_tokens
