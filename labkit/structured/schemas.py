"""The schema set that chapter 35, `labkit bench structured` and the tests share.

`SUBSET`: schemas the hand-written automaton (`json_fsm`) handles; `BEYOND`: what only a
grammar engine does (bounds, anyOf, $ref, patterns, formats, optional properties); and 12
schemas of JSONSchemaBench (Geng et al., "Generating Structured Outputs from Language Models:
Benchmark and Studies", arXiv:2501.10868), with the benchmark's own valid and invalid test
instances (`labkit/data/structured/jsonschemabench.json` says where from and how chosen).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

BENCH_FILE = Path(__file__).resolve().parent.parent / "data" / "structured" / "jsonschemabench.json"


def strict_object(**properties) -> dict:
    """An object schema with every property required and nothing else allowed (OpenAI's strict)."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


S, I, B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
SUBSET = {
    "person": strict_object(name=S, age=I, vegan=B),
    "enums": strict_object(color={"enum": ["red", "green", "blue"]}, size={"enum": [1, 2, True, None, "XL"]}),
    "arrays": strict_object(tags={"type": "array", "items": S}, scores={"type": "array", "items": I}),
    "nested": strict_object(address=strict_object(city=S, zip=S), flags={"type": "array", "items": B}),
    "deep": strict_object(a=strict_object(b=strict_object(c={"type": "array", "items": {"enum": ["x", "y"]}}))),
    "empty": strict_object(),
}
BEYOND = {
    "bounds": strict_object(name={"type": "string", "minLength": 2, "maxLength": 8},
                            age={"type": "integer", "minimum": 0, "maximum": 120}),
    "number": strict_object(price={"type": "number", "minimum": 0}, ratio={"type": "number", "exclusiveMaximum": 1}),
    "any_of": strict_object(id={"anyOf": [S, I]}, note={"type": ["string", "null"]}),
    "refs": {**strict_object(home={"$ref": "#/$defs/place"}, work={"$ref": "#/$defs/place"}),
             "$defs": {"place": strict_object(city=S, floor=I)}},
    "optional": {"type": "object", "properties": {"a": I, "b": S}, "required": ["a"]},
    "pattern": strict_object(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    "items": strict_object(points={"type": "array", "items": strict_object(x=I, y=I), "minItems": 1, "maxItems": 3}),
    "const_date": strict_object(version={"const": 2}, day={"type": "string", "format": "date"}),
}


@cache
def benchmark() -> dict:
    """JSONSchemaBench's part: {"source", "paper", "selection", "schemas": [{name, schema, tests}]}."""
    return json.loads(BENCH_FILE.read_text())


def all_schemas() -> dict[str, dict]:
    """Every schema of the set by name: SUBSET, BEYOND, then the benchmark's."""
    return {**SUBSET, **BEYOND, **{s["name"]: s["schema"] for s in benchmark()["schemas"]}}
