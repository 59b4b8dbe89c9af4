"""calculator: arithmetic on numbers, read with `ast` and evaluated node by node (no eval).

Integers and floats; + - * / // % ** and unary + -; parentheses. Python's own meaning of
each operator (tests hold it to Python's arithmetic on random expressions). Integer results
are bounded (MAX_BITS) so that `9**9**9` is refused instead of eating the process.
"""

from __future__ import annotations

import ast
import operator

from labkit.agent.sandbox import ErrorKind, ToolResult
from labkit.agent.tools import Tool

MAX_BITS = 100_000
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class NotArithmetic(ValueError):
    pass


def too_big(op: type, a, b) -> bool:
    """Would an integer result pass MAX_BITS? Checked before computing it."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return False
    if op is ast.Pow:
        return b > 0 and abs(a) > 1 and a.bit_length() * b > MAX_BITS
    if op is ast.Mult:
        return a.bit_length() + b.bit_length() > MAX_BITS
    return False


def evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        a, b = evaluate(node.left), evaluate(node.right)
        if too_big(type(node.op), a, b):
            raise NotArithmetic(f"the result would pass {MAX_BITS} bits")
        return BINARY[type(node.op)](a, b)
    raise NotArithmetic(f"{type(node).__name__} is not arithmetic")


def calculate(expression: str) -> ToolResult:
    try:
        value = evaluate(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, NotArithmetic, ZeroDivisionError, OverflowError, RecursionError, MemoryError,
            ValueError, TypeError) as e:  # TypeError: complex (from (-8) ** 0.5) // or % a number
        return ToolResult.failure(ErrorKind.BAD_ARGUMENTS, f"{type(e).__name__}: {e}")
    return ToolResult.success(repr(value))


def calculator() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
                {"type": "object", "properties": {"expression": {"type": "string", "minLength": 1,
                                                                 "maxLength": 1000}},
                 "required": ["expression"], "additionalProperties": False},
                lambda args: calculate(args["expression"]))
