"""The tools labkit's agent runtime ships: calculator, word_count, run_python (sandboxed)."""

from __future__ import annotations

from labkit.agent.sandbox import Sandbox
from labkit.agent.toolbox.calculator import calculator
from labkit.agent.toolbox.python import run_python
from labkit.agent.toolbox.text import word_count
from labkit.agent.tools import ToolRegistry


def default_registry(sandbox: Sandbox | None = None) -> ToolRegistry:
    """calculator and word_count; run_python too when a sandbox is given."""
    tools = [calculator(), word_count()]
    return ToolRegistry(tools + ([run_python(sandbox)] if sandbox is not None else []))


__all__ = ["calculator", "default_registry", "run_python", "word_count"]
