"""Negative samples: turn counts, the per-group cap and its deterministic order."""

from __future__ import annotations

import datetime as dt

import pytest
from replay_messages import A1, T_OUT, U, as_ctx, ctx, gen, tl

from workers.replay.negatives import (
    NegativeSample,
    build_negative,
    select_negatives,
    turn_counts,
)


def negative(group: str | None, *, episode: str = "e1", index: int = 0,
             when: dt.datetime | None = None) -> NegativeSample:
    return build_negative(
        tl(U, gen("bad", [10])), call_id=f"{episode}-{index}", checkpoint_id="cp",
        position_key="turn_1", retry_index=0, error_messages=["NameError: x"],
        error_types=["NameError"], tool_calls=[], reward=-1.0, group_id=group,
        episode_id=episode, occurred_at=when, failure_index=index)


def test_build_negative_carries_the_failure() -> None:
    failed = tl(U, as_ctx(A1), T_OUT, ctx("tool", "r2", [22]), ctx("user", "go", [23]),
                gen("oops", [30, 31], prompt=1, tool_calls=A1.tool_calls))
    n = build_negative(failed, call_id="call-3", checkpoint_id="cp-1", position_key="turn_2",
                       retry_index=1, error_messages=["SyntaxError: bad"],
                       error_types=["SyntaxError"], tool_calls=A1.tool_calls, reward=-0.5,
                       timeline_index=3, group_id="g")
    assert (n.assistant_turns, n.user_turns) == (2, 1)
    assert n.sample.reward == -0.5
    assert n.sample.loss_mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert n.sample.response_ids == [30, 31]
    assert (n.position_key, n.retry_index, n.error_types) == ("turn_2", 1, ["SyntaxError"])
    assert n.tool_calls == A1.tool_calls


def test_turn_counts_count_environment_turns_after_the_first_assistant() -> None:
    t = tl(ctx("system", "s", [1]), U, as_ctx(A1), T_OUT, ctx("tool", "t2", [2]),
           ctx("assistant", "a", [3]), ctx("user", "more", [4]), gen("x", [5]))
    assert turn_counts(t) == (3, 2)
    assert turn_counts(tl(U, gen("x", [5]))) == (1, 0)


def test_cap_keeps_the_failures_earliest_in_their_episodes() -> None:
    """By stream position, then episode id; the wall-clock time of a failure plays no part
    (it depends on how a group's concurrent episodes were scheduled)."""
    t0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    items = [
        negative("g1", episode="e2", index=5, when=t0 + dt.timedelta(seconds=3)),
        negative("g1", episode="e1", index=9, when=t0 + dt.timedelta(seconds=1)),
        negative("g2", episode="e3", index=1, when=None),
        negative("g1", episode="e1", index=2, when=t0 + dt.timedelta(seconds=2)),
        negative("g2", episode="e4", index=4, when=t0.replace(tzinfo=None)),
    ]
    chosen = select_negatives(items, max_per_group=1)
    assert [(n.group_id, n.call_id) for n in chosen] == [("g2", "e3-1"), ("g1", "e1-2")]
    chosen = select_negatives(items, max_per_group=2)
    assert [n.call_id for n in chosen] == ["e3-1", "e1-2", "e4-4", "e2-5"]
    assert select_negatives(list(reversed(items)), max_per_group=2) == chosen
    assert select_negatives(items, max_per_group=5, enabled=False) == []
    assert select_negatives(items, max_per_group=0) == []


def test_order_is_stream_position_then_episode() -> None:
    items = [negative("g", episode="b", index=3), negative("g", episode="a", index=7),
             negative("g", episode="a", index=3), negative("g", episode="c", index=1)]
    assert [n.call_id for n in select_negatives(items, max_per_group=4)] == \
        ["c-1", "a-3", "b-3", "a-7"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"position_key": "turn-1"}, ValueError, "turn_N"),
        ({"retry_index": -1}, ValueError, "retry_index"),
        ({"reward": float("inf")}, ValueError, "reward"),
        ({"call_id": ""}, TypeError, "call_id"),
        ({"error_messages": "boom"}, TypeError, "error_messages"),
        ({"error_types": [1]}, TypeError, r"error_types\[0\]"),
        ({"tool_calls": "x"}, TypeError, "tool_calls"),
    ],
)
def test_bad_input_is_named(kwargs: dict, error: type, match: str) -> None:
    args = dict(call_id="c", checkpoint_id="cp", position_key="turn_0", retry_index=0,
                error_messages=[], error_types=[], tool_calls=[])
    args.update(kwargs)
    with pytest.raises(error, match=match):
        build_negative(tl(U, gen("x", [1])), **args)


def test_select_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_per_group"):
        select_negatives([], max_per_group=-1)
    with pytest.raises(TypeError, match=r"negatives\[0\]"):
        select_negatives(["x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="enabled"):
        select_negatives([], enabled=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeline must be a Timeline"):
        turn_counts(None)  # type: ignore[arg-type]
