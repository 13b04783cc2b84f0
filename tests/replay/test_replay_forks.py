"""Fork detection: reasons, what is not a fork, and a seeded equivalence test against a plain
loop over all earlier timelines."""

from __future__ import annotations

import random

import pytest
from replay_messages import (
    A1,
    A2,
    CALL,
    T_OUT,
    TEXT,
    TOKEN,
    U,
    as_ctx,
    ctx,
    gen,
    random_episode,
    tl,
)

from workers.replay.equality import message_key, tools_key
from workers.replay.forks import ForkPoint, detect_forks, fork_reason, merge_and_detect_forks
from workers.replay.timeline import MergePolicy, Timeline, plan_merge

OTHER_CALL = {"type": "function", "function": {"name": "search", "arguments": '{"query": "y"}'}}


def test_rollback_retry_forks_on_the_replaced_tool_call() -> None:
    bad = gen("calling", [10], tool_calls=[CALL])
    fixed = gen("calling", [11], tool_calls=[OTHER_CALL])
    t_fail = tl(U, bad)
    t_retry = tl(U, as_ctx(bad), ctx("tool", "NameError", [50]), ctx("user", "fix", [51]), fixed)
    t_final = tl(U, as_ctx(fixed), T_OUT, A2)
    assert detect_forks([t_fail, t_retry, t_final], TEXT) == [
        ForkPoint(agent="main", timeline_index=2, parent_index=1, message_index=1,
                  reason="tool_calls"),
    ]


def test_content_fork_against_the_latest_parent_with_the_longest_history() -> None:
    t1 = tl(U, as_ctx(A1), T_OUT, A2)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)  # a duplicate: not a fork
    t3 = tl(U, as_ctx(A1), ctx("tool", "different output", [29]), A2)
    t4 = tl(ctx("user", "other task", [9]), A1)
    forks = detect_forks([t1, t2, t3, t4], TEXT)
    assert forks == [ForkPoint("main", 2, 1, 2, "content"), ForkPoint("main", 3, 2, 0, "content")]


def test_tools_fork_only_without_ignore_tools() -> None:
    x = [{"type": "function", "function": {"name": "x"}}]
    t1 = tl(U, as_ctx(A1), T_OUT, A2, tools=x)
    t2 = tl(U, A1, tools=None)
    assert detect_forks([t1, t2], MergePolicy(ignore_tools=False)) == [
        ForkPoint("main", 1, 0, 0, "tools")]
    assert detect_forks([t1, t2], TEXT) == []


def test_token_drift_is_a_fork_at_token_level_only() -> None:
    t1 = tl(U, A1)
    t2 = tl(U, ctx("assistant", A1.text, [10, 99], A1.tool_calls), T_OUT, A2)
    t3 = tl(U, ctx("assistant", A1.text, [10, 98], A1.tool_calls), T_OUT, A2)
    assert detect_forks([t1, t2, t3], TEXT) == []
    assert detect_forks([t1, t2, t3], TOKEN) == [
        ForkPoint("main", 1, 0, 1, "token_drift"), ForkPoint("main", 2, 1, 1, "token_drift")]


def test_extensions_prefixes_and_other_agents_are_not_forks() -> None:
    t1 = tl(U, A1)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)
    t3 = tl(U, A1)
    t4 = tl(ctx("user", "other", [8]), A1, agent="helper")
    assert detect_forks([t1, t2, t3, t4], TEXT) == []


def test_fork_reason_rejects_bad_indices_and_identical_messages() -> None:
    t1 = tl(U, A1)
    with pytest.raises(IndexError, match="message index 5"):
        fork_reason(t1, t1, index=5)
    with pytest.raises(ValueError, match="identical"):
        fork_reason(t1, t1, index=0)
    with pytest.raises(TypeError, match="policy must be a MergePolicy"):
        detect_forks([t1], policy=None)  # type: ignore[arg-type]


def _path(t: Timeline, policy: MergePolicy) -> list:
    head = [t.agent] + ([tools_key(t.tools)] if not policy.ignore_tools else [])
    return head + [message_key(m, policy.compare_level) for m in t.messages]


def reference_forks(timelines: list[Timeline], policy: MergePolicy) -> list[ForkPoint]:
    """For each timeline, every earlier one: shared history length, keep the longest where
    both go on and differ (the latest on ties)."""
    out = []
    for i, t in enumerate(timelines):
        pi = _path(t, policy)
        best = None
        for j in range(i):
            pj = _path(timelines[j], policy)
            if pj[0] != pi[0]:
                continue
            c = 0
            while c < len(pi) and c < len(pj) and pi[c] == pj[c]:
                c += 1
            if c < len(pi) and c < len(pj) and (best is None or c >= best[0]):
                best = (c, j)
        if best is None:
            continue
        depth, j = best
        offset = 1 if policy.ignore_tools else 2
        if depth < offset:
            out.append(ForkPoint(t.agent, i, j, 0, "tools"))
        else:
            k = depth - offset
            out.append(ForkPoint(t.agent, i, j, k, fork_reason(t, timelines[j], index=k)))
    return out


@pytest.mark.parametrize("policy", [TEXT, TOKEN, MergePolicy(ignore_tools=False)])
def test_matches_plain_loop_reference_onrandom_episodes(policy: MergePolicy) -> None:
    rng = random.Random(99)
    seen = 0
    for _ in range(300):
        timelines = random_episode(rng, rng.randint(1, 12))
        expected = reference_forks(timelines, policy)
        assert detect_forks(timelines, policy) == expected
        seen += len(expected)
    assert seen > 100


@pytest.mark.parametrize("policy", [TEXT, TOKEN, MergePolicy(ignore_tools=False),
                                    MergePolicy(compare_level="token", ignore_tools=False)])
def test_merge_and_forks_together_equal_each_alone(policy: MergePolicy) -> None:
    """Keying the messages once for both gives what merging and fork detection give apart."""
    rng = random.Random(7)
    for _ in range(200):
        timelines = random_episode(rng, rng.randint(1, 12))
        outcome, forks = merge_and_detect_forks(timelines, policy)
        alone = plan_merge(timelines, policy)
        assert forks == detect_forks(timelines, policy)
        assert (outcome.absorber, outcome.survivors, outcome.drifted) == \
            (alone.absorber, alone.survivors, alone.drifted)
        assert outcome.surviving_timelines() == alone.surviving_timelines()
