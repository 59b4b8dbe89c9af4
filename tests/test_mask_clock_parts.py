"""The engine's mask clock, each step split into fill and unpack (checked against the step's
own total and against an engine run), and `labkit bench structured`'s batches decoding the
same number of tokens (plain rows ignore EOS)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from labkit.bench.structured import StructuredConfig, one_batch, throughput
from labkit.engine import EngineConfig, LLMEngine
from labkit.sampling import SamplingParams
from labkit.structured import ResponseFormat
from labkit.structured.contract import MaskClock
from labkit.structured.schemas import SUBSET


def test_a_steps_parts_add_up_and_are_trimmed_with_it():
    clock = MaskClock()
    clock.MAX_STEPS = 3
    for k in range(10):
        clock.record_step(1.0 + k, 2, fill_seconds=0.25 * k)
    assert len(clock.step_parts) == len(clock.steps) <= 6 and clock.steps_recorded == 10
    assert clock.step_parts[-1] == (2.25, 10.0 - 2.25) and clock.steps[-1] == (10.0, 2)
    for (fill, unpack), (seconds, _) in zip(clock.step_parts, clock.steps):
        assert fill + unpack == seconds
    clock.record_step(1.0, 1)  # unsplit: recorded, parts unknown
    assert all(math.isnan(x) for x in clock.step_parts[-1])


def test_the_engine_records_fill_and_unpack_for_every_masked_step(model):
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=4096))
    fmt = ResponseFormat.json_schema(SUBSET["person"])
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "A person as JSON."}])
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, response_format=fmt if s < 2 else None)
              for s in range(3)]
    engine.generate([prompt] * 3, params)
    clock = engine.mask_clock
    assert clock.steps and len(clock.step_parts) == len(clock.steps)
    for (fill, unpack), (seconds, rows) in zip(clock.step_parts, clock.steps):
        assert fill > 0 and unpack > 0 and math.isclose(fill + unpack, seconds) and rows in (1, 2)


def test_bench_batches_decode_the_same_tokens_and_report_the_split(model):
    record = throughput(model, StructuredConfig(concurrency=4, max_tokens=12, repeats=1))
    assert {r["output_tokens"] for r in record["runs"]} == {4 * 12}
    assert all(r["finish"] == ["length"] for r in record["runs"])
    # the warm-up (one batch of each kind, at the timed length) is recorded apart, never a repeat
    assert len(record["runs"]) == 2 and all(s > 0 for s in record["warmup_seconds"].values())
    fill, unpack = record["mask_fill_us_median"], record["mask_unpack_us_median"]
    assert fill > 0 and unpack > 0 and record["mask_fill_us_per_row_median"] <= fill


class RecordingEngine:
    """Takes a batch's params and answers every request with max_tokens tokens."""

    def __init__(self):
        self.mask_clock, self.params = MaskClock(), []

    def generate(self, prompts, params):
        self.params = list(params)
        sample = SimpleNamespace(finish_reason="length")
        return [SimpleNamespace(token_ids=[0] * p.max_tokens, samples=[sample]) for p in params]


def test_bench_plain_rows_ignore_eos_and_constrained_rows_do_not():
    engine = RecordingEngine()
    one_batch(engine, [1, 2], StructuredConfig(concurrency=4, max_tokens=5), True, seed=0)
    assert [(p.response_format is not None, p.ignore_eos) for p in engine.params] == [
        (True, False), (False, True), (True, False), (False, True)]
    one_batch(engine, [1, 2], StructuredConfig(concurrency=2, max_tokens=5), False, seed=0)
    assert all(p.ignore_eos and p.response_format is None for p in engine.params)
