"""Constrained decoding by hand: a JSON Schema subset -> a finite automaton -> token masks.

Chapter 35's idea in a few hundred lines, the way Outlines first did it (Willard and Louf,
"Efficient Guided Generation for Large Language Models", 2023):

1. A schema of the subset below describes a *regular* language: its nesting depth is fixed
   by the schema, so no stack is needed. It is written as a regular expression over bytes
   (`Node` trees: bytes, byte classes, sequences, alternatives, repetition).
2. Thompson's construction turns the expression into an NFA; the subset construction runs
   lazily, so a DFA state (a set of NFA states) is made only when a prefix reaches it.
3. The mask of a DFA state is the set of tokens whose bytes can all be read from it. The
   vocabulary is a trie, so one walk reads each shared prefix once and drops a whole subtree
   at its first dead byte; the mask is cached per state (Outlines's "index").

The subset: objects whose properties are all required and appear in the schema's order, with
`additionalProperties: false`; properties of type string, integer, boolean, an `enum` of
strings, integers, booleans or null, an array of one of those, or such an object. JSON is
written compact as llguidance's backend writes it (`{"a": 1, "b": [true, false]}`), with
llguidance's string escapes (`\\"`, `\\\\`, `\\b\\f\\n\\r\\t`, and `\\u00XX` for control
characters only), strings checked to be well-formed UTF-8 byte by byte. Anything else
raises `NotInSubset`. It is slow (pure Python: a state's first mask over SmolLM2's 49k
tokens takes up to a few hundred milliseconds, a cached one nothing);
`tests/test_structured.py` holds it to llguidance on the same schemas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from labkit.structured.contract import pack_bitmask
from labkit.tokenizer import bytes_to_unicode


class NotInSubset(ValueError):
    """The schema uses something this automaton does not handle."""


# --------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Node:
    """A regular expression over bytes: `op` is "bytes", "class", "seq", "alt" or "star"."""

    op: str
    value: bytes | frozenset[int] = b""
    parts: tuple[Node, ...] = ()


def lit(text: str | bytes) -> Node:
    return Node("bytes", text.encode() if isinstance(text, str) else text)


def one_of_bytes(allowed) -> Node:
    return Node("class", frozenset(allowed))


def seq(*parts: Node) -> Node:
    return Node("seq", parts=parts)


def alt(*parts: Node) -> Node:
    return Node("alt", parts=parts)


def star(part: Node) -> Node:
    return Node("star", parts=(part,))


def optional(part: Node) -> Node:
    return alt(part, seq())


DIGITS = range(ord("0"), ord("9") + 1)
HEX = [*DIGITS, *range(ord("a"), ord("g")), *range(ord("A"), ord("G"))]
# ASCII but '"', '\\', controls and DEL (llguidance escapes only these), or one well-formed
# UTF-8 sequence of 2 to 4 bytes (the Unicode standard's table 3-7: no overlong forms, no
# surrogates, nothing past U+10FFFF).
PLAIN = [b for b in range(0x20, 0x7F) if b not in (ord('"'), ord("\\"))]
TAIL = one_of_bytes(range(0x80, 0xC0))
UTF8 = alt(seq(one_of_bytes(range(0xC2, 0xE0)), TAIL),
           seq(lit(b"\xe0"), one_of_bytes(range(0xA0, 0xC0)), TAIL),
           seq(one_of_bytes([*range(0xE1, 0xED), 0xEE, 0xEF]), TAIL, TAIL),
           seq(lit(b"\xed"), one_of_bytes(range(0x80, 0xA0)), TAIL),
           seq(lit(b"\xf0"), one_of_bytes(range(0x90, 0xC0)), TAIL, TAIL),
           seq(one_of_bytes(range(0xF1, 0xF4)), TAIL, TAIL, TAIL),
           seq(lit(b"\xf4"), one_of_bytes(range(0x80, 0x90)), TAIL, TAIL))
STRING_CHAR = alt(one_of_bytes(PLAIN), UTF8, seq(lit("\\"), one_of_bytes(b'"\\bfnrt')),
                  seq(lit("\\u00"), one_of_bytes(b"01"), one_of_bytes(HEX)))
STRING = seq(lit('"'), star(STRING_CHAR), lit('"'))
INTEGER = seq(optional(lit("-")), alt(lit("0"), seq(one_of_bytes(range(ord("1"), ord("9") + 1)),
                                                     star(one_of_bytes(DIGITS)))))
BOOLEAN = alt(lit("true"), lit("false"))
SCALARS = {"string": STRING, "integer": INTEGER, "boolean": BOOLEAN}
# Keywords that only describe (they do not change the language) are let through.
DESCRIPTIVE = {"title", "description", "$schema", "$id", "examples", "default", "$comment"}


def json_string(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode()


def schema_node(schema, where: str = "#") -> Node:
    """The regular expression of a schema in the subset; NotInSubset otherwise."""
    if not isinstance(schema, dict):
        raise NotInSubset(f"{where}: a schema here is an object")
    extra = set(schema) - DESCRIPTIVE - {"type", "enum", "properties", "required",
                                         "additionalProperties", "items"}
    if extra:
        raise NotInSubset(f"{where}: keywords {sorted(extra)} are not in the subset")
    if "enum" in schema:
        values = schema["enum"]
        if set(schema) - DESCRIPTIVE - {"enum", "type"} or not isinstance(values, list) or not values:
            raise NotInSubset(f"{where}: an enum is a non-empty list, alone")
        if not all(v is None or isinstance(v, (str, int, bool)) for v in values):
            raise NotInSubset(f"{where}: enum values are strings, integers, booleans or null")
        return alt(*(lit(json.dumps(v, ensure_ascii=False)) for v in values))
    kind = schema.get("type")
    if kind in SCALARS:
        if set(schema) - DESCRIPTIVE - {"type"}:
            raise NotInSubset(f"{where}: a {kind} takes no other keyword here")
        return SCALARS[kind]
    if kind == "array":
        if set(schema) - DESCRIPTIVE - {"type", "items"} or "items" not in schema:
            raise NotInSubset(f"{where}: an array has 'items' and nothing else")
        item = schema_node(schema["items"], f"{where}/items")
        return seq(lit("["), optional(seq(item, star(seq(lit(", "), item)))), lit("]"))
    if kind == "object":
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is not False:
            raise NotInSubset(f"{where}: objects need 'additionalProperties': false")
        if sorted(schema.get("required", [])) != sorted(properties):
            raise NotInSubset(f"{where}: every property must be required")
        members = [seq(lit(json_string(name) + b": "), schema_node(sub, f"{where}/properties/{name}"))
                   for name, sub in properties.items()]
        body = [members[0], *(seq(lit(", "), m) for m in members[1:])] if members else []
        return seq(lit("{"), *body, lit("}"))
    raise NotInSubset(f"{where}: type {kind!r} is not in the subset")


# --------------------------------------------------------------------------- automata


@dataclass
class NFA:
    """Thompson's NFA: per state, byte-labelled edges and epsilon edges."""

    edges: list[list[tuple[frozenset[int], int]]] = field(default_factory=list)
    epsilons: list[list[int]] = field(default_factory=list)

    def new_state(self) -> int:
        self.edges.append([])
        self.epsilons.append([])
        return len(self.edges) - 1

    def build(self, node: Node) -> tuple[int, int]:
        """(start, end) of a fragment that reads the expression."""
        start = self.new_state()
        end = start
        if node.op == "bytes":
            for byte in node.value:
                nxt = self.new_state()
                self.edges[end].append((frozenset([byte]), nxt))
                end = nxt
        elif node.op == "class":
            end = self.new_state()
            self.edges[start].append((node.value, end))
        elif node.op == "seq":
            for part in node.parts:
                s, e = self.build(part)
                self.epsilons[end].append(s)
                end = e
        elif node.op == "alt":
            end = self.new_state()
            for part in node.parts:
                s, e = self.build(part)
                self.epsilons[start].append(s)
                self.epsilons[e].append(end)
        elif node.op == "star":
            s, e = self.build(node.parts[0])
            end = self.new_state()
            self.epsilons[start] += [s, end]
            self.epsilons[e] += [s, end]
        else:
            raise ValueError(f"unknown node {node.op!r}")
        return start, end


class DFA:
    """The subset construction, run lazily: state 0 is dead, states are made on first visit."""

    DEAD = 0

    def __init__(self, node: Node):
        self.nfa = NFA()
        start, self.final = self.nfa.build(node)
        self.sets: list[frozenset[int]] = [frozenset()]
        self.ids: dict[frozenset[int], int] = {frozenset(): 0}
        self.moves: dict[tuple[int, int], int] = {}
        self.start = self._state(self._closure([start]))

    def _closure(self, states) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.nfa.epsilons[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def _state(self, states: frozenset[int]) -> int:
        if states not in self.ids:
            self.ids[states] = len(self.sets)
            self.sets.append(states)
        return self.ids[states]

    def step(self, state: int, byte: int) -> int:
        key = (state, byte)
        found = self.moves.get(key)
        if found is None:
            targets = [t for s in self.sets[state] for allowed, t in self.nfa.edges[s] if byte in allowed]
            found = self.moves[key] = self._state(self._closure(targets)) if targets else self.DEAD
        return found

    def run(self, data: bytes, state: int | None = None) -> int:
        state = self.start if state is None else state
        for byte in data:
            state = self.step(state, byte)
            if state == self.DEAD:
                break
        return state

    def accepting(self, state: int) -> bool:
        return self.final in self.sets[state]

    def has_exit(self, state: int) -> bool:
        """True when some byte can still be read from the state."""
        return any(self.nfa.edges[s] for s in self.sets[state])

    def accepts(self, data: bytes) -> bool:
        return self.accepting(self.run(data))


# --------------------------------------------------------------------------- the vocabulary


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes (None for control tokens, which JSON text never contains):
    byte-level BPE spells bytes with GPT-2's printable characters; SentencePiece writes a
    space as '▁' and a byte it has no piece for as '<0xNN>'."""
    special = tokenizer.special_token_ids
    byte_level = tokenizer.meta.tokenizer_model == "gpt2"
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    out: list[bytes | None] = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.id_to_token(token_id)
        if text is None or token_id in special:
            out.append(None)
        elif byte_level:
            out.append(bytes(decode[c] for c in text) if all(c in decode for c in text) else text.encode())
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out.append(bytes([int(text[3:5], 16)]))
        else:
            out.append(text.replace("\u2581", " ").encode())
    return out


class TokenTrie:
    """The vocabulary as a byte trie: node = (children by byte, token ids ending here)."""

    def __init__(self, pieces: list[bytes | None]):
        self.root: tuple[dict, list[int]] = ({}, [])
        for token_id, piece in enumerate(pieces):
            if not piece:
                continue
            node = self.root
            for byte in piece:
                node = node[0].setdefault(byte, ({}, []))
            node[1].append(token_id)

    def allowed(self, dfa: DFA, state: int) -> list[int]:
        """Token ids whose every byte the DFA reads from `state`: one walk, dead subtrees skipped."""
        found, todo = [], [(self.root, state)]
        while todo:
            (children, ids), at = todo.pop()
            found += ids  # the root holds none: no token is empty
            for byte, child in children.items():
                nxt = dfa.step(at, byte)
                if nxt != DFA.DEAD:
                    todo.append((child, nxt))
        return found


class FSMGrammar:
    """A subset schema compiled for one vocabulary (a `CompiledGrammar`)."""

    compile_seconds = 0.0

    def __init__(self, schema, tokenizer, vocab_size: int | None = None,
                 pieces: list[bytes | None] | None = None):
        self.dfa = DFA(schema_node(schema))
        self.pieces = token_bytes(tokenizer) if pieces is None else pieces
        self.trie = TokenTrie(self.pieces)
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.eos = tokenizer.eos_token_id
        self.masks: dict[int, torch.Tensor] = {}

    def mask(self, state: int) -> torch.Tensor:
        """Packed bitmask of the tokens allowed in a DFA state (EOS where it accepts)."""
        if state not in self.masks:
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[self.trie.allowed(self.dfa, state)] = True
            if self.dfa.accepting(state):
                allowed[self.eos] = True
            self.masks[state] = pack_bitmask(allowed)
        return self.masks[state]

    def new_matcher(self) -> FSMMatcher:
        return FSMMatcher(self)


class FSMMatcher:
    """One sample's DFA state (a `GrammarMatcher`)."""

    def __init__(self, grammar: FSMGrammar):
        self.grammar, self.state = grammar, grammar.dfa.start

    def fill_bitmask(self, out: torch.Tensor) -> None:
        out.copy_(self.grammar.mask(self.state))

    def consume(self, token_id: int) -> bool:
        dfa = self.grammar.dfa
        if token_id == self.grammar.eos:
            ok = dfa.accepting(self.state)
        else:
            piece = self.grammar.pieces[token_id] if token_id < len(self.grammar.pieces) else None
            ok = bool(piece) and (nxt := dfa.run(piece, self.state)) != DFA.DEAD
            if ok:
                self.state = nxt
        if not ok:
            self.state = DFA.DEAD
        return ok

    def is_accepting(self) -> bool:
        return self.grammar.dfa.accepting(self.state)

    def is_terminated(self) -> bool:
        return self.is_accepting() and not self.grammar.dfa.has_exit(self.state)
