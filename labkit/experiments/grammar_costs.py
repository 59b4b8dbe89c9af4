"""Chapter 35's costs of a grammar: the hand-written automaton's masks step by step beside
llguidance's, the two grammar engines' compile and mask times on the chapter's schema set,
and what a mask costs a decode step alone and inside a batch.

The automaton is `labkit.structured.json_fsm` (a JSON subset, pure Python); the engines are
`labkit.structured.llg` (the one labkit's engine runs) and `labkit.structured.xgr`; the
batch measurement is `labkit bench structured`'s (`labkit.bench.structured.throughput`) at
the chapter's sizes.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from labkit.bench.structured import LONG_SCHEMA, PROMPT, StructuredConfig, throughput
from labkit.sampling import SamplingParams
from labkit.structured.contract import InvalidFormat, ResponseFormat, bitmask_words, unpack_bitmask
from labkit.structured.json_fsm import FSMGrammar
from labkit.structured.llg import LLGuidanceBackend
from labkit.util.compare import MIN_SAMPLES, Comparison, compare

# -------------------------------------------------------------------------- the automaton, step by step


@dataclass(frozen=True)
class MaskStep:
    """One decode step of a text: how many tokens each side allows before `token` is read."""

    step: int
    token: str             # the token the text takes here ("<end>" after the last one)
    fsm_allowed: int       # tokens the hand-written automaton allows
    library_allowed: int   # tokens llguidance allows
    relation: str          # "same", "forced" (llguidance forces one token the automaton allows too), "differ"
    fsm_ms: float          # the automaton's mask: a new DFA state walks the trie, a seen one is a copy
    fsm_new_state: bool    # the automaton met this state for the first time (its mask was computed)
    library_us: float      # time of llguidance's mask


def mask_trace(fsm: FSMGrammar, library_grammar, token_ids: list[int], vocab: int) -> list[MaskStep]:
    """Walk a text's tokens through both matchers and compare their masks before every token.

    Where the grammar forces a piece of text (a property name, say), llguidance allows only
    the one token its tokenizer would spell it with ("forced"); the automaton allows every
    token that is a prefix of the piece. Any other difference is "differ"."""
    ours_m, theirs_m = fsm.new_matcher(), library_grammar.new_matcher()
    a = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    b = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    steps = []
    for index, token in enumerate([*token_ids, None]):
        new_state = ours_m.state not in fsm.masks
        started = time.perf_counter()
        ours_m.fill_bitmask(a)
        fsm_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        theirs_m.fill_bitmask(b)
        library_us = (time.perf_counter() - started) * 1e6
        ours, theirs = unpack_bitmask(a, vocab), unpack_bitmask(b, vocab)
        if torch.equal(ours, theirs):
            relation = "same"
        elif int(theirs.sum()) == 1 and bool(ours[theirs].all()):
            relation = "forced"
        else:
            relation = "differ"
        piece = "<end>" if token is None else (fsm.pieces[token] or b"").decode("utf-8", "replace")
        steps.append(MaskStep(index, piece, int(ours.sum()), int(theirs.sum()), relation, fsm_ms, new_state,
                              library_us))
        if token is None:
            break
        if not (ours_m.consume(token) and theirs_m.consume(token)):
            raise ValueError(f"token {token} at step {index} is refused; the text is not of this schema")
    return steps


def automaton_agreement(tokenizer, vocab: int, library, texts: dict[str, list[list[int]]],
                        schemas: dict[str, dict]) -> dict:
    """`mask_trace` along every text of every subset schema: how many steps had the same mask,
    a forced token, or a difference; and the masks' times (a new automaton state, a cached one,
    llguidance's)."""
    from labkit.structured.json_fsm import token_bytes

    pieces = token_bytes(tokenizer)
    steps: list[MaskStep] = []
    for name, token_lists in texts.items():
        fsm = FSMGrammar(schemas[name], tokenizer, vocab, pieces)
        grammar = library.compile(ResponseFormat.json_schema(schemas[name]))
        for token_ids in token_lists:
            steps += mask_trace(fsm, grammar, token_ids, vocab)
    new = [s.fsm_ms for s in steps if s.fsm_new_state]
    cached = [s.fsm_ms for s in steps if not s.fsm_new_state]
    return {"texts": sum(len(v) for v in texts.values()), "steps": len(steps),
            **{kind: sum(s.relation == kind for s in steps) for kind in ("same", "forced", "differ")},
            "new_state_ms": statistics.median(new) if new else None,
            "cached_state_ms": statistics.median(cached) if cached else None,
            "library_us": statistics.median(s.library_us for s in steps) if steps else None}


# -------------------------------------------------------------------------- the two grammar engines


@dataclass(frozen=True)
class EngineRuns:
    """Per schema and engine: median compile ms over `repeats`, and the median mask us per step
    along the model's own constrained replies (each step timed apart; the median over steps,
    then over repeats); which schemas each engine refused, with its reason; the threads
    xgrammar compiled with; and the median time to a new schema's first mask (compile plus
    the first fill of a fresh matcher: what a request with an unseen schema waits before its
    first constrained token, whether the engine does its work eagerly or lazily)."""

    rows: list[dict]
    compile_ms: dict[str, dict[str, float]]   # engine -> schema -> median ms
    mask_us: dict[str, dict[str, float]]      # engine -> schema -> median us per step
    refused: dict[str, dict[str, str]]
    text_tokens: int
    xgrammar_threads: int
    first_mask_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # engine -> schema -> ms


def grammar_engines(tokenizer, vocab: int, schemas: dict[str, dict], texts: dict[str, list[list[int]]],
                    repeats: int, xgrammar_threads: int = 1) -> EngineRuns:
    """Compile every schema in both engines (no cache) `repeats` times and time each engine's
    mask at every step of the token sequences the model produced under the mask (`texts`,
    per schema; llguidance's masks, as labkit's engine runs it). A schema an engine refuses
    to compile, or whose replies it refuses (the two disagree on what the schema allows:
    xgrammar, for one, reads `properties` without `type` as "an object", where JSON Schema
    allows any value), counts against that engine's coverage; times cover only the schemas
    both take, so the two are timed on the same work, schema by schema."""
    from labkit.structured.xgr import XGrammarBackend  # optional dependency: import where asked

    engines = {"llguidance": LLGuidanceBackend(tokenizer, vocab, cache_size=0),
               "xgrammar": XGrammarBackend(tokenizer, vocab, max_threads=xgrammar_threads)}
    refused: dict[str, dict[str, str]] = {name: {} for name in engines}
    kept: dict[str, list[list[int]]] = {}
    for name, schema in schemas.items():
        fmt = ResponseFormat.json_schema(schema)
        for engine_name, engine in engines.items():
            try:
                grammar = engine.compile(fmt)
            except InvalidFormat as error:
                refused[engine_name][name] = str(error).splitlines()[0][:160]
                continue
            # llguidance: drop a trailing stop token the engine allowed besides the grammar
            if engine_name == "llguidance":
                kept[name] = [t[:k] if (k := refuses_at(grammar, t)) is not None else t
                              for t in texts.get(name, [])]
            elif name in kept:
                for text in kept[name]:
                    stuck = refuses_at(grammar, text)
                    if stuck is not None:  # the engines disagree on the schema's language
                        tail = tokenizer.decode(text[:stuck + 1])[-40:]
                        refused[engine_name][name] = (f"refuses a reply llguidance allows, at token {stuck}: "
                                                      f"{tail!r}")
                        break
    both = [n for n in schemas if n not in refused["llguidance"] and n not in refused["xgrammar"]
            and any(kept.get(n, []))]
    compile_runs = {(e, n): [] for e in engines for n in both}
    mask_runs = {(e, n): [] for e in engines for n in both}
    first_runs = {(e, n): [] for e in engines for n in both}
    for repeat in range(repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in both:
            for engine_name in order:
                grammar = engines[engine_name].compile(ResponseFormat.json_schema(schemas[name]))
                compile_runs[engine_name, name].append(grammar.compile_seconds * 1e3)
                per_text = [step_mask_us(grammar, text, vocab) for text in kept[name]]
                first_runs[engine_name, name].append(grammar.compile_seconds * 1e3 + per_text[0][0] / 1e3)
                mask_runs[engine_name, name].append(statistics.median(us for t in per_text for us in t))
    compile_ms = {e: {n: statistics.median(compile_runs[e, n]) for n in both} for e in engines}
    mask_us = {e: {n: statistics.median(mask_runs[e, n]) for n in both} for e in engines}
    first_ms = {e: {n: statistics.median(first_runs[e, n]) for n in both} for e in engines}
    rows = []
    for name in schemas:
        row = {"schema": name, "reply tokens": sum(len(t) for t in kept.get(name, []))}
        for engine_name in engines:
            row[f"{engine_name} compile (ms)"] = compile_ms[engine_name].get(name)
            row[f"{engine_name} to first mask (ms)"] = first_ms[engine_name].get(name)
            row[f"{engine_name} mask (us/step, median)"] = mask_us[engine_name].get(name)
            row[f"{engine_name} refuses"] = refused[engine_name].get(name, "")
        rows.append(row)
    return EngineRuns(rows, compile_ms, mask_us, refused, sum(len(t) for n in both for t in kept[n]),
                      xgrammar_threads, first_ms)


def step_mask_us(grammar, token_ids: list[int], vocab: int) -> list[float]:
    """Each step's mask time (us) along `token_ids`, timed apart, the last (after the text) included."""
    matcher, out, times = grammar.new_matcher(), torch.zeros(bitmask_words(vocab), dtype=torch.int32), []
    for token in [*token_ids, None]:
        started = time.perf_counter()
        matcher.fill_bitmask(out)
        times.append((time.perf_counter() - started) * 1e6)
        if token is None:
            break
        if not matcher.consume(token):
            raise ValueError(f"token {token} refused: the text is not of this grammar's language")
    return times


def paired_ratio(a: dict[str, float], b: dict[str, float], *, name_a: str, name_b: str,
                 confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> Comparison:
    """b over a, paired by schema: the geometric mean over schemas of b's time / a's time, with a
    percentile bootstrap over the schemas (the unit that varies). Above 1: `a` took less time.
    Fewer than three schemas give an interval that says nothing (0 to infinity)."""
    names = [n for n in a if n in b and a[n] > 0 and b[n] > 0]
    logs = torch.tensor([math.log(b[n] / a[n]) for n in names], dtype=torch.float64)
    if len(names) < MIN_SAMPLES:
        ratio = float(logs.mean().exp()) if names else float("nan")
        return Comparison(name_a, name_b, ratio, 0.0, float("inf"), confidence, len(names), len(names))
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(names), (resamples, len(names)), generator=generator)
    means = logs[picks].mean(dim=1).exp()
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    return Comparison(name_a, name_b, float(logs.mean().exp()), float(low), float(high), confidence,
                      len(names), len(names))


def refuses_at(grammar, token_ids: list[int]) -> int | None:
    """The index of the first token a fresh matcher of `grammar` refuses (None: it takes all)."""
    matcher = grammar.new_matcher()
    return next((k for k, token in enumerate(token_ids) if not matcher.consume(token)), None)


def engine_verdicts(runs: EngineRuns) -> dict[str, Comparison]:
    """llguidance against xgrammar, paired by schema: compile time, time to the first mask
    (compile and first fill), and median mask time per step ("faster" means llguidance took
    less time, beyond the spread across schemas)."""
    return {"compile": paired_ratio(runs.compile_ms["llguidance"], runs.compile_ms["xgrammar"],
                                    name_a="llguidance", name_b="xgrammar"),
            "first mask": paired_ratio(runs.first_mask_ms["llguidance"], runs.first_mask_ms["xgrammar"],
                                       name_a="llguidance", name_b="xgrammar"),
            "mask": paired_ratio(runs.mask_us["llguidance"], runs.mask_us["xgrammar"],
                                 name_a="llguidance", name_b="xgrammar")}


def pick_engine(verdicts: dict[str, Comparison]) -> tuple[str, str]:
    """The engine to run, and why, from the timings: the time to a new schema's first mask
    (compile plus first fill: paid on every new schema before the first token, by a lazy engine
    as well as an eager one; compile time alone where no first-mask verdict is given), then
    mask time. Refusals do not decide it: `grammar_engines` checks xgrammar against replies
    generated under llguidance's mask, so only xgrammar can refuse one (the check is one-way)."""
    first = verdicts.get("first mask", verdicts["compile"])
    what = "gives a new schema's first mask" if "first mask" in verdicts else "compiles"
    if first.verdict != "within the noise":
        best = "llguidance" if first.verdict == "faster" else "xgrammar"
        return best, f"it {what} faster ({first.interval_text()} ratio)"
    if verdicts["mask"].verdict != "within the noise":
        best = "llguidance" if verdicts["mask"].verdict == "faster" else "xgrammar"
        return best, "time to a first mask within the noise; its masks are faster"
    return "llguidance", "no difference beyond the noise: kept, as the engine labkit already runs"


# -------------------------------------------------------------------------- a mask inside a step


def batch_cost(model, *, concurrency: int, max_tokens: int, repeats: int) -> dict:
    """`labkit bench structured`'s engine measurement at these sizes: `concurrency` requests
    at once, all plain against half constrained (every constrained one runs to max_tokens),
    alternating which goes first; with one request it is a constrained request alone."""
    config = StructuredConfig(concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    record = throughput(model, config)
    plain = [r["seconds"] for r in record["runs"] if not r["constrained"]]
    mixed = [r["seconds"] for r in record["runs"] if r["constrained"]]
    same_tokens = len({r["output_tokens"] for r in record["runs"]}) == 1
    return {**record, "plain_seconds": plain, "mixed_seconds": mixed, "same_tokens": same_tokens,
            "comparison": compare(plain, mixed, name_a="all plain", name_b="with constrained rows")}


# a row's fill in the engine reads as llguidance's bare mask only within this factor of it: the
# engine adds a bitmask allocation and two checks a row, and the two clocks run along different
# replies of the same schema, so a fill half again the mask's holds work this run does not name
FILL_AS_BARE_MASK = 1.15


def fill_is_bare_mask(row_fill_us: list[float], bare_mask_us: float) -> bool:
    """Whether every per-row fill (the request alone, a batch) stays within `FILL_AS_BARE_MASK`
    times llguidance's bare mask step on the same schema: only then is a row's fill that mask."""
    return max(row_fill_us) < FILL_AS_BARE_MASK * bare_mask_us


def long_schema_replies(engine, tokenizer, count: int, max_tokens: int,
                        first_seed: int = 0) -> list[list[int]]:
    """`count` replies under `labkit bench structured`'s LONG_SCHEMA to its prompt, sampled at
    temperature 1 with their own seeds: the batch measurement's kind of text, for timing the
    engines' masks along it."""
    fmt = ResponseFormat.json_schema(LONG_SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=first_seed + k, max_tokens=max_tokens, response_format=fmt)
              for k in range(count)]
    outs = engine.generate([tokenizer.encode_chat(PROMPT)] * count, params)
    return [list(o.samples[0].token_ids) for o in outs]
