"""Reward functions: EGPO's strict binary function-call reward and the final-answer reward."""

from __future__ import annotations

import pytest

from tests.rollout.turns import tool_call, turn
from workers.rollout.rewards import (
    Reward,
    Transcript,
    check_ground_truth,
    final_answer_reward,
    function_call_reward,
    get_reward,
    register_reward,
)

TRUTH = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]


def _score(text: str, truth: object = TRUTH) -> Reward:
    return function_call_reward(truth, Transcript(messages=(), assistant_texts=(text,)))


def test_reasoning_then_the_right_call_scores_one() -> None:
    reward = _score(turn("weather lookup", tool_call("get_weather", city="Paris",
                                                     unit="celsius")))
    assert reward.value == 1.0 and reward.components == {"format": 1.0, "correct": 1.0}


def test_normalisation_key_order_numbers_and_whitespace() -> None:
    truth = {"name": "convert", "arguments": {"amount": 2, "to": "EUR", "opts": [1, {"a": 1}]}}
    text = turn("convert", '<tool_call>\n{"name": " convert", "arguments": '
                '{"opts": [1.0, {"a": 1}], "to": " EUR ", "amount": 2.0}}\n</tool_call>')
    assert _score(text, truth).value == 1.0
    assert _score(text.replace("[1.0,", "[true,"), truth).value == 0.0


@pytest.mark.parametrize(("text", "format_ok", "correct"), [
    (tool_call("get_weather", city="Paris", unit="celsius"), 0.0, 1.0),
    ("<think></think>" + tool_call("get_weather", city="Paris", unit="celsius"), 0.0, 1.0),
    (turn("x", tool_call("get_weather", city="Paris", unit="celsius")) + "\nDone!", 0.0, 1.0),
    (turn("x", tool_call("get_weather", city="Lima", unit="celsius")), 1.0, 0.0),
    (turn("x", tool_call("get_weather", city="Paris")), 1.0, 0.0),
    (turn("x", tool_call("get_weather", city="Paris", unit="celsius"),
          tool_call("get_weather", city="Paris", unit="celsius")), 1.0, 0.0),
    (turn("x", "<tool_call>{broken</tool_call>"), 0.0, 0.0),
    (turn("x"), 0.0, 0.0),
])
def test_anything_else_scores_zero(text: str, format_ok: float, correct: float) -> None:
    reward = _score(text)
    assert reward.value == 0.0
    assert reward.components == {"format": format_ok, "correct": correct}


def test_parallel_calls_compare_as_a_multiset() -> None:
    truth = [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    assert _score(turn("both", tool_call("b"), tool_call("a", x=1)), truth).value == 1.0
    assert _score(turn("both", tool_call("a", x=1)), truth).value == 0.0


def test_last_kept_turn_is_judged_and_empty_transcript_scores_zero() -> None:
    good = turn("w", tool_call("get_weather", city="Paris", unit="celsius"))
    transcript = Transcript(messages=(), assistant_texts=("nonsense", good))
    assert function_call_reward(TRUTH, transcript).value == 1.0
    assert function_call_reward(TRUTH, Transcript(messages=(), assistant_texts=())).value == 0.0


@pytest.mark.parametrize(("truth", "detail"), [
    ([], "non-empty list"),
    ([{"arguments": {}}], "call [0] field 'name'"),
    ([{"name": "a", "arguments": [1]}], "call [0] field 'arguments'"),
    ("get_weather", "non-empty list"),
])
def test_bad_function_call_ground_truth(truth: object, detail: str) -> None:
    with pytest.raises(ValueError, match=detail.replace("[", r"\[").replace("]", r"\]")):
        check_ground_truth("function_call", truth)


def test_final_answer_reward() -> None:
    def transcript(answer: str, with_tool: bool = True) -> Transcript:
        messages = [{"role": "user", "content": "What is 2+3?"}]
        if with_tool:
            messages.append({"role": "tool", "tool_call_id": "c-0", "content": "5"})
        messages.append({"role": "assistant", "content": answer})
        return Transcript(messages=tuple(messages), assistant_texts=(answer,))

    assert final_answer_reward("5", transcript("So 2 + 3 = 5.")).components == {
        "correct": 1.0, "used_tools": 1.0}
    assert final_answer_reward(1314, transcript("It is 1,314", with_tool=False)).components == {
        "correct": 1.0, "used_tools": 0.0}
    assert final_answer_reward("5", transcript("5 is not it, 6 is")).value == 0.0
    assert final_answer_reward("5", transcript("no idea")).value == 0.0
    with pytest.raises(ValueError, match="ground_truth must be a number"):
        final_answer_reward("five", transcript("5"))


def test_registry_by_name() -> None:
    assert get_reward("function_call") is function_call_reward
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("final_answer")(final_answer_reward)
