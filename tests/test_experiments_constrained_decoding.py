"""Chapter 35's experiment code: reading replies (against `json` and `jsonschema`), the
validity and repair accounting (against counts worked by hand on a scripted engine), the
labelled semantic tasks (against the prompt's own text), the automaton's step-by-step masks
(against a brute-force scan of the vocabulary and llguidance), and the engine pick."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from labkit.experiments import constrained_decoding as cd
from labkit.experiments import grammar_costs as gc
from labkit.experiments.inference_compute import wilson_interval
from labkit.structured import ResponseFormat
from labkit.structured.json_fsm import DFA, FSMGrammar
from labkit.structured.llg import LLGuidanceBackend
from labkit.structured.schemas import SUBSET
from labkit.util.compare import Comparison

PERSON = SUBSET["person"]


# --------------------------------------------------------------------------- reading replies


@pytest.mark.parametrize("text", ['{"a": 1}', '  [1, 2]\n', '"x"', "3"])
def test_strict_reading_is_json_loads_of_the_whole_reply(text):
    assert cd.strict_value(text) == (True, json.loads(text))


@pytest.mark.parametrize("text", ['{"a": 1} and more', "```json\n{}\n```", "Sure!", ""])
def test_strict_reading_refuses_anything_around_the_value(text):
    assert cd.strict_value(text) == (False, None)


def test_lenient_reading_finds_the_first_value_in_chatter_and_fences():
    assert cd.lenient_value('Here: ```json\n{"a": [1, {"b": 2}]}\n``` done') == (True, {"a": [1, {"b": 2}]})
    assert cd.lenient_value('{broken [3, 4] {"x": 1}') == (True, [3, 4])  # the first that parses
    assert cd.lenient_value("no json here { nor here") == (False, None)


def test_the_hunt_says_when_its_value_is_a_piece_of_text_that_is_not_json():
    # the reviewer's case: the outer object does not parse ({0}); the hunt finds an inner one
    text = '{"properties": {"medium": {"default": "None"}, "sizeLimit": {0}}}'
    assert cd.lenient_hit(text) == (True, {"default": "None"}, True)
    assert cd.lenient_hit('Sure: {"a": 1} ok') == (True, {"a": 1}, False)
    assert cd.lenient_hit('"just a string"') == (False, None, False)  # never a bare string
    assert cd.lenient_hit("42") == (False, None, False)
    assert cd.lenient_value(text) == (True, {"default": "None"})


def test_a_schema_echo_is_an_object_with_keywords_the_schema_does_not_declare():
    loose = {"type": "object"}  # any object validates: an echo of it would pass
    echo = cd.repaired_value('Schema: {"additionalProperties": true, "description": "x", ', loose)
    assert echo[1] and cd.schema_echo(echo[2], loose)
    assert cd.schema_echo({"type": "StringDescription", "description": "d"}, loose)
    assert not cd.schema_echo({"name": "A", "age": 3}, PERSON)
    assert not cd.schema_echo({"description": "a field called description"}, loose)
    # a property the schema declares is an answer's field, not an echo
    typed = {"type": "object", "properties": {"type": {"type": "string"}}}
    assert not cd.schema_echo({"type": "cat"}, typed)
    assert not cd.schema_echo(["type"], loose) and not cd.schema_echo("type", loose)


def test_validity_by_source_splits_labkits_schemas_from_the_benchmarks():
    params = SimpleNamespace(temperature=1.0, seed=0)
    good, bad = '{"name": "A", "age": 3, "vegan": true}', '{"name": "A", '
    attempts = [cd.judge("person", PERSON, True, params, good, [1], "stop"),
                cd.judge("person", PERSON, True, params, bad, [1], "length"),
                cd.judge("Bench/one", PERSON, True, params, bad, [1], "length"),
                cd.judge("Bench/one", PERSON, True, params, good, [1], "stop"),
                cd.judge("Bench/one", PERSON, True, params, good, [1], "stop"),
                cd.judge("Bench/one", PERSON, False, params, "no", [1], "stop")]
    rows = {(r["schemas from"], r["mask"]): r for r in cd.by_source(attempts, {"Bench/one"})}
    assert set(rows) == {("written for labkit", "schema mask"), ("JSONSchemaBench", "schema mask"),
                         ("JSONSchemaBench", "no mask")}
    ours, theirs = rows["written for labkit", "schema mask"], rows["JSONSchemaBench", "schema mask"]
    assert (ours["replies"], ours["valid"], ours["not valid, cut at max_tokens"]) == (2, 1, 1)
    assert (theirs["replies"], theirs["valid"], theirs["not valid, cut at max_tokens"]) == (3, 2, 1)
    free = rows["JSONSchemaBench", "no mask"]
    assert (free["replies"], free["valid"], free["not valid, cut at max_tokens"]) == (1, 0, 0)


def test_validity_checks_the_schema_and_its_formats():
    trip = cd.validator(cd.TRIP)
    assert trip.is_valid({"city": "Cork", "first_day": "2025-02-03", "last_day": "2025-02-05"})
    assert not trip.is_valid({"city": "Cork", "first_day": "2025-02-30", "last_day": "2025-02-05"})
    assert not trip.is_valid({"city": "Cork", "first_day": "2025-02-03"})


def test_judge_reads_both_ways():
    params = SimpleNamespace(temperature=1.0, seed=3)
    fenced = cd.judge("person", PERSON, False, params, '```json\n{"name": "A", "age": 3, "vegan": true}\n```',
                      [1, 2], "stop")
    assert (fenced.strict_valid, fenced.lenient_valid, fenced.seed) == (False, True, 3)
    bare = cd.judge("person", PERSON, True, params, '{"name": "A", "age": 3, "vegan": true}', [1], "stop")
    assert bare.strict_valid and bare.lenient_valid
    wrong_type = cd.judge("person", PERSON, True, params, '{"name": "A", "age": "3", "vegan": true}', [1],
                          "stop")
    assert not wrong_type.strict_valid and not wrong_type.lenient_valid


def attempt(schema, constrained, seed, valid, tokens, finish="stop", temperature=1.0):
    return cd.Attempt(schema, constrained, temperature, seed, "", tuple(range(tokens)), finish, valid, valid)


def test_validity_rows_count_and_give_wilson_intervals():
    attempts = [attempt("a", False, 0, False, 5, "length"), attempt("b", False, 0, True, 3),
                attempt("c", False, 0, False, 4), attempt("a", True, 0, True, 2),
                attempt("b", True, 0, True, 2), attempt("c", True, 0, False, 9, "length")]
    free, masked = cd.validity_rows(attempts, "m")
    counts = ("mask", "valid, whole reply", "cut at max_tokens", "stopped but invalid")
    assert [free[k] for k in counts] == ["none", 1, 1, 1]
    assert (masked["mask"], masked["valid, whole reply"], masked["stopped but invalid"]) == ("schema", 2, 0)
    assert (masked["low"], masked["high"]) == pytest.approx(wilson_interval(2, 3))
    # Wilson's closed form at 0 of 3: upper bound z^2 / (n + z^2)
    z2 = 1.959963984540054 ** 2
    assert wilson_interval(0, 3)[1] == pytest.approx(z2 / (3 + z2))
    assert cd.by_schema(attempts)[0] == {"schema": "a", "no mask: valid": "0/1", "schema mask: valid": "1/1"}


def test_validity_run_gives_every_request_its_own_seed():
    """A step's draw depends only on (seed, step): requests sharing a seed share a stream."""
    schemas = {"a": PERSON, "b": PERSON, "c": PERSON}
    good = '{"name": "A", "age": 3, "vegan": true}'
    engine = ScriptedEngine({(c, s): (good, 4) for c in (False, True) for s in range(100, 112)})
    attempts = cd.validity_run(engine, PlainTokenizer(), schemas, 2, temperature=1.0, max_tokens=8,
                               first_seed=100)
    seeds = [p.seed for p in engine.params]
    assert sorted(seeds) == list(range(100, 112)) and [a.seed for a in attempts] == seeds
    assert [(a.schema, a.constrained, a.draw) for a in attempts[:3]] == [("a", False, 0), ("a", False, 1),
                                                                        ("b", False, 0)]
    assert sum(a.constrained for a in attempts) == 6 and all(a.strict_valid for a in attempts)
    only_masked = cd.validity_run(engine, PlainTokenizer(), schemas, 1, temperature=1.0, max_tokens=8,
                                  first_seed=100, arms=(True,))
    assert [a.constrained for a in only_masked] == [True] * 3 and len({a.seed for a in only_masked}) == 3


def test_pairs_draws_and_the_guarantee_count_by_schema_and_draw():
    attempts = [attempt("a", True, 5, True, 2), attempt("b", False, 2, False, 3),
                attempt("a", False, 1, False, 4), attempt("b", True, 6, False, 9, "length"),
                cd.Attempt("a", False, 1.0, 3, "", (1,), "stop", True, True, draw=1),
                cd.Attempt("a", True, 1.0, 7, "", (1,), "stop", False, False, draw=1),
                attempt("c", True, 8, True, 9, "length")]  # valid at the budget: valid, not cut
    free, masked = cd.paired_outcomes(attempts)
    # free in their own order: b/0 (False, masked False), a/0 (False, masked True), a/1 (True, False)
    assert (free, masked) == ([False, False, True], [False, True, False])
    assert cd.draw_counts(attempts, True) == [2, 0] and cd.draw_counts(attempts, False) == [0, 1]
    assert cd.guarantee_counts(attempts) == {"replies": 4, "seeds": 4, "valid": 2, "cut at max_tokens": 1,
                                             "stopped, not valid": 1}


# --------------------------------------------------------------------------- repair accounting


class ScriptedEngine:
    """Answers each request from a script keyed by (constrained, seed): (text, tokens)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        self.params = list(params)
        outs = []
        for p in params:
            text, tokens, *finish = self.script[(p.response_format is not None, p.seed)]
            sample = SimpleNamespace(text=text, token_ids=list(range(tokens)),
                                     finish_reason=finish[0] if finish else "stop")
            outs.append(SimpleNamespace(samples=[sample], text=text))
        return outs


class PlainTokenizer:
    chat_template = None

    def encode(self, text):
        return [len(text)]


def test_repair_counts_every_token_a_sequential_client_pays():
    good, bad = '{"name": "A", "age": 3, "vegan": true}', "not json"
    schemas = {"person": PERSON}
    plain = [cd.judge("person", PERSON, False, SimpleNamespace(temperature=1.0, seed=s), t, range(n), "stop")
             for s, t, n in ((0, good, 10), (1, bad, 20), (2, bad, 30))]
    masked = [cd.judge("person", PERSON, True, SimpleNamespace(temperature=1.0, seed=s), good, range(8),
                       "stop") for s in range(3)]
    # Seeds 0-2 are taken, so new generations step by a stride of 3: retry k of seed s is s + 3k,
    # the masked retry s + 3 * 3. Seed 1: the first retry (seed 4) is valid; seed 2: both retries
    # (5, 8) fail, the masked retry (11) is valid.
    script = {(False, 4): (good, 7), (False, 7): (bad, 9), (False, 5): (bad, 5),
              (False, 8): (bad, 6), (True, 10): (good, 11), (True, 11): (good, 12)}
    engine = ScriptedEngine(script)
    rows = {r["strategy"]: r for r in cd.repair_rows(
        cd.repair_run(engine, PlainTokenizer(), schemas, plain, masked, retries=2, max_tokens=50))}
    assert engine.calls == [2 * 2 + 2]  # one batch: two retries and one masked retry per failed request
    new_seeds = [p.seed for p in engine.params]
    assert len(set(new_seeds)) == len(new_seeds) and not set(new_seeds) & {0, 1, 2}
    assert rows["validate only"]["valid in the end"] == 1
    assert rows["validate only"]["output tokens per request"] == pytest.approx((10 + 20 + 30) / 3)
    retry = rows["retry up to 2x"]
    assert retry["valid in the end"] == 2
    # seed 1 stops after its first retry (7 tokens), not paying the second (9)
    assert retry["output tokens per request"] == pytest.approx((10 + (20 + 7) + (30 + 5 + 6)) / 3)
    assert retry["generations per request"] == pytest.approx((1 + 2 + 3) / 3)
    remask = rows["constrained retry"]
    assert remask["valid in the end"] == 3
    assert remask["output tokens per request"] == pytest.approx((10 + (20 + 11) + (30 + 12)) / 3)
    assert rows["constrained from the start"]["output tokens per request"] == 8


@pytest.mark.parametrize("text,repaired", [
    ('Sure: {"a": 1, "b": [1, 2,', '{"a": 1, "b": [1, 2]}'),
    ('```json\n{"a": "hel', '{"a": "hel"}'),
    ('{"a": 1} and then {"b"', '{"a": 1}'),
    ('{"a": 1, "b":', '{"a": 1}'),
    ('{"a": 1, "b', '{"a": 1}'),
    ('{"a": [1, 2,], }', '{"a": [1, 2]}'),
    ('[1, 2]]', '[1, 2]'),
    ('{"a": "say \\"hi', '{"a": "say \\"hi"}'),
    ("no json here", None),
])
def test_repair_text_closes_and_cuts(text, repaired):
    out = cd.repair_text(text)
    assert out == repaired
    if out is not None:
        json.loads(out)  # every case above repairs to text json accepts


def test_repair_is_counted_at_no_extra_tokens():
    schemas = {"person": PERSON}
    cut = '{"name": "A", "age": 3, "vegan": true'
    plain = [cd.judge("person", PERSON, False, SimpleNamespace(temperature=1.0, seed=s), t, range(10),
                      "length")
             for s, t in ((0, cut), (1, "not json"))]
    engine = ScriptedEngine({(False, 2): ("x", 1), (False, 3): ("x", 1),
                             (True, 4): ("x", 1), (True, 5): ("x", 1)})
    rows = {r["strategy"]: r for r in cd.repair_rows(
        cd.repair_run(engine, PlainTokenizer(), schemas, plain, [], retries=1, max_tokens=50))}
    fixed = rows["repair the text"]
    assert fixed["valid in the end"] == 1 and fixed["output tokens per request"] == 10
    assert rows["validate only"]["valid in the end"] == 0


# --------------------------------------------------------------------------- valid but wrong


def test_semantic_labels_are_the_prompts_own_facts():
    tasks = cd.semantic_tasks(4, seed=1)
    assert [t.kind for t in tasks[:3]] == ["copy", "sum", "order"] and len(tasks) == 12
    for task in tasks:
        if task.kind == "copy":
            said = re.fullmatch(r"(.+) is (\d+) years old and lives in (\w+)\.", task.prompt)
            name, age, city = said.groups()
            assert task.expected == {"name": name, "age": int(age), "city": city}
        elif task.kind == "sum":
            prices = {i: int(p) for i, p in re.findall(r"a (\w+) costs (\d+) dollars", task.prompt)}
            assert task.expected == {"prices": prices, "total": sum(prices.values())}
        else:
            city, first, last = re.fullmatch(r"The trip to (\w+) starts on (\S+) and ends on (\S+)\.",
                                             task.prompt).groups()
            assert task.expected == {"city": city, "first_day": first, "last_day": last} and first < last
    assert cd.semantic_tasks(4, seed=1) == tasks


def test_semantic_checks_catch_what_the_schema_cannot():
    copy, bill, trip = cd.semantic_tasks(1, seed=0)
    right_bill = {"items": [{"name": n.capitalize(), "price": p} for n, p in bill.expected["prices"].items()],
                  "total": bill.expected["total"]}
    assert cd.validator(bill.schema).is_valid(right_bill)
    assert all(cd.semantic_checks(bill, right_bill).values())
    wrong_total = {**right_bill, "total": right_bill["total"] + 1}
    assert cd.validator(bill.schema).is_valid(wrong_total)
    checks = cd.semantic_checks(bill, wrong_total)
    assert checks["prices copied"] and not checks["total is the bill's"]
    assert not checks["total is the sum of its own items"]
    swapped = {"city": trip.expected["city"], "first_day": trip.expected["last_day"],
               "last_day": trip.expected["first_day"]}
    assert cd.validator(trip.schema).is_valid(swapped)
    assert cd.semantic_checks(trip, swapped) == {"dates copied": False, "first day not after last day": False,
                                                 "city copied": True}
    older = {**copy.expected, "age": copy.expected["age"] + 1}
    assert cd.semantic_checks(copy, older) == {"name copied": True, "age copied": False, "city copied": True}
    judged = cd.Judged(copy, 0, "", True, cd.semantic_checks(copy, older))
    assert not judged.right and cd.semantic_rows([judged])[0]["valid but wrong"] == 1


def test_free_semantic_replies_are_repaired_then_judged():
    task = cd.semantic_tasks(1, seed=0)[0]  # a "copy" task: name, age, city from the prompt
    right = json.dumps(task.expected)
    engine = ScriptedEngine({(False, 0): ("Here it is: " + right[:-1] + ",", 5)})
    [free] = cd.semantic_run(engine, PlainTokenizer(), [task], [0], temperature=0.0, max_tokens=9,
                             constrained=False, repair=True)
    assert not free.constrained and free.repaired and free.valid and free.right
    [raw] = cd.semantic_run(engine, PlainTokenizer(), [task], [0], temperature=0.0, max_tokens=9,
                            constrained=False)
    assert not raw.valid and not raw.repaired
    row = cd.semantic_rows([free])[0]
    assert row["valid only after repair"] == 1 and row["mask"] == "none, then repaired"


def test_semantic_rows_count_replies_cut_at_the_budget():
    task = cd.semantic_tasks(1, seed=0)[1]  # a bill
    engine = ScriptedEngine({(True, 0): ('{"items": [{"name": "pen", "price": 3}', 9, "length"),
                             (True, 1): ('{"items": [], "total": 0}', 9, "stop"),
                             (True, 2): ('{"items": [', 9, "stop")})
    judged = cd.semantic_run(engine, PlainTokenizer(), [task], [0, 1, 2], temperature=1.0, max_tokens=9)
    assert [(j.valid, j.finish) for j in judged] == [(False, "length"), (True, "stop"), (False, "stop")]
    row = cd.semantic_rows(judged)[0]
    assert (row["schema-valid"], row["not valid, cut at max_tokens"]) == (1, 1)


def test_prompts_go_through_the_chat_template_only_where_asked(model):
    chat = cd.schema_prompt(model.tokenizer, PERSON, "A task.")
    plain = cd.schema_prompt(model.tokenizer, PERSON, "A task.", chat=False)
    text = f"A task.\n{cd.INSTRUCTION}\nSchema: {json.dumps(PERSON)}"
    assert chat == model.tokenizer.encode_chat([{"role": "user", "content": text}])
    assert plain == model.tokenizer.encode(text + "\nJSON:")


# --------------------------------------------------------------------------- the automaton, step by step


@pytest.fixture(scope="module")
def library(model):
    return LLGuidanceBackend(model.tokenizer, model.config.vocab_size)


def test_mask_trace_counts_are_a_scan_of_the_vocabulary_and_llguidances(model, library):
    tok, vocab = model.tokenizer, model.config.vocab_size
    fsm = FSMGrammar(PERSON, tok, vocab)
    grammar = library.compile(ResponseFormat.json_schema(PERSON))
    text = '{"name": "Ann \\"Jo\\"", "age": -12, "vegan": false}'
    token_ids = tok.encode(text)
    trace = gc.mask_trace(fsm, grammar, token_ids, vocab)
    assert len(trace) == len(token_ids) + 1 and trace[-1].token == "<end>"
    assert {s.relation for s in trace} <= {"same", "forced"} and any(s.relation == "forced" for s in trace)
    # an independent count: every token whose bytes the DFA reads from the state, scanned one by one
    state = fsm.dfa.start
    for step, token in zip(trace[:6], token_ids[:6]):
        scanned = sum(1 for piece in fsm.pieces if piece and fsm.dfa.run(piece, state) != DFA.DEAD)
        assert step.fsm_allowed == scanned
        state = fsm.dfa.run(fsm.pieces[token], state)
    assert trace[-1].fsm_allowed == trace[-1].library_allowed == 1  # EOS alone
    with pytest.raises(ValueError, match="refused"):
        gc.mask_trace(fsm, grammar, tok.encode('{"nome"'), vocab)


def test_automaton_agreement_counts_every_step(model, library):
    tok = model.tokenizer
    texts = {"enums": [tok.encode('{"color": "blue", "size": null}')],
             "arrays": [tok.encode('{"tags": ["a", "b"], "scores": []}'), tok.encode('{"tags": [')]}
    found = gc.automaton_agreement(tok, model.config.vocab_size, library, texts, SUBSET)
    assert found["texts"] == 3 and found["differ"] == 0
    steps = sum(len(t) + 1 for ts in texts.values() for t in ts)
    assert found["steps"] == steps == found["same"] + found["forced"]
    assert found["new_state_ms"] > 0 and found["library_us"] > 0


# --------------------------------------------------------------------------- the engines and the pick


def comparison(low, high):
    return Comparison("llguidance", "xgrammar", (low + high) / 2, low, high, 0.95, 5, 5)


def test_pick_goes_by_first_mask_then_compile_then_mask():
    faster, slower, tie = comparison(2.0, 3.0), comparison(0.3, 0.5), comparison(0.9, 1.1)
    assert gc.pick_engine({"compile": faster, "mask": slower})[0] == "llguidance"
    assert gc.pick_engine({"compile": slower, "mask": faster})[0] == "xgrammar"
    assert gc.pick_engine({"compile": tie, "mask": slower})[0] == "xgrammar"
    assert "noise" in gc.pick_engine({"compile": tie, "mask": tie})[1]
    # with a first-mask verdict the pick goes by it, not by compile time alone
    assert gc.pick_engine({"compile": faster, "first mask": slower, "mask": faster})[0] == "xgrammar"
    assert "first mask" in gc.pick_engine({"compile": slower, "first mask": faster, "mask": tie})[1]
    # refusals do not decide: the check only ever runs xgrammar against llguidance's replies
    assert "refuse" not in gc.pick_engine({"compile": faster, "first mask": faster, "mask": tie})[1]


def test_a_fill_reads_as_the_bare_mask_only_when_every_row_fill_is_near_it():
    bare = 100.0
    assert gc.fill_is_bare_mask([105.0, 110.0], bare)
    assert not gc.fill_is_bare_mask([105.0, 160.0], bare)  # the batch's row decides too
    assert not gc.fill_is_bare_mask([160.0, 105.0], bare)
    assert not gc.fill_is_bare_mask([148.6], bare)  # about half again the mask: not the mask
    assert not gc.fill_is_bare_mask([bare * gc.FILL_AS_BARE_MASK], bare)


def test_grammar_engines_time_both_on_the_same_replies(model):
    pytest.importorskip("xgrammar", reason="xgrammar is the optional cross-check (Makefile installs it)")
    schemas = {"person": PERSON, "refused": {"type": "object", "properties": {"a": {"type": "string",
                                                                                  "pattern": "(("}}}}
    reply = model.tokenizer.encode('{"name": "Ann", "age": 3, "vegan": true}')
    runs = gc.grammar_engines(model.tokenizer, model.config.vocab_size, schemas, {"person": [reply]},
                              repeats=3, xgrammar_threads=1)
    assert set(runs.refused["llguidance"]) == {"refused"} and "refused" in runs.refused["xgrammar"]
    assert runs.compile_ms["llguidance"].keys() == runs.mask_us["xgrammar"].keys() == {"person"}
    person, refused = runs.rows
    assert person["llguidance compile (ms)"] > 0 and person["xgrammar mask (us/step, median)"] > 0
    assert refused["llguidance compile (ms)"] is None and refused["llguidance refuses"]
    assert runs.text_tokens == person["reply tokens"] == len(reply) and runs.xgrammar_threads == 1
    for engine in ("llguidance", "xgrammar"):  # compile plus a first fill: more than the compile
        assert runs.first_mask_ms[engine]["person"] > runs.compile_ms[engine]["person"] > 0
        assert person[f"{engine} to first mask (ms)"] == runs.first_mask_ms[engine]["person"]
    verdicts = gc.engine_verdicts(runs)  # one schema: an interval that says nothing
    assert verdicts["compile"].verdict == "within the noise" and verdicts["mask"].name_b == "xgrammar"
    assert verdicts["first mask"].samples_a == 1


def test_step_mask_times_one_per_step_and_the_end(model, library):
    grammar = library.compile(ResponseFormat.json_schema(PERSON))
    text = model.tokenizer.encode('{"name": "Ann", "age": 3, "vegan": true}')
    times = gc.step_mask_us(grammar, text, model.config.vocab_size)
    assert len(times) == len(text) + 1 and min(times) > 0
    with pytest.raises(ValueError):
        gc.step_mask_us(grammar, model.tokenizer.encode("[1]"), model.config.vocab_size)


def test_paired_ratio_is_the_geometric_mean_over_schemas():
    a = {"s1": 1.0, "s2": 2.0, "s3": 4.0, "s4": 1.0}
    b = {"s1": 2.0, "s2": 8.0, "s3": 4.0, "s4": 2.0, "only_b": 9.0}
    r = gc.paired_ratio(a, b, name_a="a", name_b="b")
    assert r.ratio == pytest.approx((2 * 4 * 1 * 2) ** 0.25) and r.samples_a == 4
    assert r.low <= r.ratio <= r.high
    twice = gc.paired_ratio(a, {k: 2 * v for k, v in a.items()}, name_a="a", name_b="b")
    assert twice.ratio == pytest.approx(2.0) and twice.low == pytest.approx(2.0) and twice.verdict == "faster"
    mixed = gc.paired_ratio(a, {"s1": 3.0, "s2": 1.0, "s3": 12.0, "s4": 0.5}, name_a="a", name_b="b")
    assert mixed.verdict == "within the noise"


def test_the_engines_disagree_on_properties_without_a_type(model, library):
    """JSON Schema: `properties` without `type` constrains objects only, so a string is valid.
    llguidance allows it; xgrammar reads the schema as an object and refuses the first token."""
    pytest.importorskip("xgrammar", reason="xgrammar is the optional cross-check (Makefile installs it)")
    from labkit.structured.xgr import XGrammarBackend

    schema = {"properties": {"a": {"type": "string"}}}
    assert cd.validator(schema).is_valid("just a string")
    tokens = model.tokenizer.encode('"just a string"')
    fmt = ResponseFormat.json_schema(schema)
    assert gc.refuses_at(library.compile(fmt), tokens) is None
    assert gc.refuses_at(XGrammarBackend(model.tokenizer, model.config.vocab_size).compile(fmt), tokens) == 0
    assert gc.refuses_at(library.compile(fmt), model.tokenizer.encode('{"a": 1}')) is not None


def test_long_schema_replies_are_sampled_apart_and_stay_in_the_schema(model, library):
    from labkit.bench.structured import LONG_SCHEMA
    from labkit.engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048))
    replies = gc.long_schema_replies(engine, model.tokenizer, 3, 10, first_seed=7)
    assert len(replies) == 3 and all(len(r) == 10 for r in replies)  # 64 items cannot close in 10
    assert len({tuple(r) for r in replies}) == 3  # own seeds: three different streams
    grammar = library.compile(ResponseFormat.json_schema(LONG_SCHEMA))
    assert all(gc.refuses_at(grammar, r) is None for r in replies)


def test_a_prefilled_reply_is_read_with_its_prefill_and_repairs_are_counted_apart():
    class EchoTokenizer(PlainTokenizer):
        def encode(self, text):
            return [ord(c) for c in text]

    # the model writes the rest of an object once "{" is given; one reply is cut short
    script = {(False, 7): ('"name": "A", "age": 3, "vegan": true}', 9),
              (False, 8): ('"name": "B", "age": 4, "vegan": false', 8, "length"),
              (False, 9): ('"type": "object", "properties": {', 8, "length")}
    engine = ScriptedEngine(script)
    loose = {"type": "object"}
    schemas = {"person": PERSON, "other": PERSON, "loose": loose}
    got = cd.validity_run(engine, EchoTokenizer(), schemas, temperature=1.0, max_tokens=8,
                          first_seed=7, arms=(False,), prefill="{")
    prompt = cd.schema_prompt(EchoTokenizer(), PERSON)
    assert cd.schema_prompt(EchoTokenizer(), PERSON, prefill="{") == [*prompt, ord("{")]
    assert [a.text[0] for a in got] == ["{"] * 3 and got[0].strict_valid
    assert len(got[0].token_ids) == 9  # the prefill is the prompt's, not an output token
    counts = cd.repair_counts(got, schemas)
    assert counts == {"replies": 3, "valid as written": 1, "made valid by the repair": 2,
                      "of those, echoes of the schema": 1, "cut at max_tokens": 2}
