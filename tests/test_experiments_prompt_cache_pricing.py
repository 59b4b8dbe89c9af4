"""Chapter 32's contract calculator: documented rules on hand-worked cases, and our own
server's contract against what the engine's prefix cache actually served."""

from __future__ import annotations

import pytest

from labkit.experiments import prompt_cache_pricing as pc

ANTHROPIC = pc.PROVIDER_CONTRACTS["anthropic, 5-minute"]
OPENAI = pc.PROVIDER_CONTRACTS["openai (launch, GPT-4o)"]


@pytest.mark.parametrize("length,expected", [(0, 0), (1023, 0), (1024, 1024), (1151, 1024), (1152, 1152),
                                             (5000, 4992)])
def test_openai_caches_from_1024_tokens_in_steps_of_128(length, expected):
    assert pc.cacheable(OPENAI, length) == expected


def test_an_explicit_breakpoint_is_written_once_and_read_while_it_lives():
    system = tuple(range(2000))
    first = pc.CacheRequest(system + (1, 2, 3), arrival_s=0.0, breakpoint_tokens=2000)
    soon = pc.CacheRequest(system + (4, 5), arrival_s=200.0, breakpoint_tokens=2000)
    again = pc.CacheRequest(system + (6,), arrival_s=450.0, breakpoint_tokens=2000)
    late = pc.CacheRequest(system + (7,), arrival_s=450.0 + 301.0, breakpoint_tokens=2000)
    billed = pc.predict(ANTHROPIC, [first, soon, again, late])
    assert billed[0] == pc.Billed(read=0, written=2000, ordinary=3)
    assert billed[1] == pc.Billed(read=2000, written=0, ordinary=2)
    assert billed[2] == pc.Billed(read=2000, written=0, ordinary=1)   # 450 s after the write, 250 after a hit
    assert billed[3] == pc.Billed(read=0, written=2000, ordinary=1)   # 301 s after its last use: gone


def test_a_breakpoint_entry_is_read_whole_or_not_at_all():
    system = tuple(range(1500))
    first = pc.CacheRequest(system + (1, 2), arrival_s=0.0, breakpoint_tokens=1502)
    other = pc.CacheRequest(system + (3, 4), arrival_s=1.0, breakpoint_tokens=1502)  # shares 1,500, not 1,502
    marked = pc.CacheRequest(system + (5,), arrival_s=2.0, breakpoint_tokens=1500)
    after = pc.CacheRequest(system + (6, 7), arrival_s=3.0, breakpoint_tokens=1502)
    billed = pc.predict(ANTHROPIC, [first, other, marked, after])
    assert billed[1] == pc.Billed(read=0, written=1502, ordinary=0)
    assert billed[2] == pc.Billed(read=0, written=1500, ordinary=1)   # a breakpoint at the system prompt's end
    assert billed[3] == pc.Billed(read=1500, written=2, ordinary=0)


def test_a_prefix_below_the_minimum_is_never_cached_and_costs_nothing_extra():
    short = [pc.CacheRequest(tuple(range(500)), arrival_s=i, breakpoint_tokens=500) for i in range(3)]
    billed = pc.predict(ANTHROPIC, short)
    assert all(b == pc.Billed(0, 0, 500) for b in billed)
    assert pc.relative_cost(ANTHROPIC, billed) == 1.0


def test_relative_cost_and_break_even_follow_the_multipliers():
    billed = [pc.Billed(0, 1000, 10), pc.Billed(1000, 0, 10), pc.Billed(1000, 0, 10)]
    paid = 1000 * 1.25 + 2 * 1000 * 0.1 + 30
    assert pc.relative_cost(ANTHROPIC, billed) == pytest.approx(paid / 3030)
    assert pc.break_even_reads(ANTHROPIC) == pytest.approx(0.25 / 0.9)
    assert pc.break_even_reads(pc.PROVIDER_CONTRACTS["anthropic, 1-hour"]) == pytest.approx(1 / 0.9)
    assert pc.break_even_reads(OPENAI) == 0.0


def test_an_automatic_cache_reads_what_an_earlier_reply_added():
    first = pc.CacheRequest(tuple(range(1100)), reply=tuple(range(5000, 5200)), arrival_s=0.0)
    second = pc.CacheRequest(first.prompt + first.reply + (7,) * 50, arrival_s=10.0)
    billed = pc.predict(OPENAI, [first, second])
    assert billed[1].read == pc.cacheable(OPENAI, 1300) == 1280 and billed[1].written == 0


@pytest.mark.slow
def test_our_contract_predicts_the_cached_tokens_the_engine_reports(model):
    """A three-turn conversation on the real engine: each turn's prompt is the previous prompt,
    its reply and new text. The contract written from the engine's code predicts, per turn,
    exactly the cached prompt tokens the engine reports."""
    from labkit.engine import EngineConfig, LLMEngine
    from labkit.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(prefix_caching=True))
    tok = model.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=20)
    prompt, played, measured = tok.encode("Notes on caches. " * 6), [], []
    for turn, text in enumerate(["A cache keeps what was computed.", "Blocks hold sixteen tokens.",
                                 "The last token is always run."]):
        prompt = prompt + tok.encode(f" Question {turn}: {text}")
        out = engine.generate([prompt], params)[0]
        measured.append(out.cached_prompt_tokens)
        played.append(pc.CacheRequest(tuple(prompt), tuple(out.token_ids), arrival_s=float(turn)))
        prompt = prompt + out.token_ids
    repeat = prompt[:64]  # four full blocks, all cached: the engine still runs the last token
    measured.append(engine.generate([repeat], params)[0].cached_prompt_tokens)
    played.append(pc.CacheRequest(tuple(repeat), arrival_s=3.0))
    predicted = [b.read for b in pc.predict(pc.labkit_contract(engine.config.block_size), played)]
    assert predicted == measured
    assert measured[0] == 0 and measured[2] > measured[1] > 0 and measured[3] == 48
