"""`labkit bench structured`: what a grammar costs, and which grammar engine to use.

Two measurements, written to `--out` (default `results/bench/structured/summary.json`):

1. The grammar engines on the chapter's schema set (`labkit.structured.schemas`), no model:
   per schema and engine (llguidance, xgrammar), the compile time (cache off), the mask
   time per token along one text of the schema (a seeded random walk through llguidance's
   masks), and coverage (the schemas it compiles; JSONSchemaBench instances it gives the
   benchmark's verdict). labkit's engine runs llguidance; this is the table that says why.
2. The engine: 8 requests at once, all unconstrained, against the same 8 with half of them
   under a schema, in one run, alternating which goes first, `--repeats` times. Output
   tokens per second of each, their ratio (median and spread over the repeats), and the
   mask time per constrained token (`LLMEngine.mask_clock`: time inside the matchers and in
   unpacking their masks), each step's fill (the matchers) and unpack apart. The schema asks
   for at least 64 array items, so no constrained request ends before max_tokens, and the
   plain rows ignore EOS, so the two batches decode the same number of tokens.

Timings need a quiet machine; `--quick` only checks the plumbing.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.sampling import SamplingParams
from labkit.structured.contract import InvalidFormat, ResponseFormat, bitmask_words, unpack_bitmask
from labkit.structured.json_fsm import token_bytes
from labkit.structured.llg import LLGuidanceBackend
from labkit.structured.schemas import all_schemas, benchmark

# Never complete within max_tokens: every constrained request decodes as many tokens as a plain one.
LONG_SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "minItems": 64,
                                                          "items": {"type": "string", "maxLength": 12}}},
               "required": ["words"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "List words about the sea, as JSON."}]


@dataclass(frozen=True)
class StructuredConfig:
    model: str = "smollm2-135m"
    quick: bool = False
    repeats: int = 3
    concurrency: int = 8
    max_tokens: int = 64
    threads: int | None = None


def walk_tokens(grammar, vocab: int, eos: int, seed: int, max_tokens: int = 200) -> list[int]:
    """A seeded random path through the grammar's masks (uniform over the allowed tokens,
    EOS taken when allowed): the text each engine's mask time is measured along."""
    rng, matcher, tokens = random.Random(seed), grammar.new_matcher(), []
    out = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    for _ in range(max_tokens):
        matcher.fill_bitmask(out)
        allowed = torch.nonzero(unpack_bitmask(out, vocab)).flatten().tolist()
        if not allowed or eos in allowed:
            break
        token = rng.choice(allowed)
        matcher.consume(token)
        tokens.append(token)
    return tokens


def mask_seconds(grammar, tokens: list[int], vocab: int) -> float | None:
    """Mean time of one mask along `tokens` (None if the engine refuses a token)."""
    matcher, out, spent = grammar.new_matcher(), torch.zeros(bitmask_words(vocab), dtype=torch.int32), 0.0
    for token in tokens:
        started = time.perf_counter()
        matcher.fill_bitmask(out)
        spent += time.perf_counter() - started
        if not matcher.consume(token):
            return None
    return spent / max(1, len(tokens))


def grammar_engines(tokenizer, vocab: int, quick: bool) -> dict:
    """Per schema and engine: compile ms, mask us per token, and coverage."""
    engines = {"llguidance": LLGuidanceBackend(tokenizer, vocab, cache_size=0)}
    not_run = {}
    try:
        from labkit.structured.xgr import XGrammarBackend

        engines["xgrammar"] = XGrammarBackend(tokenizer, vocab)
    except ImportError as error:
        not_run["xgrammar"] = f"not installed ({error})"
    schemas = all_schemas()
    if quick:
        schemas = dict(list(schemas.items())[:4])
    rows = []
    for index, (name, schema) in enumerate(schemas.items()):
        fmt = ResponseFormat.json_schema(schema)
        compiled = {}
        row = {"schema": name}
        for engine_name, engine in engines.items():
            try:
                compiled[engine_name] = engine.compile(fmt)
                row[f"{engine_name}_compile_ms"] = compiled[engine_name].compile_seconds * 1e3
            except InvalidFormat as error:
                row[f"{engine_name}_compile_ms"] = None
                row[f"{engine_name}_error"] = str(error)[:200]
        if "llguidance" in compiled:
            tokens = walk_tokens(compiled["llguidance"], vocab, tokenizer.eos_token_id, seed=index)
            row["tokens"] = len(tokens)
            for engine_name, grammar in compiled.items():
                seconds = mask_seconds(grammar, tokens, vocab)
                row[f"{engine_name}_mask_us"] = None if seconds is None else seconds * 1e6
        rows.append(row)
    coverage = {name: sum(r.get(f"{name}_compile_ms") is not None for r in rows) for name in engines}
    verdicts = {name: [0, 0] for name in engines}  # right, all
    for case in ([] if quick else benchmark()["schemas"]):
        for engine_name, engine in engines.items():
            try:
                grammar = engine.compile(ResponseFormat.json_schema(case["schema"]))
            except InvalidFormat:
                verdicts[engine_name][1] += len(case["tests"])
                continue
            for test in case["tests"]:
                text = json.dumps(test["data"], separators=(", ", ": "), ensure_ascii=False)
                matcher = grammar.new_matcher()
                accepted = all(matcher.consume(t) for t in tokenizer.encode(text)) and matcher.is_accepting()
                verdicts[engine_name][0] += accepted == test["valid"]
                verdicts[engine_name][1] += 1

    def median(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    summary = {name: {"schemas_compiled": coverage[name], "schemas": len(rows),
                      "median_compile_ms": median(f"{name}_compile_ms"), "median_mask_us": median(f"{name}_mask_us"),
                      "benchmark_verdicts_right": verdicts[name][0], "benchmark_instances": verdicts[name][1]}
               for name in engines}
    return {"rows": rows, "summary": summary, "not_run": not_run}


def one_batch(engine: LLMEngine, prompt: list[int], config: StructuredConfig, constrained: bool, seed: int) -> dict:
    fmt = ResponseFormat.json_schema(LONG_SCHEMA)
    # Plain rows ignore EOS: a plain row that stopped early would leave the plain batch thinner
    # steps than the mixed one, and the ratio would compare different work.
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=config.max_tokens,
                             response_format=fmt if constrained and i % 2 == 0 else None,
                             ignore_eos=not (constrained and i % 2 == 0))
              for i in range(config.concurrency)]
    clock_before = (engine.mask_clock.seconds, engine.mask_clock.tokens, engine.mask_clock.steps_recorded)
    started = time.perf_counter()
    outs = engine.generate([prompt] * config.concurrency, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    mask_s, mask_tokens = (engine.mask_clock.seconds - clock_before[0], engine.mask_clock.tokens - clock_before[1])
    clock = engine.mask_clock
    first = len(clock.steps) - (clock.steps_recorded - clock_before[2])
    return {"constrained": constrained, "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "mask_seconds": mask_s, "constrained_tokens": mask_tokens,
            "mask_steps": clock.steps[first:], "mask_step_parts": clock.step_parts[first:],
            "finish": sorted({o.samples[0].finish_reason for o in outs})}


def throughput(model, config: StructuredConfig) -> dict:
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=8192, weights=None))
    prompt = model.tokenizer.encode_chat(PROMPT)
    engine.compile_format(SamplingParams(response_format=ResponseFormat.json_schema(LONG_SCHEMA)))  # not timed
    # Warm-up: one batch of each kind at the timed length. A short one left part of the first
    # timed mixed batch paying one-time set-up (a lowest repeat of 0.80 whose mask time was the
    # others'); both are kept in the record, untimed by the ratio.
    warm = [one_batch(engine, prompt, config, c, seed=10**6) for c in (False, True)]
    runs, ratios = [], []
    for repeat in range(config.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        pair = {c: one_batch(engine, prompt, config, c, seed=1000 * repeat) for c in order}
        runs += [pair[False], pair[True]]
        ratios.append(pair[True]["tokens_per_s"] / pair[False]["tokens_per_s"])
    step_us = sorted(seconds * 1e6 for r in runs if r["constrained"] for seconds, _ in r["mask_steps"])
    steps = [(fill, unpack, rows) for r in runs if r["constrained"]
             for (fill, unpack), (_, rows) in zip(r["mask_step_parts"], r["mask_steps"])]
    mask_s = sum(r["mask_seconds"] for r in runs if r["constrained"])
    mask_tokens = sum(r["constrained_tokens"] for r in runs if r["constrained"])
    return {"runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)], "target_ratio": 0.9,
            "mask_us_per_token": mask_s / mask_tokens * 1e6 if mask_tokens else None,
            # each step's masks timed apart: the median step and the 90th percentile (the tail)
            "mask_step_us_median": statistics.median(step_us) if step_us else None,
            "mask_step_us_p90": step_us[int(0.9 * (len(step_us) - 1))] if step_us else None,
            "mask_steps": len(step_us),
            # the same steps split: the rows' fills (the matchers), per step and per row, and the unpack
            "mask_fill_us_median": _median([f * 1e6 for f, _, _ in steps]),
            "mask_fill_us_per_row_median": _median([f * 1e6 / rows for f, _, rows in steps]),
            "mask_unpack_us_median": _median([u * 1e6 for _, u, _ in steps]),
            "constrained_rows_per_step": max((n for r in runs if r["constrained"] for _, n in r["mask_steps"]),
                                             default=0),
            "warmup_seconds": {"plain": warm[0]["seconds"], "constrained": warm[1]["seconds"]},
            "weights": engine.weights, "blocks_used_after": engine.stats().blocks_used}


def run_structured(config: StructuredConfig, out: str | Path = "results/bench/structured") -> dict:
    import labkit
    from labkit.util.environment import capture
    from labkit.util.timing import num_threads

    if config.quick:
        config = StructuredConfig(model=config.model, quick=True, repeats=1, max_tokens=12, threads=config.threads)
    model = labkit.load_model(config.model)
    with num_threads(config.threads):
        engines = grammar_engines(model.tokenizer, model.config.vocab_size, config.quick)
        served = throughput(model, config)
    record = {"config": asdict(config), "grammar_engines": engines, "throughput": served,
              "environment": capture(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(record, indent=1, default=str))
    return record


def summary_lines(record: dict) -> list[str]:
    lines = []
    for name, s in record["grammar_engines"]["summary"].items():
        lines.append(f"{name}: {s['schemas_compiled']}/{s['schemas']} schemas compiled, median compile "
                     f"{_fmt(s['median_compile_ms'])} ms, median mask {_fmt(s['median_mask_us'])} us/token, "
                     f"benchmark verdicts {s['benchmark_verdicts_right']}/{s['benchmark_instances']}")
    for name, why in record["grammar_engines"]["not_run"].items():
        lines.append(f"{name}: NOT_RUN, {why}")
    t = record["throughput"]
    lines.append(f"half constrained / unconstrained output tokens/s at {record['config']['concurrency']} requests: "
                 f"median {t['median_ratio']:.3f} (spread {t['ratio_spread'][0]:.3f}-{t['ratio_spread'][1]:.3f}, "
                 f"{len(t['ratios'])} repeats; target >= {t['target_ratio']}); mask time "
                 f"{_fmt(t['mask_us_per_token'])} us per constrained token; per step with "
                 f"{t['constrained_rows_per_step']} constrained rows: median {_fmt(t['mask_step_us_median'])} us, "
                 f"p90 {_fmt(t['mask_step_us_p90'])} us ({t['mask_steps']} steps); fill median "
                 f"{_fmt(t.get('mask_fill_us_median'))} us ({_fmt(t.get('mask_fill_us_per_row_median'))} us "
                 f"a row), unpack median {_fmt(t.get('mask_unpack_us_median'))} us")
    return lines


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"
