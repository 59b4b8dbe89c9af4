"""Tool calling, the part every protocol shares: which tools, how the model is told about them,
how its calls are forced or read back, and how past calls and results go into the prompt.

The wire formats (OpenAI's `tools` / `tool_calls`, Anthropic's `tool_use` blocks, the
Responses API's `function_call` items) are the adapters' (labkit.serve); they translate to
and from the dataclasses here:

    specs = check_tools([ToolSpec("get_weather", "Weather in a city", {...schema...})], compile)
    choice = ToolChoice("auto")                     # none | auto | required | named, + parallel
    system = tool_prompt(specs, choice)             # the tools, described to the model
    turns = render_turns(conversation)              # Turn / ToolResult -> template messages
    fmt = forcing_format(specs, choice)             # a Lark grammar for required / named
    reading = read_tool_calls(reply_text, specs)    # content, valid calls, invalid calls

The model's format is Hermes / Qwen's, which small models are taught (SmolLM2 and Gemma 3
270M were not, so the tools go into the system turn as text, as `TOOL_PROMPT` says):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one block per call, a newline between blocks. A block ends at the first "</tool_call>" outside
the JSON strings of its body (a string argument may hold the tag; `BodyScanner`). Past calls
are rendered back exactly as the forced grammar makes the model write them (`call_text`:
compact JSON with ", " and ": ", the arguments' keys in the order given), so the next
prompt's tokens repeat the reply's and the prefix cache serves them. A tool's result is
data: it goes into a user turn as
`<tool_response>{"name": ..., "content": ...}</tool_response>`, JSON-escaped with every "</"
written "<\\/", so it cannot close the wrapper; special-token spellings in it are plain text
(labkit.protocols.templates), so it cannot forge a role either.

A call is *valid* only when its block is JSON `{"name": str, "arguments": object}`, the name
is one of the tools, and the arguments validate against the tool's schema (`jsonschema`, the
schema's own draft). Anything else is an `InvalidToolCall` with the reason, and its text stays
in the content: it is never passed on as a call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from labkit.structured.contract import InvalidFormat, ResponseFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# llguidance's JSON options inside the grammar: the compact form labkit.structured.llg uses
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

TOOL_PROMPT = """You can call tools. To call one, reply with only this, on one line:
<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>
The tools:
<tools>
{tools}
</tools>
Each result comes back as <tool_response>{{"name": ..., "content": ...}}</tool_response>. Use it to answer."""


class ToolUseError(ValueError):
    """A tools list, tool choice or conversation that cannot be used; `where` names the part
    (an index path the adapter turns into its own field name, e.g. "tools[1].parameters")."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name, what it does, and a JSON Schema (an object
    schema) for its arguments."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def described(self) -> dict:
        """The tool as the prompt lists it (the function-tool JSON Qwen's template writes)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    """Which calls the reply must make: none (no tools offered, nothing read), auto (the model
    decides; its calls are read and validated), required (at least one call, forced), named
    (exactly one call of `name`, forced). `parallel`: more than one call in a reply."""

    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("none", "auto", "required", "named"):
            raise ToolUseError(f"tool choice must be none, auto, required or a named tool, got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ToolUseError("a tool name goes with a named tool choice, and only with it")

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    """One valid call: arguments as a dict, in the order the model (or client) wrote them."""

    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class InvalidToolCall:
    """A block that is not a valid call: `text` is the block as written (tags included),
    `name` and `arguments` what could be read of them (None / raw text otherwise)."""

    id: str
    text: str
    error: str
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class Turn:
    """A conversation turn as the adapters hand it over: a role's text, and for an assistant
    turn the calls it made."""

    role: Literal["system", "user", "assistant"]
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolResult:
    """A tool's output for an earlier call (`call_id`); `name` is the called tool's."""

    call_id: str
    name: str
    content: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the tools ---------------------------------------------------------------------------------

def check_tools(specs: Sequence[ToolSpec], compile: Callable[[ResponseFormat], Any] | None = None
                ) -> tuple[ToolSpec, ...]:
    """The tools, checked: names as OpenAI's (`^[a-zA-Z0-9_-]{1,64}$`) and unique; parameters
    an object schema that its draft's metaschema accepts and, with `compile`, that the grammar
    engine compiles (the adapters pass their backend's compile). ToolUseError otherwise."""
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec.name, str) or not NAME.match(spec.name):
            raise ToolUseError(f"tools[{i}]: a tool's name is 1 to 64 letters, digits, '_' or '-', "
                               f"got {spec.name!r}", f"tools[{i}].name")
        if spec.name in seen:
            raise ToolUseError(f"tools[{i}]: two tools are named {spec.name!r}", f"tools[{i}].name")
        seen.add(spec.name)
        where = f"tools[{i}].parameters"
        schema = spec.parameters
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ToolUseError(f"{where}: the parameters of {spec.name!r} must be an object schema "
                               '({"type": "object", ...})', where)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as error:
            raise ToolUseError(f"{where}: not a valid JSON Schema for {spec.name!r}: {error.message}",
                               where) from None
        except Exception as error:  # noqa: BLE001 - e.g. a "$schema" that is not a string
            raise ToolUseError(f"{where}: not a valid JSON Schema for {spec.name!r}: "
                               f"{type(error).__name__}: {error}", where) from None
        if compile is not None:
            try:
                compile(ResponseFormat.json_schema(schema))
            except InvalidFormat as error:
                raise ToolUseError(f"{where}: the grammar engine cannot use the schema of {spec.name!r}: "
                                   f"{error}", where) from None
    return tuple(specs)


def check_choice(specs: Sequence[ToolSpec], choice: ToolChoice) -> None:
    if choice.mode == "named" and choice.name not in {s.name for s in specs}:
        raise ToolUseError(f"tool choice names {choice.name!r}, which is not one of the tools", "tool_choice")
    if choice.forced and not specs:
        raise ToolUseError(f"tool choice {choice.mode!r} needs tools", "tool_choice")


def tool_prompt(specs: Sequence[ToolSpec], choice: ToolChoice = ToolChoice("auto")) -> str | None:
    """The system text that describes the tools (None for choice none or no tools). It is the
    same for every other choice: what a reply must be is the grammar's to force, and a prompt
    that stays the same from turn to turn is one the prefix cache keeps serving."""
    if choice.mode == "none" or not specs:
        return None
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(s.described(), ensure_ascii=False) for s in specs))


# -- the conversation --------------------------------------------------------------------------

def call_text(call: ToolCall) -> str:
    """A call's block exactly as the forced grammar has the model write it."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return OPEN + body + CLOSE


def assistant_text(turn: Turn) -> str:
    """An assistant turn's text with its calls: the text, then one block per call, a newline
    before each (none before the first when there is no text)."""
    blocks = [call_text(c) for c in turn.tool_calls]
    return "\n".join(([turn.content] if turn.content else []) + blocks)


def result_text(result: ToolResult) -> str:
    """A tool's output wrapped as data (see the module's docstring)."""
    body = json.dumps({"name": result.name, "content": result.content}, ensure_ascii=False)
    return RESPONSE_OPEN + body.replace("</", "<\\/") + RESPONSE_CLOSE


def check_results(conversation: Sequence[Turn | ToolResult]) -> None:
    """ToolUseError for a result whose call id no earlier assistant turn made."""
    made: set[str] = set()
    for i, item in enumerate(conversation):
        if isinstance(item, Turn):
            made.update(c.id for c in item.tool_calls)
        elif item.call_id not in made:
            raise ToolUseError(f"messages[{i}]: tool result for {item.call_id!r}, which no earlier "
                               "assistant turn called", f"messages[{i}].tool_call_id")


def render_turns(conversation: Sequence[Turn | ToolResult], specs: Sequence[ToolSpec] = (),
                 choice: ToolChoice = ToolChoice("none")) -> list[dict[str, str]]:
    """The conversation as chat-template messages (role, content): the tool prompt joins the
    system text (a system turn first), assistant calls become blocks, and each run of results
    becomes one user turn of <tool_response> blocks, a newline between them."""
    check_results(conversation)
    system = [t.content for t in conversation if isinstance(t, Turn) and t.role == "system"]
    prompt = tool_prompt(specs, choice)
    if prompt is not None:
        system.append(prompt)
    messages = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for item in conversation:
        if isinstance(item, ToolResult):
            if messages and messages[-1].get("results"):
                messages[-1]["content"] += "\n" + result_text(item)
            else:
                messages.append({"role": "user", "content": result_text(item), "results": "1"})
        elif item.role == "assistant":
            messages.append({"role": "assistant", "content": assistant_text(item)})
        elif item.role == "user":
            messages.append({"role": "user", "content": item.content})
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# -- forcing -----------------------------------------------------------------------------------

def lark_string(text: str) -> str:
    return json.dumps(text)


def forcing_format(specs: Sequence[ToolSpec], choice: ToolChoice) -> ResponseFormat | None:
    """A Lark grammar that the reply must match, for required (one call of any tool, or one or
    more with parallel) and named (exactly one call of that tool): each call's arguments are
    `%json{the tool's schema}`, nothing before, between (but a newline) or after the blocks.
    None for none and auto (nothing is forced)."""
    if not choice.forced:
        return None
    check_choice(specs, choice)
    chosen = [s for s in specs if choice.mode != "named" or s.name == choice.name]
    rules = []
    for i, spec in enumerate(chosen):
        schema = dict(spec.parameters) | {"x-guidance": JSON_STYLE}
        rules.append(f"call_{i}: {lark_string(OPEN + json.dumps({'name': spec.name})[:-1] + ', ')}"
                     f" {lark_string(chr(34) + 'arguments' + chr(34) + ': ')} args_{i}"
                     f" {lark_string('}' + CLOSE)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    many = choice.mode == "required" and choice.parallel
    start = "start: call (\"\\n\" call)*" if many else "start: call"
    calls = "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))
    return ResponseFormat.lark("\n".join([start, calls, *rules]) + "\n")


# -- reading a reply ---------------------------------------------------------------------------

@dataclass
class ToolReading:
    """A reply read for calls: the content (text outside valid blocks; invalid blocks stay in
    it), the valid calls and the invalid ones, in order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[InvalidToolCall] = field(default_factory=list)


def judge_block(block: str, specs: Sequence[ToolSpec] | None, make_id: Callable[[], str],
                closed: bool = True) -> ToolCall | InvalidToolCall:
    """One block (tags included) as a valid call or an invalid one with the reason. With
    `specs` None, any name and any object of arguments is taken (the caller checks them)."""
    call_id = make_id()
    body = block[len(OPEN):len(block) - len(CLOSE)] if closed else block[len(OPEN):]
    if not closed:
        return InvalidToolCall(call_id, block, f"{OPEN} without {CLOSE}", arguments=body)
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return InvalidToolCall(call_id, block, f"the call is not JSON: {error}", arguments=body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return InvalidToolCall(call_id, block, 'a call is {"name": "<tool>", "arguments": {...}}',
                               arguments=body)
    name, arguments = value["name"], value.get("arguments", {})
    shown = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return InvalidToolCall(call_id, block, f"the arguments are not JSON: {error}", name, shown)
    if not isinstance(arguments, dict):
        return InvalidToolCall(call_id, block, "the arguments must be a JSON object", name, shown)
    if specs is not None:
        spec = next((s for s in specs if s.name == name), None)
        if spec is None:
            return InvalidToolCall(call_id, block, f"there is no tool named {name!r}", name, shown)
        problem = argument_problem(spec, arguments)
        if problem is not None:
            return InvalidToolCall(call_id, block, problem, name, shown)
    return ToolCall(call_id, name, arguments)


def argument_problem(spec: ToolSpec, arguments: dict) -> str | None:
    try:
        validator = jsonschema.validators.validator_for(spec.parameters)(spec.parameters)
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    except Exception as failure:  # noqa: BLE001 - a schema jsonschema cannot apply (an unresolvable $ref)
        return f"the schema of {spec.name!r} could not be applied to the arguments: {type(failure).__name__}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(the arguments)"
    return f"the arguments for {spec.name!r} do not match its schema at {where}: {error.message}"


class BodyScanner:
    """Finds where a block's body ends, reading the body as it grows (`end` is given the whole
    body so far each time and resumes where it stopped). The closing tag counts only outside a
    JSON string: the forced grammar lets a string argument hold any text, "</tool_call>"
    included, and a call cut there would be a grammar-valid reply read as broken JSON. A body
    that is not JSON ends at its first closing tag, as text: one that does not open with "{" or
    "[", or whose string holds a raw control character (JSON's strings cannot, so the string
    was never one). After the body's top-level value closes, the next closing tag ends it."""

    def __init__(self, close: str = CLOSE) -> None:
        self.close = close
        self.seen = 0              # body characters read so far
        self.mode = "start"        # start | json | text (first tag from text_from)
        self.text_from = 0
        self.depth, self.in_string, self.escaped = 0, False, False

    def end(self, body: str) -> int:
        """The index of the closing tag that ends `body`, or -1 while it is not known."""
        while self.mode != "text" and self.seen < len(body):
            char = body[self.seen]
            if self.mode == "start":
                if char in " \t\r\n":
                    self.seen += 1
                    continue
                self.mode = "json" if char in "{[" else "text"
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                elif char < " ":
                    self.mode = "text"   # not JSON after all: its first closing tag ends it
                    break
            elif char == "<" and body.startswith(self.close, self.seen):
                return self.seen
            elif char == "<" and self.close.startswith(body[self.seen:]):
                return -1                # a closing tag may be arriving: read it whole next time
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.mode, self.text_from = "text", self.seen + 1
            self.seen += 1
        return body.find(self.close, self.text_from) if self.mode == "text" else -1


class CallSplitter:
    """Reads a reply as it grows: text outside blocks comes out as it is known not to start a
    block (a partial "<tool_call>" and whitespace that may precede a block are held back), and
    each block is judged when its closing tag arrives: the first one outside the JSON strings
    of its body (`BodyScanner`). Whitespace at the start and end of the reply and before a
    valid block is dropped. `read_tool_calls` is this fed the whole reply, so a streamed
    reply's pieces add up to the whole answer's."""

    def __init__(self, specs: Sequence[ToolSpec] | None, parallel: bool = True,
                 make_id: Callable[[], str] = new_call_id):
        self.specs, self.parallel, self.make_id = specs, parallel, make_id
        self.pending = ""          # text not yet given out
        self.started = False       # some content was given out
        self.calls = 0
        self.scanner = BodyScanner()   # the open block's (the first OPEN in `pending`)

    def feed(self, text: str) -> list[str | ToolCall | InvalidToolCall]:
        """What `text` completes: content pieces (str) and judged blocks, in order."""
        self.pending += text
        out: list[str | ToolCall | InvalidToolCall] = []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                self.emit(out, self.pending[:self.safe_end(self.pending)])
                return out
            body_at = start + len(OPEN)
            end = self.scanner.end(self.pending[body_at:])
            if end < 0:
                self.emit(out, self.pending[:start].rstrip())
                return out
            end += body_at
            before, block = self.pending[:start], self.pending[start:end + len(CLOSE)]
            self.pending = self.pending[end + len(CLOSE):]
            self.scanner = BodyScanner()
            judged = judge_block(block, self.specs, self.make_id)
            if isinstance(judged, ToolCall) and not self.parallel and self.calls:
                judged = InvalidToolCall(judged.id, block, "parallel tool calls are off: only the first "
                                         "call of a reply is taken", judged.name, judged.arguments_json)
            if isinstance(judged, ToolCall):
                self.calls += 1
                self.emit(out, before.rstrip(), whole=True)
                out.append(judged)
            else:
                self.emit(out, before + block, whole=True)
                out.append(judged)

    def finish(self) -> list[str | ToolCall | InvalidToolCall]:
        """The rest at the reply's end: an unclosed block is invalid; trailing whitespace goes."""
        out: list[str | ToolCall | InvalidToolCall] = []
        start = self.pending.find(OPEN)
        if start >= 0:
            block = self.pending[start:]
            self.emit(out, self.pending[:start] + block, whole=True)
            out.append(judge_block(block, self.specs, self.make_id, closed=False))
        else:
            self.emit(out, self.pending.rstrip(), whole=True)
        self.pending = ""
        return out

    def safe_end(self, text: str) -> int:
        """How much of `text` (which holds no complete OPEN) can go out: not a tail that could
        begin OPEN, nor trailing whitespace (a block may follow it)."""
        cut = len(text)
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-k:]):
                cut = len(text) - k
                break
        return len(text[:cut].rstrip())

    def emit(self, out: list, text: str, whole: bool = False) -> None:
        """Give out `text`, the start of `pending` (all of it when `whole`, else `text` is a
        prefix of it and the rest stays)."""
        if not whole:
            self.pending = self.pending[len(text):]
        if not self.started:
            text = text.lstrip()
        if text:
            self.started = True
            out.append(text)


def read_tool_calls(reply: str, specs: Sequence[ToolSpec] | None, parallel: bool = True,
                    make_id: Callable[[], str] = new_call_id) -> ToolReading:
    """The reply's content, valid calls and invalid calls (see `CallSplitter`)."""
    splitter = CallSplitter(specs, parallel, make_id)
    return gather(splitter.feed(reply) + splitter.finish())


def gather(pieces: Iterable[str | ToolCall | InvalidToolCall]) -> ToolReading:
    reading = ToolReading()
    for piece in pieces:
        if isinstance(piece, str):
            reading.content += piece
        elif isinstance(piece, ToolCall):
            reading.calls.append(piece)
        else:
            reading.invalid.append(piece)
    return reading
