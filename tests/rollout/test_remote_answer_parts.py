"""The pieces of the RolloutServer side that read a trainer's URL and answer: which endpoint
a ``server_url`` names, and the tool calls an answer carries outside its token ids (bad
entries included)."""

from __future__ import annotations

import json

import pytest

from workers.engines.backend_remote import answer_tool_calls_text, split_endpoint
from workers.engines.toolcall import parse_response


@pytest.mark.parametrize("url,expected", [
    ("http://t:1", ("http://t:1", None)),
    ("http://t:1/", ("http://t:1", None)),
    ("http://t:1/v1/chat/completions", ("http://t:1", "chat")),
    ("http://t:1/prefix/v1/completions/", ("http://t:1/prefix", "completions")),
    ("http://t:1/v1/chat", ("http://t:1/v1/chat", None)),
])
def test_split_endpoint(url: str, expected: tuple[str, str | None]) -> None:
    assert split_endpoint(url) == expected


def test_openai_tool_calls_become_blocks_the_loop_parses() -> None:
    text = answer_tool_calls_text({"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}},
        {"id": "b", "type": "function", "function": {"name": "neg", "arguments": {"x": 3}}}]})
    parsed = parse_response(text, call_id="c")
    assert parsed.well_formed
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("add", {"a": 1, "b": 2}), ("neg", {"x": 3})]


def test_tool_call_text_in_the_content_is_taken_from_there() -> None:
    content = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    text = answer_tool_calls_text({"role": "assistant", "content": content})
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert parse_response(text, call_id="c").tool_calls[0].name == "add"


def test_bad_entries_are_skipped_or_become_format_errors() -> None:
    assert answer_tool_calls_text(None) == ""
    assert answer_tool_calls_text({"content": "no calls here"}) == ""
    assert answer_tool_calls_text({"tool_calls": ["nonsense", {"function": "add"}]}) == ""
    # Arguments that are not a JSON object reach the parser as they are: a format error,
    # answered in the conversation rather than run.
    text = answer_tool_calls_text({"tool_calls": [
        {"function": {"name": "add", "arguments": "{not json"}}]})
    parsed = parse_response(text, call_id="c")
    assert parsed.attempted_tool_call and not parsed.well_formed and not parsed.tool_calls
