"""What the engine asks of a grammar engine: a response format in, a matcher per sample out.

A *response format* says what the output must be: any JSON object (`json_object`), JSON that
validates against a schema (`json_schema`), or text of a Lark grammar (`grammar`). A backend
compiles it once per tokenizer into a `CompiledGrammar`; each sample then gets its own
`GrammarMatcher`, which at every step says which tokens may come next (a bitmask over the
vocabulary) and consumes the token that was sampled. The sampler sets every token outside
the mask to -inf before temperature, top-k, top-p and greedy see the logits, so no sampling
option can pick a token the grammar refuses.

Masks are packed as vLLM, llguidance and xgrammar pack them: int32 words, bit `i % 32` of
word `i // 32` set when token `i` is allowed (`bitmask_words`, `unpack_bitmask`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

KINDS = ("json_object", "json_schema", "grammar")


class InvalidFormat(ValueError):
    """A response format no backend can compile (a schema that is not a JSON Schema, a
    keyword the grammar engine does not support, a grammar that does not parse). The
    service answers it with 400; the message is the grammar engine's."""


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on a sample's output. Frozen and hashable (the schema is kept as
    compact JSON text, key order kept: properties are generated in the schema's order), so it
    can sit in `SamplingParams` and key a compile cache.

    `strict` is OpenAI's flag: with it a schema must be a "strict" one (every property
    required, `additionalProperties: false` on every object); labkit enforces the schema
    either way, and checks the strict rules only when asked."""

    kind: str
    schema: str | None = None     # compact JSON text of the schema (json_schema)
    strict: bool = False
    name: str | None = None       # OpenAI's json_schema.name: informational
    grammar: str | None = None    # Lark grammar text (grammar)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidFormat(f"response format kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "json_schema") != (self.schema is not None):
            raise InvalidFormat("a schema goes with kind 'json_schema' and only with it")
        if (self.kind == "grammar") != (self.grammar is not None):
            raise InvalidFormat("a grammar goes with kind 'grammar' and only with it")
        if not isinstance(self.strict, bool):
            raise InvalidFormat(f"strict must be a bool, got {self.strict!r}")

    @classmethod
    def json_object(cls) -> ResponseFormat:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool, *, strict: bool = False,
                    name: str | None = None) -> ResponseFormat:
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidFormat(f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidFormat(f"the schema is not JSON: {error}") from None
        return cls("json_schema", schema=text, strict=strict, name=name)

    @classmethod
    def lark(cls, grammar: str) -> ResponseFormat:
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidFormat("a grammar is a non-empty Lark text")
        return cls("grammar", grammar=grammar)

    @property
    def schema_object(self) -> Any:
        """The schema as Python data (None unless kind is json_schema)."""
        return None if self.schema is None else json.loads(self.schema)


@runtime_checkable
class GrammarMatcher(Protocol):
    """One sample's position in the grammar."""

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the tokens allowed next into `out`, an int32 CPU tensor of
        `bitmask_words(vocab_size)` words (bit set: allowed). An accepting matcher allows
        its EOS token."""

    def consume(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and the matcher is stuck) if it was not allowed."""

    def is_accepting(self) -> bool:
        """True when the text so far is a complete output (EOS may come now)."""

    def is_terminated(self) -> bool:
        """True when nothing but EOS can come: the output is complete."""


@runtime_checkable
class CompiledGrammar(Protocol):
    """A response format compiled for one tokenizer; cheap to start matchers from."""

    compile_seconds: float

    def new_matcher(self) -> GrammarMatcher: ...


@runtime_checkable
class GrammarBackend(Protocol):
    """A grammar engine bound to one tokenizer and vocabulary size."""

    name: str
    vocab_size: int

    def compile(self, response_format: ResponseFormat) -> CompiledGrammar:
        """Compile (or take from the cache); raises `InvalidFormat` for what cannot be."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)
_BYTE_BITS = torch.arange(8, dtype=torch.uint8)
LITTLE_ENDIAN = sys.byteorder == "little"


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool tensor [..., vocab_size] from packed int32 words [..., words]."""
    if LITTLE_ENDIAN:
        # Shifting bytes, not words, is 8x faster on CPU (uint8 lanes); a word's bytes lie
        # in memory low bits first on a little-endian CPU, so the bit order is the same.
        bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> _BYTE_BITS) & 1
    else:
        bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Packed int32 words from a bool tensor [..., vocab_size] (the inverse of `unpack_bitmask`)."""
    vocab = allowed.shape[-1]
    padded = torch.zeros(*allowed.shape[:-1], bitmask_words(vocab) * 32, dtype=torch.int64)
    padded[..., :vocab] = allowed.to(torch.int64)
    words = (padded.reshape(*allowed.shape[:-1], -1, 32) << _BITS.to(torch.int64)).sum(-1)
    # Bit 31 set gives a word >= 2^31: wrap it into int32's range as two's complement.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def check_strict(schema: Any, where: str = "#") -> None:
    """OpenAI's structured-outputs rules for `strict: true`, which its API refuses a schema
    for breaking (so labkit does too): the root is an object, and every object lists all of
    its properties in `required` and sets `additionalProperties: false`."""
    if where == "#" and not (isinstance(schema, Mapping) and schema.get("type") == "object"):
        raise InvalidFormat("a strict schema's root must be an object schema ({\"type\": \"object\", ...})")
    if isinstance(schema, Mapping):
        if schema.get("type") == "object" or "properties" in schema:
            if schema.get("additionalProperties") is not False:
                raise InvalidFormat(f"strict schema at {where}: 'additionalProperties' must be false")
            missing = sorted(set(schema.get("properties", {})) - set(schema.get("required", [])))
            if missing:
                raise InvalidFormat(f"strict schema at {where}: every property must be required; "
                                    f"missing {missing}")
        for key, value in schema.items():
            if key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
                for name, sub in value.items():
                    check_strict(sub, f"{where}/{key}/{name}")
            elif key in ("items", "anyOf", "allOf", "oneOf", "prefixItems", "not"):
                for index, sub in enumerate(value if isinstance(value, list) else [value]):
                    check_strict(sub, f"{where}/{key}/{index}")


@dataclass
class MaskClock:
    """Time spent inside grammar matchers (masks computed, tokens consumed) and in applying
    their masks, and how many constrained tokens it bought: `labkit bench structured`'s
    "mask time per token"."""

    seconds: float = 0.0
    tokens: int = 0
    # One entry per decode step with constrained rows: (seconds for all that step's masks, filled
    # and unpacked; constrained rows). A sum over a run hides the spread that a loaded machine's
    # preemptions put into a few steps; per-step samples give a median and a tail.
    # Kept to the last MAX_STEPS (a server runs for ever); `steps_recorded` counts them all, so a
    # caller takes a run's steps as the last (recorded after - recorded before) entries.
    steps: list[tuple[float, int]] = field(default_factory=list)
    # The same steps split in two, entry for entry: (seconds filling the rows' bitmasks, the
    # matchers' work; seconds unpacking them into boolean rows, one torch op for the step).
    # The fill grows with the rows, the unpack barely: apart, they say which one a step pays.
    step_parts: list[tuple[float, float]] = field(default_factory=list)
    steps_recorded: int = 0
    MAX_STEPS = 100_000

    def record_step(self, seconds: float, rows: int, fill_seconds: float | None = None) -> None:
        """A step's mask time and constrained rows; `fill_seconds` of it went to filling
        (the rest to unpacking). Unsplit (None), both parts are recorded as NaN."""
        fill = math.nan if fill_seconds is None else fill_seconds
        self.steps.append((seconds, rows))
        self.step_parts.append((fill, seconds - fill))
        self.steps_recorded += 1
        if len(self.steps) > 2 * self.MAX_STEPS:
            del self.steps[:-self.MAX_STEPS]
            del self.step_parts[:-self.MAX_STEPS]

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


class SampleMatcher:
    """A `GrammarMatcher` as the engine runs it for one sample: every call's time goes to a
    `MaskClock`; once the grammar accepts, the sample's stop tokens are allowed besides the
    matcher's own EOS (a chat template's end-of-turn token, say); and a mask with no token
    at all (a matcher that broke) becomes the stop tokens alone, so the sample ends rather
    than the step failing."""

    def __init__(self, matcher: GrammarMatcher, clock: MaskClock, stop_ids: tuple[int, ...] = ()):
        self.matcher, self.clock, self.stop_ids = matcher, clock, tuple(stop_ids)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        started = time.perf_counter()
        self.matcher.fill_bitmask(out)
        if self.stop_ids and (self.matcher.is_accepting() or not bool(out.any())):
            for token_id in self.stop_ids:
                word = int(out[token_id // 32]) | (1 << (token_id % 32))
                out[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word
        self.clock.seconds += time.perf_counter() - started
        self.clock.tokens += 1

    def consume(self, token_id: int) -> bool:
        started = time.perf_counter()
        ok = self.matcher.consume(token_id)
        self.clock.seconds += time.perf_counter() - started
        return ok

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
