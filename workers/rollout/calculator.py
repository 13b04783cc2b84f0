"""A safe arithmetic calculator tool: parses with :mod:`ast`, never evaluates code.

Accepted: integer and decimal numbers (``1_000``, ``2.5``, ``1e3``), ``+ - * / // % **``,
unary ``+``/``-`` and parentheses. Everything else (names, calls, attributes, strings,
comparisons, ``^``) is refused with a ValueError-type outcome. Sizes are bounded so that an
expression cannot exhaust memory or time: at most 500 characters, integer results of at most
4096 bits, and powers whose result would be larger are refused as OverflowError before being
computed.
"""

from __future__ import annotations

import ast
import math
import operator
import threading
from collections.abc import Callable
from typing import Any

from workers.rollout.tools import ToolOutcome, function_schema

__all__ = ["Calculator", "evaluate_expression", "format_number"]

MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_SYMBOLS = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
            ast.RShift: ">>", ast.MatMult: "@"}


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise OverflowError(f"result exceeds {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError("result is not a finite number")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise OverflowError(f"result exceeds {MAX_INT_BITS} bits")
    try:
        result = base ** exponent
    except OverflowError:
        raise OverflowError("result is too large") from None
    if isinstance(result, complex):
        raise ValueError("result is a complex number (negative base with fractional exponent)")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"unsupported literal {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp):
        kind = type(node.op)
        if kind not in _BINARY:
            symbol = _SYMBOLS.get(kind, kind.__name__)
            hint = " (use ** for powers)" if kind is ast.BitXor else ""
            raise ValueError(f"unsupported operator {symbol}{hint}")
        left, right = _evaluate(node.left), _evaluate(node.right)
        if kind is ast.Pow:
            return _check_size(_power(left, right))
        return _check_size(_BINARY[kind](left, right))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def evaluate_expression(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely.

    Raises TypeError when ``expression`` is not a str; SyntaxError when it does not parse;
    ValueError for an empty/too long expression or anything besides numbers, the arithmetic
    operators and parentheses; ZeroDivisionError; OverflowError when a result is too large.
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = _parse(text)
    except SyntaxError as exc:
        raise SyntaxError(f"invalid expression: {exc.msg}") from None
    return _evaluate(tree)


#: Serializes this module's parses (see :func:`_parse`).
_PARSE_LOCK = threading.Lock()


def _parse(text: str) -> ast.Expression:
    """``ast.parse(text, mode="eval")`` for tool calls running in threads at once. CPython
    3.11's AST conversion counts its recursion depth in state that every thread shares, so a
    parse running beside another (this tool in a pool thread, any other ``ast.parse`` of the
    process) can fail with a spurious ``SystemError: AST constructor recursion depth
    mismatch`` (python/cpython#106905). Parses here are serialized, and one that still meets
    a parse elsewhere is tried again."""
    for attempt in range(3):
        try:
            with _PARSE_LOCK:
                return ast.parse(text, mode="eval")
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def format_number(value: int | float) -> str:
    """Integers as digits; floats with an integral value below 1e16 as digits too (``6/3`` is
    ``2``); other floats with up to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.12g}"


class Calculator:
    """The ``calculator`` tool: ``{"expression": "12 * (3 + 4)"}`` → ``"84"``."""

    name = "calculator"
    idempotent = True  # a pure function: a call interrupted at a crash may run again
    schema = function_schema(
        "calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        properties={"expression": {"type": "string", "description": "for example (12 + 3) * 4"}},
        required=["expression"],
    )

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Evaluate ``arguments["expression"]``; errors become outcomes with the exception's
        type name (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError)."""
        try:
            value = evaluate_expression(arguments.get("expression"))  # type: ignore[arg-type]
        except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as exc:
            return ToolOutcome.error(type(exc).__name__, str(exc))
        return ToolOutcome(output=format_number(value))
