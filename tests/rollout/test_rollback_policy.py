"""Rollback policy pieces: config coercion, error matching, feedback text; the list sink."""

from __future__ import annotations

import pytest

from store.events import DEFAULT_ROLLBACK_ERRORS, RollbackConfig, RunConfig, RunCreated
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.prompt import render_prompt_ids
from workers.rollout.rollback import format_error_feedback, matches_rollback, rollback_config
from workers.rollout.sink import EventSink, ListSink
from workers.rollout.tools import ToolOutcome


def test_rollback_config_accepts_run_config_dict_and_none() -> None:
    custom = RollbackConfig(max_tool_retries=1)
    assert rollback_config(RunConfig(rollback=custom)) is custom
    assert rollback_config(custom) is custom
    assert rollback_config(None).rollback_on_errors == DEFAULT_ROLLBACK_ERRORS
    assert rollback_config({"enable_tool_rollback": False}).enable_tool_rollback is False
    with pytest.raises(ValueError, match="max_tool_retries"):
        rollback_config({"max_tool_retries": -1})
    with pytest.raises(TypeError, match="got list"):
        rollback_config([1])  # type: ignore[arg-type]


def test_matching_by_type_or_text_and_only_for_errors() -> None:
    patterns = ["NameError", "tool call format is wrong"]
    name_error = ToolOutcome.error("NameError", "name 'x' is not defined")
    assert matches_rollback(name_error, patterns)
    traceback_text = ToolOutcome(output="Traceback ...\nNameError: x", is_error=True,
                                 error_type="RuntimeError")
    assert matches_rollback(traceback_text, patterns)
    printed = ToolOutcome(output="NameError is a Python exception")
    assert not matches_rollback(printed, patterns)
    assert not matches_rollback(ToolOutcome.error("ZeroDivisionError", "division by zero"),
                                patterns)
    format_error = ToolOutcome(output="tool call format is wrong: invalid JSON", is_error=True,
                               error_type="ToolCallFormatError")
    assert matches_rollback(format_error, patterns)


def test_feedback_lists_every_error() -> None:
    text = format_error_feedback(["NameError: x", "  SyntaxError: y\n"])
    assert text.splitlines() == [
        "The previous tool call(s) failed with the following error(s):",
        "1. NameError: x", "2. SyntaxError: y",
        "Fix the error(s) and make the tool call(s) again."]
    with pytest.raises(ValueError, match="error_messages"):
        format_error_feedback([])


def test_list_sink() -> None:
    sink = ListSink()
    assert isinstance(sink, EventSink)
    event = RunCreated(run_id="r")
    assert sink.append("run-r", [event]) == 1
    assert sink.append("run-r", [event]) == 2
    assert sink.types("run-r") == ["run_created", "run_created"] and sink.events("x") == []
    with pytest.raises(ValueError, match="stream_id"):
        sink.append("", [event])
    with pytest.raises(ValueError, match="must not be empty"):
        sink.append("run-r", [])
    with pytest.raises(TypeError, match=r"events\[0\] must be an Event"):
        sink.append("run-r", [{"type": "run_created"}])  # type: ignore[list-item]


def test_rendering_needs_a_chat_template(hf_backend: TransformersBackend) -> None:
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=hf_backend.tokenizer.backend_tokenizer)
    request = GenerationRequest(sampling=SamplingParams(),
                                messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ValueError, match="no chat_template"):
        render_prompt_ids(bare, request)
    assert render_prompt_ids(bare, GenerationRequest(sampling=SamplingParams(),
                                                     prompt_ids=(3, 4))) == [3, 4]
