"""Tools, the allow-list they are called through, and the tool turn a result becomes.

    registry = ToolRegistry([calculator(), word_count(), run_python(sandbox)])
    result = registry.call("calculator", '{"expression": "2 + 3 * 4"}')   -> ToolResult
    message = tool_message(call_id, "calculator", result)                  -> {"role": "tool", ...}

A name not on the list is refused without running anything; arguments that are not a JSON
object valid against the tool's schema (`jsonschema`, the schema's own draft) are
`bad_arguments`, and the handler never sees them. A handler that raises is `crashed`: the
loop goes on and the model is told.

Tool output is data. `tool_message` puts it, as one string, into the content of a `tool`
turn; nothing here reads it, and the runtime never looks inside it for instructions or
tool calls. Special-token spellings in it (`<|im_end|>`, `<tool_call>`) stay characters:
making the template encode them as text is the template's part (labkit.protocols).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jsonschema

from labkit.agent.sandbox import ErrorKind, ToolResult


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict                          # a JSON schema for the arguments object
    handler: Callable[[dict], ToolResult]

    def spec(self) -> dict:
        """OpenAI's function-tool shape, which is also what a chat template's `tools` takes."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


class ToolRegistry:
    """The allow-list: only these tools run, only with arguments their schema accepts."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools named {tool.name!r}")
            validator = jsonschema.validators.validator_for(tool.parameters)
            validator.check_schema(tool.parameters)  # a bad schema is the registrar's error, now
            self.tools[tool.name] = tool
        self.validators = {name: jsonschema.validators.validator_for(t.parameters)(t.parameters)
                           for name, t in self.tools.items()}

    def specs(self) -> list[dict]:
        return [tool.spec() for tool in self.tools.values()]

    def call(self, name: str, arguments: dict | str) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult.failure(ErrorKind.REFUSED, f"{name!r} is not an allowed tool; allowed: "
                                      f"{', '.join(sorted(self.tools))}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return ToolResult.failure(ErrorKind.BAD_ARGUMENTS, f"arguments are not JSON: {e}")
        if not isinstance(arguments, dict):
            return ToolResult.failure(ErrorKind.BAD_ARGUMENTS, "arguments must be a JSON object")
        errors = sorted(self.validators[name].iter_errors(arguments), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "(the arguments)"
            return ToolResult.failure(ErrorKind.BAD_ARGUMENTS, f"{where}: {errors[0].message}")
        try:
            return tool.handler(arguments)
        except Exception as e:  # noqa: BLE001 - a tool's bug is the model's tool error, not the loop's end
            return ToolResult.failure(ErrorKind.CRASHED, f"{name} raised {type(e).__name__}: {e}")


def tool_content(result: ToolResult) -> str:
    """The text the model reads: the output, or the error kind, why, and any output."""
    if result.ok:
        return result.output
    text = f"error ({result.error.value}): {result.detail}".rstrip()
    return f"{text}\n{result.output}" if result.output else text


def tool_message(call_id: str, name: str, result: ToolResult) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": tool_content(result)}
