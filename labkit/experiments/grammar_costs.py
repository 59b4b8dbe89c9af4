"""Chapter 35's costs of a grammar: the hand-written automaton's masks step by step beside
llguidance's, the two grammar engines' compile and mask times on the chapter's schema set,
and what a mask costs a decode step alone and inside a batch.

The automaton is `labkit.structured.json_fsm` (a JSON subset, pure Python); the engines are
`labkit.structured.llg` (the one labkit's engine runs) and `labkit.structured.xgr`; the
batch measurement is `labkit bench structured`'s (`labkit.bench.structured.throughput`) at
the chapter's sizes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from labkit.bench.structured import StructuredConfig, mask_seconds, throughput, walk_tokens
from labkit.structured.contract import InvalidFormat, ResponseFormat, bitmask_words, unpack_bitmask
from labkit.structured.json_fsm import FSMGrammar
from labkit.structured.llg import LLGuidanceBackend
from labkit.util.compare import Comparison, compare

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
    """Per schema and engine: median compile ms and mask us per token over `repeats`; per
    repeat: the whole set's compile seconds and mean mask seconds per token (the samples the
    verdicts compare); and which schemas each engine refused, with its reason."""

    rows: list[dict]
    compile_totals: dict[str, list[float]]
    mask_means: dict[str, list[float]]
    refused: dict[str, dict[str, str]]
    walk_tokens: int


def grammar_engines(tokenizer, vocab: int, schemas: dict[str, dict], repeats: int) -> EngineRuns:
    """Compile every schema in both engines (no cache) `repeats` times and time the mask along
    one seeded walk of each schema (llguidance's masks, EOS when allowed). A schema an engine
    refuses to compile, or whose walk it refuses (the two disagree on what the schema allows:
    xgrammar, for one, reads `properties` without `type` as "an object", where JSON Schema
    allows any value), counts against that engine's coverage; both totals cover only the
    schemas both take, so the two are timed on the same work."""
    from labkit.structured.xgr import XGrammarBackend  # optional dependency: import where asked

    engines = {"llguidance": LLGuidanceBackend(tokenizer, vocab, cache_size=0),
               "xgrammar": XGrammarBackend(tokenizer, vocab)}
    refused: dict[str, dict[str, str]] = {name: {} for name in engines}
    walks: dict[str, list[int]] = {}
    for index, (name, schema) in enumerate(schemas.items()):
        fmt = ResponseFormat.json_schema(schema)
        for engine_name, engine in engines.items():
            try:
                grammar = engine.compile(fmt)
            except InvalidFormat as error:
                refused[engine_name][name] = str(error).splitlines()[0][:160]
                continue
            if engine_name == "llguidance":
                walks[name] = walk_tokens(grammar, vocab, tokenizer.eos_token_id, seed=index)
            elif name in walks:
                stuck = refuses_at(grammar, walks[name])
                if stuck is not None:  # the engines disagree on the schema's language
                    text = tokenizer.decode(walks[name][:stuck + 1])[-40:]
                    refused[engine_name][name] = (f"refuses a text llguidance allows, at token {stuck}: "
                                                  f"{text!r}")
    both = [n for n in schemas if n not in refused["llguidance"] and n not in refused["xgrammar"]]
    compile_ms = {(e, n): [] for e in engines for n in both}
    mask_us = {(e, n): [] for e in engines for n in both}
    compile_totals = {e: [] for e in engines}
    mask_means = {e: [] for e in engines}
    for repeat in range(repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for engine_name in order:
            engine, spent, masked, tokens = engines[engine_name], 0.0, 0.0, 0
            for name in both:
                grammar = engine.compile(ResponseFormat.json_schema(schemas[name]))
                spent += grammar.compile_seconds
                per_token = mask_seconds(grammar, walks[name], vocab)
                if per_token is None:
                    raise AssertionError(f"{engine_name} refuses llguidance's walk of {name}")
                masked += per_token * len(walks[name])
                tokens += len(walks[name])
                compile_ms[engine_name, name].append(grammar.compile_seconds * 1e3)
                mask_us[engine_name, name].append(per_token * 1e6)
            compile_totals[engine_name].append(spent)
            mask_means[engine_name].append(masked / max(1, tokens))
    rows = []
    for name in schemas:
        row = {"schema": name, "walk tokens": len(walks.get(name, []))}
        for engine_name in engines:
            timed = name in both
            key = (engine_name, name)
            row[f"{engine_name} compile (ms)"] = statistics.median(compile_ms[key]) if timed else None
            row[f"{engine_name} mask (us/token)"] = statistics.median(mask_us[key]) if timed else None
            row[f"{engine_name} refuses"] = refused[engine_name].get(name, "")
        rows.append(row)
    return EngineRuns(rows, compile_totals, mask_means, refused, sum(len(walks[n]) for n in both))


def refuses_at(grammar, token_ids: list[int]) -> int | None:
    """The index of the first token a fresh matcher of `grammar` refuses (None: it takes all)."""
    matcher = grammar.new_matcher()
    return next((k for k, token in enumerate(token_ids) if not matcher.consume(token)), None)


def engine_verdicts(runs: EngineRuns) -> dict[str, Comparison]:
    """llguidance against xgrammar: compile time of the set, and mask time per token (the
    shared bootstrap of `labkit.util.compare`; "faster" means llguidance took less time)."""
    return {"compile": compare(runs.compile_totals["llguidance"], runs.compile_totals["xgrammar"],
                               name_a="llguidance", name_b="xgrammar"),
            "mask": compare(runs.mask_means["llguidance"], runs.mask_means["xgrammar"],
                            name_a="llguidance", name_b="xgrammar")}


def pick_engine(verdicts: dict[str, Comparison], refused: dict[str, dict[str, str]]) -> tuple[str, str]:
    """The engine to run, and why: coverage first (a schema refused is a request refused),
    then compile time (paid on every new schema, before the first token), then mask time."""
    fewer = {name: len(r) for name, r in refused.items()}
    if fewer["llguidance"] != fewer["xgrammar"]:
        best = min(fewer, key=fewer.get)
        return best, f"it refuses fewer schemas of the set ({fewer[best]} against {max(fewer.values())})"
    if verdicts["compile"].verdict != "within the noise":
        best = "llguidance" if verdicts["compile"].verdict == "faster" else "xgrammar"
        return best, f"same coverage, and it compiles faster ({verdicts['compile'].interval_text()} ratio)"
    if verdicts["mask"].verdict != "within the noise":
        best = "llguidance" if verdicts["mask"].verdict == "faster" else "xgrammar"
        return best, "same coverage and compile time within the noise; its masks are faster"
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
