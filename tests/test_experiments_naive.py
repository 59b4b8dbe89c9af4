"""The naive loop, the one-pass check, stop matching and streaming of chapter 5. The naive loop
(a whole pass a token), the cached loop and one pass over the output are three numerical paths
of one model: their greedy tokens agree up to the near-tie rule (`conftest.assert_greedy_near`)."""

import pytest
import torch

from conftest import PROMPTS, SMOL_LOGIT_ERROR, assert_argmax_near, assert_greedy_near, greedy_reference_scores
from labkit.engine.loop import generate
from labkit.experiments.naive_generation import check_in_one_pass, generate_naive, generation_flops, pass_flops
from labkit.experiments.naive_text import (
    count_replacement,
    locate_in_tokens,
    sentencepiece_style_tokenizer,
    stop_naive_per_token,
    stop_text_level,
    stream_incremental,
    stream_naive,
    stream_table,
)
from labkit.models.gpt2 import GPT2Config
from labkit.sampling import SamplingParams

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def greedy(model):
    """(prompt_ids, 16 greedy tokens from the cached loop, the log-probabilities [16, vocab]
    that chose them) for PROMPTS[1]."""
    prompt_ids = model.tokenizer.encode(PROMPTS[1])
    out = generate(model, prompt_ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                     ignore_eos=True))
    tokens, scores = greedy_reference_scores(model, prompt_ids, NEW_TOKENS)
    assert tokens == out.token_ids  # the cached loop is greedy_reference's path: exact
    return prompt_ids, tokens, scores


@pytest.fixture(scope="module")
def naive(model, greedy):
    """The naive loop's 16 tokens and step seconds for the same prompt."""
    return generate_naive(model, greedy[0], NEW_TOKENS)


def test_naive_loop_equals_cached_loop(greedy, naive):
    prompt_ids, cached, scores = greedy
    tokens, seconds = naive
    assert_greedy_near([cached], [tokens], [scores], SMOL_LOGIT_ERROR, what="the naive loop against the cached one")
    assert len(seconds) == NEW_TOKENS and all(s > 0 for s in seconds)


def test_naive_loop_stops_on_a_stop_token(model, greedy, naive):
    prompt_ids = greedy[0]
    free = naive[0]  # the naive loop's own tokens: the stopped run is the same path, so exact
    stop = free[3]
    first = free.index(stop)
    tokens, seconds = generate_naive(model, prompt_ids, first + 2, stop_token_ids=[stop])
    assert tokens == free[:first]  # the stop token is not returned
    assert len(seconds) == first + 1
    with pytest.raises(ValueError):
        generate_naive(model, [], 4)


def test_one_pass_check_agrees_at_every_position(model, greedy):
    prompt_ids, tokens, scores = greedy
    argmax_ids, matches = check_in_one_pass(model, prompt_ids, tokens)
    assert matches == [a == t for a, t in zip(argmax_ids, tokens)] and len(matches) == NEW_TOKENS
    # every position reads the cached loop's own tokens before it: compared one by one, each
    # argmax agrees with the loop's choice up to the near-tie rule
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens]))[0, len(prompt_ids) - 1:-1]
    assert logits.argmax(-1).tolist() == argmax_ids  # the check's own pass: exact
    assert_argmax_near(scores, torch.log_softmax(logits.float(), -1), SMOL_LOGIT_ERROR,
                       what="one pass over the output against the cached loop")


def test_one_pass_check_finds_a_changed_token(model, greedy):
    prompt_ids, tokens, _ = greedy
    changed = list(tokens)
    position = 5
    changed[position] = model.tokenizer.encode(" banana")[0]
    assert changed[position] != tokens[position]
    argmax_ids, matches = check_in_one_pass(model, prompt_ids, changed)
    unchanged_ids, unchanged = check_in_one_pass(model, prompt_ids, tokens)  # the same pass: exact
    assert matches[:position] == unchanged[:position]  # the prefix before it is untouched
    assert not matches[position]
    assert argmax_ids[position] == unchanged_ids[position]  # the model still wants what it wanted
    assert check_in_one_pass(model, prompt_ids, []) == ([], [])


def test_stream_naive_breaks_an_emoji_and_incremental_does_not(model):
    tok = model.tokenizer
    text = "Tea ☕ or sushi 🍣?"
    ids = tok.encode(text)
    naive = stream_naive(tok, ids)
    incremental = stream_incremental(tok, ids)
    assert len(naive) == len(incremental) == len(ids)
    assert count_replacement("".join(naive)) > 0
    assert "".join(naive) != text
    assert count_replacement("".join(incremental)) == 0
    assert "".join(incremental) == text == tok.decode(ids)
    assert all(count_replacement(piece) == 0 for piece in incremental)
    rows = stream_table(tok, ids)
    assert [r["id"] for r in rows] == ids
    assert "' ☕'" in [r["incremental"] for r in rows]


def test_stream_naive_loses_spaces_with_a_sentencepiece_decoder():
    toy = sentencepiece_style_tokenizer(["<unk>", "▁Tea", "▁or", "▁coffee", "▁", "<0xE2>", "<0x98>",
                                         "<0x95>", "?"])
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    assert toy.decode(ids) == "Tea or coffee ☕?"
    assert "".join(stream_naive(toy, ids)) == "Teaorcoffee\ufffd\ufffd\ufffd?"
    assert "".join(stream_incremental(toy, ids)) == toy.decode(ids)


def test_stop_string_across_tokens(model, greedy):
    tok = model.tokenizer
    prompt_ids, tokens, _ = greedy
    text = tok.decode(tokens)
    where = next(loc for i in range(1, len(text) - 4)
                 if (loc := locate_in_tokens(tok, tokens, text[i:i + 4]))
                 and loc["starts_inside"] and loc["tokens_spanned"] == 2
                 and text.find(text[i:i + 4]) == i)
    stop = text[where["start"]:where["start"] + 4]
    assert stop_naive_per_token(tok, tokens, [stop]) is None  # no token's own text holds it
    consumed, kept = stop_text_level(tok, tokens, [stop])
    assert consumed == where["last_token"] + 1
    assert kept == text[:where["start"]]
    engine = generate(model, prompt_ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                        stop=(stop,)))
    assert engine.finish_reason == "stop" and engine.text == kept
    # a stop string inside one token is found by both checks
    inside = tok.decode([tokens[1]])
    assert stop_naive_per_token(tok, tokens, [inside]) is not None
    assert locate_in_tokens(tok, tokens, "no such text") is None


def test_flop_count_matches_gpt2_by_hand():
    config = GPT2Config()
    matmul_params = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)  # 84,934,656
    one_token = pass_flops(config, 1, logits_positions=0)
    assert one_token == 2 * matmul_params + 2 * 2 * 768 * 12  # weights + attention to itself
    assert pass_flops(config, 1) - one_token == 2 * 768 * 50257
    # the source's 27x (GPT-2, 17 + 64 tokens) is what the arithmetic predicts
    flops = generation_flops(config, 17, 64)
    assert 26 < flops["naive"] / flops["check"] < 28
    assert flops["cached"] < flops["check"]  # the check also scores the prompt positions


def test_flop_count_of_the_llama_config(model):
    c = model.config
    per_layer = sum(t.numel() for n, t in model.layers[0].weights().items() if "norm" not in n)
    assert pass_flops(c, 3, logits_positions=0) == 2 * 3 * per_layer * c.num_layers + \
        2 * 2 * c.num_heads * c.head_dim * (1 + 2 + 3) * c.num_layers
    with pytest.raises(TypeError):
        pass_flops(object(), 1)


def test_time_in_turns_runs_in_rounds_and_logs_every_call():
    from labkit.experiments.naive_generation import time_in_turns

    calls = []
    runners = {"long": lambda: calls.append("long") or 1, "check": lambda: calls.append("check") or 2}
    got = time_in_turns(runners, rounds=2, checks_per_round=3, check="check", warmup=1)
    assert calls == ["long", "check"] + (["long"] + ["check"] * 3) * 2  # warm-up, then rounds
    assert len(got["timings"]["long"].samples) == 2 and len(got["timings"]["check"].samples) == 6
    assert got["results"]["check"] == [2] * 6
    assert [row["what"] for row in got["log"]] == (["long"] + ["check"] * 3) * 2
    assert [row["round"] for row in got["log"]] == [0] * 4 + [1] * 4
    assert all(row["wall_s"] > 0 and row["cpu_share"] >= 0 for row in got["log"])
    with pytest.raises(ValueError):
        time_in_turns(runners, rounds=1, check="missing")
    with pytest.raises(ValueError):
        time_in_turns(runners, rounds=0)


def test_slowest_reading_tells_a_held_off_call_from_a_busy_one():
    from labkit.experiments.naive_generation import slowest_reading

    def log(walls, shares):
        return [{"what": "pass", "wall_s": w, "cpu_share": s} for w, s in zip(walls, shares)]

    assert "median stands for every call" in slowest_reading(
        log([1.0, 1.1, 1.2], [0.9, 0.9, 0.9]), "pass")
    held = slowest_reading(log([1.0, 1.0, 1.0, 10.0], [0.95, 0.95, 0.95, 0.1]), "pass")
    assert "held off the CPU" in held and "10.0 times" in held
    busy = slowest_reading(log([1.0, 1.0, 1.0, 3.0], [0.95, 0.95, 0.95, 0.9]), "pass")
    assert "spent computing" in busy
    with pytest.raises(ValueError):
        slowest_reading([], "pass")


def test_against_prediction():
    from labkit.experiments.naive_generation import against_prediction

    assert against_prediction(29.0, 31.0, 27.5) == "above"
    assert against_prediction(20.0, 25.0, 27.5) == "below"
    assert against_prediction(26.0, 29.0, 27.5) == "within the interval of"
    with pytest.raises(ValueError):
        against_prediction(2.0, 1.0, 1.5)


def test_step_growth_reading_compares_the_time_with_the_arithmetic():
    from labkit.experiments.naive_generation import step_growth_reading

    # chapter 5's run: 46.5 ms -> 93.4 ms (2.0x) while the FLOPs grew about 9.7x
    less = step_growth_reading(0.0465, 0.0934, 1.54e9, 14.9e9)
    assert less.startswith("The time of a naive step grew with the text, but much less")
    assert "2.0 times" in less and "9.7 times the FLOPs" in less
    assert "about as its arithmetic" in step_growth_reading(0.05, 0.40, 1e9, 10e9)
    assert "hardly grew" in step_growth_reading(0.05, 0.06, 1e9, 10e9)
    assert "faster than its arithmetic" in step_growth_reading(0.05, 2.0, 1e9, 10e9)
    with pytest.raises(ValueError):
        step_growth_reading(0.0, 0.1, 1e9, 2e9)
