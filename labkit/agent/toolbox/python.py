"""run_python: run Python code in the sandbox (the interpreter's standard library, no network,
a scratch directory, the sandbox's limits); its stdout is the result."""

from __future__ import annotations

from labkit.agent.sandbox import Sandbox
from labkit.agent.tools import Tool


def run_python(sandbox: Sandbox) -> Tool:
    return Tool("run_python", "Run a Python program and return what it prints. No network; files only "
                "under the current directory.",
                {"type": "object",
                 "properties": {"code": {"type": "string", "minLength": 1, "maxLength": 20_000},
                                "stdin": {"type": "string", "maxLength": 100_000}},
                 "required": ["code"], "additionalProperties": False},
                lambda args: sandbox.run_python(args["code"], args.get("stdin", "").encode()))
