"""Chapter 32's contract calculator: documented rules on hand-worked cases, and our own
server's contract against what the engine's prefix cache actually served."""

from __future__ import annotations

import dataclasses

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
    first = pc.CacheRequest(system + (1, 2, 3), arrival_s=0.0, breakpoints=(2000,))
    soon = pc.CacheRequest(system + (4, 5), arrival_s=200.0, breakpoints=(2000,))
    again = pc.CacheRequest(system + (6,), arrival_s=450.0, breakpoints=(2000,))
    late = pc.CacheRequest(system + (7,), arrival_s=450.0 + 301.0, breakpoints=(2000,))
    billed = pc.predict(ANTHROPIC, [first, soon, again, late])
    assert billed[0] == pc.Billed(read=0, written=2000, ordinary=3)
    assert billed[1] == pc.Billed(read=2000, written=0, ordinary=2)
    assert billed[2] == pc.Billed(read=2000, written=0, ordinary=1)   # 450 s after the write, 250 after a hit
    assert billed[3] == pc.Billed(read=0, written=2000, ordinary=1)   # 301 s after its last use: gone


def test_a_breakpoint_entry_is_read_whole_or_not_at_all():
    system = tuple(range(1500))
    first = pc.CacheRequest(system + (1, 2), arrival_s=0.0, breakpoints=(1502,))
    other = pc.CacheRequest(system + (3, 4), arrival_s=1.0, breakpoints=(1502,))  # shares 1,500, not 1,502
    marked = pc.CacheRequest(system + (5,), arrival_s=2.0, breakpoints=(1500,))
    after = pc.CacheRequest(system + (6, 7), arrival_s=3.0, breakpoints=(1502,))
    billed = pc.predict(ANTHROPIC, [first, other, marked, after])
    assert billed[1] == pc.Billed(read=0, written=1502, ordinary=0)
    assert billed[2] == pc.Billed(read=0, written=1500, ordinary=1)   # a breakpoint at the system prompt's end
    assert billed[3] == pc.Billed(read=1500, written=2, ordinary=0)


def test_a_prefix_below_the_minimum_is_never_cached_and_costs_nothing_extra():
    short = [pc.CacheRequest(tuple(range(500)), arrival_s=i, breakpoints=(500,)) for i in range(3)]
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


def test_an_automatic_cache_reads_through_a_reply_only_where_the_contract_caches_replies():
    first = pc.CacheRequest(tuple(range(1100)), reply=tuple(range(5000, 5200)), arrival_s=0.0)
    second = pc.CacheRequest(first.prompt + first.reply + (7,) * 50, arrival_s=10.0)
    billed = pc.predict(OPENAI, [first, second])   # documented: prefixes of earlier prompts
    assert billed[1].read == pc.cacheable(OPENAI, 1100) == 1024 and billed[1].written == 0
    ours = pc.predict(pc.labkit_contract(16), [first, second])  # the engine caches what it generated
    assert ours[1].read == 1296   # 1,300 shared (prompt and reply), cut to full blocks of 16


def test_two_breakpoints_let_other_conversations_read_the_system_prompt():
    system = tuple(range(1200))
    a = pc.CacheRequest(system + (1,) * 30, arrival_s=0.0, breakpoints=(1200, 1230))
    b = pc.CacheRequest(system + (2,) * 40, arrival_s=1.0, breakpoints=(1200, 1240))
    a2 = pc.CacheRequest(a.prompt + (3,) * 20, arrival_s=2.0, breakpoints=(1200, 1250))
    billed = pc.predict(ANTHROPIC, [a, b, a2])
    assert billed[0] == pc.Billed(read=0, written=1230, ordinary=0)
    assert billed[1] == pc.Billed(read=1200, written=40, ordinary=0)   # the system entry, read whole
    assert billed[2] == pc.Billed(read=1230, written=20, ordinary=0)   # its own earlier turn
    one = pc.predict(ANTHROPIC, [dataclasses.replace(r, breakpoints=r.breakpoints[1:]) for r in (a, b, a2)])
    assert one[1] == pc.Billed(read=0, written=1240, ordinary=0)       # one breakpoint: nothing shared
    assert [u["cache_read_input_tokens"] for u in map(lambda x: pc.usage_fields(ANTHROPIC, x), billed)] == \
        [0, 1200, 1230]


def test_an_anthropic_entry_is_readable_only_once_its_writers_response_has_begun():
    """The page: an entry becomes available once the first response begins. A writes the system
    prompt at t=0 and its response begins 2 s later: B (t=1) must write it again, C (t=3) reads
    it. OpenAI documents no such rule: there B reads what A wrote."""
    system = tuple(range(1200))
    a = pc.CacheRequest(system + (1,) * 30, arrival_s=0.0, breakpoints=(1200, 1230), response_start_s=2.0)
    b = pc.CacheRequest(system + (2,) * 40, arrival_s=1.0, breakpoints=(1200, 1240), response_start_s=0.5)
    c = pc.CacheRequest(system + (3,) * 50, arrival_s=3.0, breakpoints=(1200, 1250), response_start_s=0.5)
    billed = pc.predict(ANTHROPIC, [a, b, c])
    assert billed[1] == pc.Billed(read=0, written=1240, ordinary=0)
    assert billed[2] == pc.Billed(read=1200, written=50, ordinary=0)
    gpt5 = pc.PROVIDER_CONTRACTS["openai, GPT-5"]
    assert pc.predict(gpt5, [a, b])[1].read == pc.cacheable(gpt5, 1200) == 1152


def test_requests_sent_together_all_write_when_a_miss_starts_its_response_late():
    """Worked by hand: four conversations 0.1 s apart share a 1,200-token system prompt; a send
    that reads something begins its response 0.08 s after arrival, one that reads nothing after
    2 s (it computes all 1,230 tokens). A's entry is readable from 2.0 s, B's (a miss) from 2.1 s,
    C's from 2.2 s: B, C and D all arrive before 0.4 s and each writes its whole prompt. D at
    2.5 s would read. The old rule (every response at its warm start) let C read B's entry from
    0.18 s."""
    system = tuple(range(1200))
    sends = [pc.CacheRequest(system + (k,) * 30, arrival_s=0.1 * k, breakpoints=(1200, 1230),
                             response_start_s=0.08, cold_response_start_s=2.0) for k in range(4)]
    billed = pc.predict(ANTHROPIC, sends)
    assert billed == [pc.Billed(read=0, written=1230, ordinary=0)] * 4
    late = dataclasses.replace(sends[3], arrival_s=2.5)
    assert pc.predict(ANTHROPIC, sends[:3] + [late])[3] == pc.Billed(read=1200, written=30, ordinary=0)
    paid = 4 * 1230 * 1.25 / (4 * 1230)
    assert pc.relative_cost(ANTHROPIC, billed) == pytest.approx(paid)
    # a request without a cold start of its own keeps its one start, whether it reads or not
    assert pc.CacheRequest((1,), response_start_s=0.3).response_start(0) == 0.3
    assert sends[0].response_start(1200) == 0.08 and sends[0].response_start(0) == 2.0


def test_breakpoints_past_the_maximum_or_outside_the_prompt_are_refused_and_none_caches_nothing():
    prompt = tuple(range(3000))
    with pytest.raises(ValueError, match="allows 4 breakpoints"):
        pc.predict(ANTHROPIC, [pc.CacheRequest(prompt, breakpoints=(1100, 1200, 1300, 1400, 1500))])
    with pytest.raises(ValueError, match="inside the prompt"):
        pc.predict(ANTHROPIC, [pc.CacheRequest(prompt, breakpoints=(3001,))])
    bare = [pc.CacheRequest(prompt, arrival_s=float(i)) for i in range(2)]
    assert pc.predict(ANTHROPIC, bare) == [pc.Billed(0, 0, 3000)] * 2


def test_every_provider_figure_comes_from_the_documented_table():
    for contract in [*pc.PROVIDER_CONTRACTS.values(), pc.OPENAI_BEST_CASE]:
        for field in ("automatic", "minimum_tokens", "increment_tokens", "write_multiplier", "read_multiplier",
                      "caches_reply", "readable_after_response_start"):
            assert getattr(contract, field) == pc.documented(contract.name, field), (contract.name, field)
        assert contract.source in {row.page for row in pc.DOCUMENTED}
    assert OPENAI.ttl_seconds == 300.0 and pc.OPENAI_BEST_CASE.ttl_seconds == 24 * 3600.0
    # a model generation's own row wins over its provider's, also for a contract named after it
    gpt5 = pc.PROVIDER_CONTRACTS["openai, GPT-5"]
    reads = (OPENAI.read_multiplier, gpt5.read_multiplier, pc.OPENAI_BEST_CASE.read_multiplier)
    assert reads == (0.5, 0.1, 0.1)
    assert ANTHROPIC.readable_after_response_start and not gpt5.readable_after_response_start
    assert ANTHROPIC.max_breakpoints == 4 and OPENAI.max_breakpoints is None
    assert all(row.page.startswith("https://") and row.consulted == pc.CONSULTED for row in pc.DOCUMENTED)


def test_the_openai_retention_rows_say_what_the_installed_clients_reference_says():
    """The 24h and minimum-ttl rows quote OpenAI's API reference as the `openai` client ships it;
    read it from the installed client's source (a changed text means the rows must be re-read)."""
    import inspect

    import openai
    from openai.types.chat import completion_create_params as params

    text = " ".join(inspect.getsource(params).split())
    assert "Deprecated. Use `prompt_cache_options.ttl` instead." in text
    assert "up to a maximum of 24 hours" in text and "expresses a maximum retention policy" in text
    assert "Organizations without ZDR enabled default to `24h`" in text
    assert "The `ttl` defaults to `30m`" in text and "Supported for `gpt-5.6` and later" in text
    rows = {row.figure: row for row in pc.DOCUMENTED if row.contract == "openai"}
    assert rows["ttl_extended_seconds"].value == 24 * 3600.0
    assert "deprecated" in rows["ttl_extended_seconds"].statement
    assert rows["minimum ttl note (gpt-5.6 and later)"].value == 30 * 60.0
    assert openai.__version__ == pc.OPENAI_REFERENCE_CLIENT


def test_usage_fields_are_what_the_official_clients_parse():
    """The usage objects the calculator writes are the providers' own shapes: the official
    `anthropic` and `openai` clients' types accept them and read back the same counts."""
    import anthropic.types
    import openai.types

    billed = pc.Billed(read=1200, written=40, ordinary=7)
    usage = anthropic.types.Usage(output_tokens=16, **pc.usage_fields(ANTHROPIC, billed))
    assert (usage.input_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == (7, 40, 1200)
    fields = pc.usage_fields(OPENAI, billed)
    usage = openai.types.CompletionUsage(completion_tokens=16, total_tokens=fields["prompt_tokens"] + 16, **fields)
    assert usage.prompt_tokens == 1247 and usage.prompt_tokens_details.cached_tokens == 1200
    assert set(usage.model_dump(exclude_none=True)) >= set(fields)


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


def test_common_prefix_agrees_with_a_token_by_token_walk():
    import random

    rng = random.Random(3)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        walked = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert pc.common_prefix(a, b) == pc.common_prefix(tuple(b), a) == walked
