"""Parsing generated turns: reasoning, several tool calls, and every kind of format error."""

from __future__ import annotations

import json

import pytest

from tests.rollout.turns import tool_call, turn
from workers.engines.toolcall import TOOL_CALL_FORMAT_ERROR, parse_response


def test_reasoning_and_several_calls() -> None:
    text = turn("two things", tool_call("calculator", expression="1+1"),
                tool_call("python", code="print(2)"))
    parsed = parse_response(text, call_id="c7")
    assert parsed.reasoning_content == "two things"
    assert parsed.reasoning_first and parsed.well_formed and parsed.attempted_tool_call
    assert [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("c7-0", "calculator", {"expression": "1+1"}), ("c7-1", "python", {"code": "print(2)"})]
    assert parsed.content == ""
    message = parsed.to_message()
    assert message["role"] == "assistant" and message["reasoning_content"] == "two things"
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"code": "print(2)"}
    assert message["tool_calls"][0]["type"] == "function"


def test_plain_answer_has_no_calls() -> None:
    parsed = parse_response("The answer is 4.", call_id="c1")
    assert parsed.content == "The answer is 4." and parsed.reasoning_content is None
    assert not parsed.attempted_tool_call and parsed.well_formed and not parsed.reasoning_first
    assert "tool_calls" not in parsed.to_message()


def test_text_around_calls_is_content_and_string_arguments_are_decoded() -> None:
    body = json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "2"})})
    parsed = parse_response(f"Let me compute.\n<tool_call>{body}</tool_call>\nDone.",
                            call_id="x")
    assert parsed.content == "Let me compute.\n\nDone."
    assert parsed.tool_calls[0].arguments == {"expression": "2"}


@pytest.mark.parametrize(("body", "detail"), [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "invalid JSON"),
    ('["calculator"]', "expected a JSON object"),
    ('{"arguments": {}}', "field 'name'"),
    ('{"name": "calculator"}', "field 'arguments' is missing"),
    ('{"name": "calculator", "arguments": [1]}', "must be an object"),
    ('{"name": "calculator", "arguments": "{oops"}', "not valid JSON"),
])
def test_malformed_call_is_a_format_error(body: str, detail: str) -> None:
    parsed = parse_response(turn("try", f"<tool_call>\n{body}\n</tool_call>"), call_id="c")
    assert not parsed.well_formed and parsed.attempted_tool_call
    assert parsed.tool_calls == ()
    assert len(parsed.format_errors) == 1
    assert parsed.format_errors[0].startswith(TOOL_CALL_FORMAT_ERROR)
    assert detail in parsed.format_errors[0]
    assert parsed.malformed_calls == (body,)


def test_unclosed_and_stray_tags() -> None:
    unclosed = parse_response('<tool_call>\n{"name": "a", "arguments": {}}', call_id="c")
    assert "is not closed" in unclosed.format_errors[0]
    stray = parse_response('{"name": "a", "arguments": {}}</tool_call>', call_id="c")
    assert "without a matching" in stray.format_errors[0]
    mixed = parse_response(tool_call("a") + "<tool_call>{bad</tool_call>", call_id="c")
    assert len(mixed.tool_calls) == 1 and len(mixed.format_errors) == 1
    nested = parse_response("<tool_call>" + tool_call("a"), call_id="c")
    assert len(nested.format_errors) == 1 and nested.tool_calls[0].name == "a"


def test_reasoning_variants() -> None:
    unclosed = parse_response("<think>\nstill thinking", call_id="c")
    assert unclosed.reasoning_content == "still thinking" and unclosed.content == ""
    assert not unclosed.reasoning_first
    opener_in_prompt = parse_response("thinking\n</think>\n\nanswer", call_id="c")
    assert opener_in_prompt.reasoning_content == "thinking"
    assert opener_in_prompt.content == "answer" and opener_in_prompt.reasoning_first
    empty = parse_response("<think></think>" + tool_call("a"), call_id="c")
    assert empty.reasoning_content == "" and not empty.reasoning_first
    late = parse_response(tool_call("a") + "<think>x</think>", call_id="c")
    assert late.reasoning_content is None and not late.reasoning_first


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match="text must be a str"):
        parse_response(b"x", call_id="c")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="call_id"):
        parse_response("x", call_id="")
