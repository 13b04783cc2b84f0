"""The calculator tool: exact arithmetic, refusals, bounded sizes."""

from __future__ import annotations

import pytest

from workers.rollout.calculator import Calculator, evaluate_expression, format_number


@pytest.mark.parametrize(("expression", "expected"), [
    ("874 + 51 + 389", "1314"),
    ("(12 + 3) * 4", "60"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("2 ** 10", "1024"),
    ("-2 ** 2", "-4"),
    ("1_000 * 1e3", "1000000"),
    ("1 / 3", "0.333333333333"),
    ("2 ** -1", "0.5"),
])
def test_results(expression: str, expected: str) -> None:
    outcome = Calculator()({"expression": expression})
    assert not outcome.is_error
    assert outcome.output == expected


@pytest.mark.parametrize(("expression", "error_type", "detail"), [
    ("__import__('os').system('true')", "ValueError", "unsupported syntax: Call"),
    ("x + 1", "ValueError", "unsupported syntax: Name"),
    ("(1).real", "ValueError", "unsupported syntax: Attribute"),
    ("'a' * 3", "ValueError", "unsupported literal"),
    ("2 ^ 3", "ValueError", "use ** for powers"),
    ("1 < 2", "ValueError", "Compare"),
    ("True + 1", "ValueError", "unsupported literal True"),
    ("1 +", "SyntaxError", "invalid expression"),
    ("1 / 0", "ZeroDivisionError", "division by zero"),
    ("9 ** 9 ** 9", "OverflowError", "exceeds 4096 bits"),
    ("10.0 ** 400", "OverflowError", "too large"),
    ("(-8) ** 0.5", "ValueError", "complex"),
    ("", "ValueError", "empty"),
    ("1+" * 300 + "1", "ValueError", "longer than 500"),
])
def test_refusals_are_error_outcomes(expression: str, error_type: str, detail: str) -> None:
    outcome = Calculator()({"expression": expression})
    assert outcome.is_error and outcome.error_type == error_type
    assert detail in outcome.error_message
    assert outcome.output.startswith(f"{error_type}: ")


def test_non_string_expression() -> None:
    outcome = Calculator()({"expression": 12})
    assert outcome.error_type == "TypeError" and "must be a string" in outcome.error_message
    with pytest.raises(TypeError, match="expression must be a string"):
        evaluate_expression(None)  # type: ignore[arg-type]


def test_format_number() -> None:
    assert format_number(10**20) == str(10**20)
    assert format_number(2.0) == "2"
    assert format_number(1e20) == "1e+20"
    assert format_number(-0.25) == "-0.25"


def test_parses_in_many_threads_at_once() -> None:
    """Tool calls run in a pool of threads: expressions evaluated from many threads at once,
    beside other parses of the process, all come out right. (The CPython 3.11 race that
    ``_parse`` guards against needs a garbage collection that runs Python code in the middle
    of a parse; this cannot provoke it at will, it checks the lock and retry keep answers
    right.)"""
    import ast
    import threading
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()

    def other_parses() -> None:  # what the rest of a process (an import, a test) does
        while not stop.is_set():
            ast.parse("f(" * 20 + "x" + ")" * 20)

    background = threading.Thread(target=other_parses)
    background.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(evaluate_expression,
                                    ["((1 + 2) * (3 - 4)) / (5 + 5)"] * 4000))
    finally:
        stop.set()
        background.join()
    assert results == [-0.3] * 4000
