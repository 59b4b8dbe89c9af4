"""Chapter 35's outputs under a schema: validity with and without the mask, validation then
repair, and valid JSON that is still wrong.

Every request, constrained or not, gets the same prompt: an instruction to answer with one
JSON value that validates against the schema, and the schema itself. The only difference
is the mask (`SamplingParams.response_format`, llguidance in labkit's engine). An output is
read two ways: *strict* (the whole reply, stripped, is one JSON value: what a program that
calls `json.loads` on it gets) and *lenient* (the first `{` or `[` in the reply, inner ones
included, at which an object or array parses: what a client that hunts for JSON in chatter and
code fences recovers; a string or number alone is never found this way). It is
*valid* when that value validates against the schema (`jsonschema`, formats checked).
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import jsonschema

from labkit.experiments.inference_compute import wilson_interval
from labkit.sampling import SamplingParams
from labkit.structured import ResponseFormat

INSTRUCTION = "Reply with one JSON value that validates against this JSON Schema, and nothing else."


def schema_prompt(tokenizer, schema: dict, task: str | None = None, chat: bool | None = None,
                  prefill: str = "") -> list[int]:
    """The prompt both kinds of request get: the task (if any), the instruction, the schema.
    As a user turn of the chat template (`chat`; by default where the tokenizer has one), or
    for a base model as plain text ending 'JSON:'. With `prefill` (say "{"), the reply is
    started for the model: the prefill's tokens follow the prompt, and the reply is read as
    the prefill plus what the model writes."""
    text = (f"{task}\n" if task else "") + f"{INSTRUCTION}\nSchema: {json.dumps(schema)}"
    if chat if chat is not None else bool(tokenizer.chat_template):
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    else:
        ids = tokenizer.encode(f"{text}\nJSON:")
    return ids + (tokenizer.encode(prefill) if prefill else [])


def validator(schema: dict):
    """The schema's `jsonschema` validator (its declared draft), checking formats too."""
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def strict_value(text: str):
    """(True, value) when the whole text, stripped, is one JSON value; (False, None) otherwise."""
    try:
        return True, json.loads(text.strip())
    except ValueError:
        return False, None


def lenient_hit(text: str):
    """(found, value, inner): the hunt for JSON in a reply. It tries every `{` or `[` from left
    to right, inner ones included, and takes the first at which an object or array parses (a
    string or number alone is never taken). `inner` is True when an earlier `{` or `[` did not
    parse: the value found is then a piece inside text that is not JSON, not the reply's value."""
    decoder = json.JSONDecoder()
    failed = False
    for start, char in enumerate(text):
        if char in "{[":
            try:
                return True, decoder.raw_decode(text, start)[0], failed
            except ValueError:
                failed = True
    return False, None, False


def lenient_value(text: str):
    """(True, value) for the first `{` or `[` in the text at which an object or array parses
    (`lenient_hit`: what a client that hunts for JSON in chatter or code fences recovers);
    (False, None) if there is none."""
    found, value, _ = lenient_hit(text)
    return found, value


# The JSON Schema keywords that name a schema's structure. A reply object holding one that the
# schema does not declare as a property is a piece of a schema (the prompt's, echoed), not a value.
SCHEMA_KEYWORDS = frozenset({"$schema", "$ref", "$defs", "definitions", "type", "properties",
                             "additionalProperties", "patternProperties", "required", "items",
                             "anyOf", "oneOf", "allOf", "enum"})


def schema_echo(value, schema: dict) -> bool:
    """True when `value` is an object with a JSON Schema structure keyword among its keys that
    `schema` does not declare as one of its own properties: the model wrote out a schema (in
    practice, pieces of the one in its prompt), and it can validate only because the schema
    allows unknown properties."""
    if not isinstance(value, dict):
        return False
    declared = set(schema.get("properties", {})) if isinstance(schema, dict) else set()
    return any(key in SCHEMA_KEYWORDS and key not in declared for key in value)


def repair_text(text: str) -> str | None:
    """A text repair of the kind json-repair-style libraries do, written out: skip to the first
    `{` or `[`, keep the first balanced JSON value (cut what follows; trailing commas before a
    closer dropped, closers that match nothing dropped), and if the text ends
    inside it, close an open string, drop a dangling `,` or `:` (and a key left without a
    value), and close the open brackets. None when the text has no `{` or `[`. The result may
    still fail to parse (a half-written number or literal); it is not checked here."""
    start = next((k for k, c in enumerate(text) if c in "{["), None)
    if start is None:
        return None
    stack, in_string, escaped, out = [], False, False, []
    for char in text[start:]:
        out.append(char)
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]":
            if not stack or stack[-1] != char:
                out.pop()  # a closer that matches nothing open: drop it
                continue
            before = "".join(out[:-1]).rstrip()
            if before.endswith(","):  # a trailing comma before the closer
                out = [*before[:-1], char]
            stack.pop()
            if not stack:
                return "".join(out)  # the first balanced value; what follows is chatter
    body = "".join(out)
    if escaped:
        body = body[:-1]
    if in_string:
        body += '"'
    body = body.rstrip()
    while True:  # a dangling separator, or a key whose value never came
        trimmed = body.rstrip().rstrip(",:").rstrip()
        if stack and stack[-1] == "}" and trimmed.endswith('"'):
            key_start = trimmed[:-1].rfind('"')
            before = trimmed[:key_start].rstrip()
            if body.rstrip().endswith(":") or before.endswith(("{", ",")):
                trimmed = before.rstrip(",").rstrip()
        if trimmed == body:
            break
        body = trimmed
    return body + "".join(reversed(stack))


def repaired_value(text: str, schema: dict):
    """(parsed, valid, value) of `repair_text(text)`: does the repaired text parse, and validate?"""
    fixed = repair_text(text)
    parsed, value = strict_value(fixed) if fixed is not None else (False, None)
    return parsed, bool(parsed and validator(schema).is_valid(value)), value


# -------------------------------------------------------------------------- validity


@dataclass(frozen=True)
class Attempt:
    """One generated reply and how it reads."""

    schema: str
    constrained: bool
    temperature: float
    seed: int
    text: str
    token_ids: tuple[int, ...]
    finish: str
    strict_valid: bool     # the whole reply is JSON and validates
    lenient_valid: bool    # the first object or array the hunt finds (`lenient_hit`) validates
    draw: int = 0          # which of a schema's requests in its arm this is (0, 1, ...)


def judge(name: str, schema: dict, constrained: bool, params: SamplingParams, text: str,
          token_ids: Sequence[int], finish: str, draw: int = 0) -> Attempt:
    check = validator(schema)
    readings = []
    for read in (strict_value, lenient_value):
        parsed, value = read(text)
        readings.append(parsed and check.is_valid(value))
    return Attempt(name, constrained, params.temperature, params.seed or 0, text, tuple(token_ids), finish,
                   *readings, draw)


def generate_attempts(engine, tokenizer, jobs: Sequence[tuple], *, temperature: float,
                      max_tokens: int, chat: bool | None = None, prefill: str = "") -> list[Attempt]:
    """One engine batch of (schema name, schema, constrained, seed[, draw]) jobs, each
    prompted with `schema_prompt` (and `prefill`, judged as the start of the reply)."""
    params, batch = [], []
    for name, schema, constrained, seed, *_ in jobs:
        fmt = ResponseFormat.json_schema(schema) if constrained else None
        params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                     response_format=fmt))
        batch.append(schema_prompt(tokenizer, schema, chat=chat, prefill=prefill))
    outs = engine.generate(batch, params)
    return [judge(job[0], job[1], job[2], p, prefill + o.samples[0].text, o.samples[0].token_ids,
                  o.samples[0].finish_reason, job[4] if len(job) > 4 else 0)
            for job, p, o in zip(jobs, params, outs)]


def validity_run(engine, tokenizer, schemas: dict[str, dict], draws: int = 1, *, temperature: float,
                 max_tokens: int, first_seed: int = 0, arms: Sequence[bool] = (False, True),
                 chat: bool | None = None, prefill: str = "") -> list[Attempt]:
    """Every schema `draws` times in each arm (False: free, True: under the mask), in one
    batch. Every request gets its own seed (first_seed, first_seed + 1, ...): a step's draw
    depends only on (seed, step), so requests that shared a seed would share one random
    stream and not be independent samples. `prefill` starts every reply (`schema_prompt`)."""
    jobs: list[tuple] = []
    for constrained in arms:
        for name, schema in schemas.items():
            for draw in range(draws):
                jobs.append((name, schema, constrained, first_seed + len(jobs), draw))
    return generate_attempts(engine, tokenizer, jobs, temperature=temperature, max_tokens=max_tokens,
                             chat=chat, prefill=prefill)


def paired_outcomes(attempts: Sequence[Attempt]) -> tuple[list[bool], list[bool]]:
    """(free, masked) validity, aligned: the free and the masked request of each (schema, draw,
    temperature) that has both, in the order the free ones come."""
    masked = {(a.schema, a.draw, a.temperature): a.strict_valid for a in attempts if a.constrained}
    pairs = [(a.strict_valid, masked[key]) for a in attempts if not a.constrained
             and (key := (a.schema, a.draw, a.temperature)) in masked]
    return [f for f, _ in pairs], [m for _, m in pairs]


def draw_counts(attempts: Sequence[Attempt], constrained: bool) -> list[int]:
    """Valid replies in each draw of one arm (draw 0 over the schemas, draw 1, ...): the
    spread across seeds."""
    group = [a for a in attempts if a.constrained == constrained]
    return [sum(a.strict_valid for a in group if a.draw == d) for d in sorted({a.draw for a in group})]


def guarantee_counts(attempts: Sequence[Attempt]) -> dict:
    """The mask's guarantee over constrained replies: valid, cut at max_tokens without being
    valid (an unfinished value), and stopped on their own yet invalid (a broken guarantee);
    with the distinct seeds they were sampled with."""
    group = [a for a in attempts if a.constrained]
    return {"replies": len(group), "seeds": len({a.seed for a in group}),
            "valid": sum(a.strict_valid for a in group),
            "cut at max_tokens": sum(a.finish == "length" and not a.strict_valid for a in group),
            "stopped, not valid": sum(a.finish != "length" and not a.strict_valid for a in group)}


def validity_rows(attempts: Sequence[Attempt], label: str = "") -> list[dict]:
    """One row per (mode, temperature): valid shares with Wilson 95% intervals, finish reasons."""
    rows = []
    keys = sorted({(a.constrained, a.temperature) for a in attempts})
    for constrained, temperature in keys:
        group = [a for a in attempts if a.constrained == constrained and a.temperature == temperature]
        n, strict = len(group), sum(a.strict_valid for a in group)
        lenient = sum(a.lenient_valid for a in group)
        low, high = wilson_interval(strict, n)
        rows.append({"model": label, "mask": "schema" if constrained else "none",
                     "temperature": temperature, "replies": n,
                     "valid, whole reply": strict, "share valid": strict / n, "low": low, "high": high,
                     "valid, first object or array found": lenient,
                     "stopped": sum(a.finish == "stop" for a in group),
                     "cut at max_tokens": sum(a.finish == "length" for a in group),
                     "stopped but invalid": sum(a.finish == "stop" and not a.strict_valid for a in group)})
    return rows


def by_source(attempts: Sequence[Attempt], benchmark_names: set[str]) -> list[dict]:
    """Per source of schema (written for labkit, or JSONSchemaBench's `benchmark_names`) and arm:
    replies, valid (whole reply), and not valid because cut at max_tokens."""
    rows = []
    for source, ours in (("written for labkit", True), ("JSONSchemaBench", False)):
        for constrained, label in ((False, "no mask"), (True, "schema mask")):
            group = [a for a in attempts if a.constrained == constrained
                     and (a.schema not in benchmark_names) == ours]
            if not group:
                continue
            rows.append({"schemas from": source, "mask": label, "replies": len(group),
                         "valid": sum(a.strict_valid for a in group),
                         "not valid, cut at max_tokens": sum(not a.strict_valid and a.finish == "length"
                                                             for a in group)})
    return rows


def by_schema(attempts: Sequence[Attempt]) -> list[dict]:
    """Per schema: valid replies out of all, without and with the mask (whole-reply reading)."""
    names = list(dict.fromkeys(a.schema for a in attempts))
    rows = []
    for name in names:
        row = {"schema": name}
        for constrained, label in ((False, "no mask"), (True, "schema mask")):
            group = [a for a in attempts if a.schema == name and a.constrained == constrained]
            row[f"{label}: valid"] = f"{sum(a.strict_valid for a in group)}/{len(group)}"
        rows.append(row)
    return rows


# -------------------------------------------------------------------------- validation and repair


@dataclass(frozen=True)
class Repaired:
    """A request's fate under one strategy: valid in the end, output tokens and generations spent."""

    strategy: str
    schema: str
    seed: int
    valid: bool
    tokens: int
    generations: int


def repair_counts(attempts: Sequence[Attempt], schemas: dict[str, dict]) -> dict:
    """Over free replies: valid as written, made valid by `repair_text`, and how many of those
    are echoes of the schema (`schema_echo`), not answers; with the replies cut at max_tokens."""
    free = [a for a in attempts if not a.constrained]
    echoed = []  # per reply the repair made valid: is it an echo of the schema?
    for a in free:
        if not a.strict_valid:
            _, ok, value = repaired_value(a.text, schemas[a.schema])
            if ok:
                echoed.append(schema_echo(value, schemas[a.schema]))
    return {"replies": len(free), "valid as written": sum(a.strict_valid for a in free),
            "made valid by the repair": len(echoed), "of those, echoes of the schema": sum(echoed),
            "cut at max_tokens": sum(a.finish == "length" for a in free)}


def repair_run(engine, tokenizer, schemas: dict[str, dict], plain: Sequence[Attempt],
               constrained: Sequence[Attempt], *, retries: int, max_tokens: int) -> list[Repaired]:
    """Five ways to get a valid reply for the same requests (`plain`: their first, unconstrained
    attempts; `constrained`: the same requests under the mask from the start):

    - validate only: the first reply, validated; an invalid one is an error to the caller;
    - repair the text: an invalid first reply is put through `repair_text` and validated again;
    - retry: validate, and sample again unconstrained (a new seed) up to `retries` times;
    - constrained retry: validate, and regenerate once under the mask if invalid;
    - constrained from the start.
    Tokens count every generation a sequential client would have run (retries stop at the
    first valid reply), so a strategy's cost includes its wasted first attempt. Every new
    generation gets a seed no other request here has: the first attempts' seeds plus a stride
    above all of them (retry k: k strides; the constrained retry: retries + 1 strides)."""
    failed = [a for a in plain if not a.strict_valid]
    stride = 1 + max((a.seed for a in [*plain, *constrained]), default=0)
    jobs = [(a.schema, schemas[a.schema], False, a.seed + stride * k)
            for a in failed for k in range(1, retries + 1)]
    jobs += [(a.schema, schemas[a.schema], True, a.seed + stride * (retries + 1)) for a in failed]
    temperature = plain[0].temperature if plain else 1.0
    redone = generate_attempts(engine, tokenizer, jobs, temperature=temperature, max_tokens=max_tokens)
    retried = {(a.schema, a.seed): redone[i * retries:(i + 1) * retries] for i, a in enumerate(failed)}
    remasked = {(a.schema, a.seed): redone[len(failed) * retries + i] for i, a in enumerate(failed)}
    out = []
    for a in plain:
        key, first = (a.schema, a.seed), len(a.token_ids)
        out.append(Repaired("validate only", a.schema, a.seed, a.strict_valid, first, 1))
        out.append(Repaired("repair the text", a.schema, a.seed,
                            a.strict_valid or repaired_value(a.text, schemas[a.schema])[1], first, 1))
        tokens, generations, valid = first, 1, a.strict_valid
        for again in ([] if a.strict_valid else retried[key]):
            tokens, generations, valid = tokens + len(again.token_ids), generations + 1, again.strict_valid
            if valid:
                break
        out.append(Repaired(f"retry up to {retries}x", a.schema, a.seed, valid, tokens, generations))
        if a.strict_valid:
            out.append(Repaired("constrained retry", a.schema, a.seed, True, first, 1))
        else:
            again = remasked[key]
            out.append(Repaired("constrained retry", a.schema, a.seed, again.strict_valid,
                                first + len(again.token_ids), 2))
    for c in constrained:
        out.append(Repaired("constrained from the start", c.schema, c.seed, c.strict_valid,
                            len(c.token_ids), 1))
    return out


def repair_rows(outcomes: Sequence[Repaired]) -> list[dict]:
    rows = []
    for strategy in dict.fromkeys(o.strategy for o in outcomes):
        group = [o for o in outcomes if o.strategy == strategy]
        n, valid = len(group), sum(o.valid for o in group)
        low, high = wilson_interval(valid, n)
        rows.append({"strategy": strategy, "requests": n, "valid in the end": valid, "share valid": valid / n,
                     "low": low, "high": high, "output tokens per request": sum(o.tokens for o in group) / n,
                     "generations per request": sum(o.generations for o in group) / n})
    return rows


# -------------------------------------------------------------------------- valid but wrong


@dataclass(frozen=True)
class Task:
    """A prompt whose facts fix the right answer, a schema that cannot check those facts, and
    the label: the values a right answer holds."""

    kind: str        # "copy" (values from the prompt), "sum" (a total), "order" (dates in order)
    prompt: str
    schema: dict
    expected: dict = field(default_factory=dict)


NAMES = ["Maria Lopez", "Tom Becker", "Aiko Sato", "Omar Haddad", "Lena Novak", "Ravi Iyer", "Ana Costa",
         "Jon Berg"]
CITIES = ["Lyon", "Porto", "Graz", "Leeds", "Turin", "Ghent", "Bergen", "Cork"]
ITEMS = ["notebook", "pen", "bag", "lamp", "mug", "cable", "stapler", "ruler"]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
BILL = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "price": {"type": "integer"}}, "required": ["name", "price"],
        "additionalProperties": False}},
    "total": {"type": "integer"}}, "required": ["items", "total"], "additionalProperties": False}
TRIP = {"type": "object", "properties": {"city": {"type": "string"},
                                         "first_day": {"type": "string", "format": "date"},
                                         "last_day": {"type": "string", "format": "date"}},
        "required": ["city", "first_day", "last_day"], "additionalProperties": False}


def semantic_tasks(per_kind: int, seed: int = 0) -> list[Task]:
    """`per_kind` tasks of each kind, drawn from a seeded generator (the labels are computed,
    not typed)."""
    rng, tasks = random.Random(seed), []
    for _ in range(per_kind):
        name, city, age = rng.choice(NAMES), rng.choice(CITIES), rng.randint(19, 88)
        tasks.append(Task("copy", f"{name} is {age} years old and lives in {city}.", PERSON,
                          {"name": name, "age": age, "city": city}))
        items = rng.sample(ITEMS, 3)
        prices = [rng.randint(2, 30) for _ in items]
        said = ", ".join(f"a {i} costs {p} dollars" for i, p in zip(items, prices))
        tasks.append(Task("sum", f"On the bill: {said}. Give the items and the total.", BILL,
                          {"prices": dict(zip(items, prices)), "total": sum(prices)}))
        start = datetime.date(2025, 1, 1) + datetime.timedelta(days=rng.randint(0, 330))
        end = start + datetime.timedelta(days=rng.randint(2, 9))
        tasks.append(Task("order", f"The trip to {city} starts on {start.isoformat()} and ends on "
                          f"{end.isoformat()}.", TRIP, {"city": city, "first_day": start.isoformat(),
                                                        "last_day": end.isoformat()}))
    return tasks


def semantic_checks(task: Task, value) -> dict[str, bool]:
    """The facts the schema cannot check, each True when the reply gets it right."""
    if task.kind == "copy":
        return {f"{k} copied": value.get(k) == v for k, v in task.expected.items()}
    if task.kind == "sum":
        given = {str(i.get("name")).lower(): i.get("price") for i in value.get("items", [])}
        prices = [i.get("price") for i in value.get("items", [])]
        own_sum = sum(p for p in prices if isinstance(p, int))
        return {"prices copied": given == task.expected["prices"],
                "total is the sum of its own items": value.get("total") == own_sum,
                "total is the bill's": value.get("total") == task.expected["total"]}
    return {"dates copied": (value.get("first_day"), value.get("last_day"))
            == (task.expected["first_day"], task.expected["last_day"]),
            "first day not after last day": str(value.get("first_day")) <= str(value.get("last_day")),
            "city copied": value.get("city") == task.expected["city"]}


@dataclass(frozen=True)
class Judged:
    task: Task
    seed: int
    text: str
    valid: bool          # schema-valid as written (or, with repair, after `repair_text`)
    checks: dict[str, bool]
    constrained: bool = True
    repaired: bool = False   # valid only after `repair_text`
    finish: str = "stop"     # the engine's finish reason ("length": cut at max_tokens)

    @property
    def right(self) -> bool:
        return self.valid and all(self.checks.values())


def semantic_run(engine, tokenizer, tasks: Sequence[Task], seeds: Sequence[int], *, temperature: float,
                 max_tokens: int, constrained: bool = True, repair: bool = False) -> list[Judged]:
    """Each task with its schema in the prompt, under the schema's mask or free: is the reply
    valid, and is it right? With `repair`, a reply that is not valid as written is read through
    `repair_text` (the facts are then checked on the repaired value)."""
    prompts = [schema_prompt(tokenizer, t.schema, t.prompt) for t in tasks for _ in seeds]
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=max_tokens,
                             response_format=ResponseFormat.json_schema(t.schema) if constrained else None)
              for t in tasks for s in seeds]
    outs = engine.generate(prompts, params)
    judged = []
    for (task, seed), out in zip([(t, s) for t in tasks for s in seeds], outs):
        parsed, value = strict_value(out.text)
        valid, repaired = bool(parsed and validator(task.schema).is_valid(value)), False
        if repair and not valid:
            _, valid, value = repaired_value(out.text, task.schema)
            repaired = valid
        judged.append(Judged(task, seed, out.text, valid, semantic_checks(task, value) if valid else {},
                             constrained, repaired, out.samples[0].finish_reason))
    return judged


def semantic_rows(judged: Sequence[Judged]) -> list[dict]:
    """Per kind of task: replies, schema-valid, and valid but wrong (some fact wrong)."""
    rows = []
    for kind, constrained in dict.fromkeys((j.task.kind, j.constrained) for j in judged):
        group = [j for j in judged if j.task.kind == kind and j.constrained == constrained]
        valid = [j for j in group if j.valid]
        rows.append({"task": kind, "mask": "schema" if group[0].constrained else "none, then repaired",
                     "replies": len(group), "schema-valid": len(valid),
                     "not valid, cut at max_tokens": sum(not j.valid and j.finish == "length" for j in group),
                     "valid only after repair": sum(j.repaired for j in group),
                     "valid and right": sum(j.right for j in valid),
                     "valid but wrong": sum(not j.right for j in valid)})
    return rows
