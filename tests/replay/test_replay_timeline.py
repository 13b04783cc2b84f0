"""Timeline merging: every rule by a hand-written case, a shuffle-invariance property and a
seeded equivalence test against the plain pairwise reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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
from replay_reference import reference_merge

from workers.replay.equality import message_key, tools_key
from workers.replay.timeline import (
    MergePolicy,
    Message,
    Timeline,
    loss_mask,
    merge_timelines,
    plan_merge,
)


def test_prefix_is_absorbed_and_its_generation_copied() -> None:
    t1 = tl(U, A1)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)
    (merged,) = merge_timelines([t1, t2], TEXT)
    assert [m.author for m in merged.messages] == ["env", "llm", "tool", "llm"]
    assert merged.messages[1].logprobs == A1.logprobs
    assert loss_mask(merged) == [0, 0, 0, 1, 1, 0, 0, 1, 1]


def test_middle_message_differs_both_survive() -> None:
    t1 = tl(U, A1)
    other_user = ctx("user", "another question", [1, 2, 4])
    t2 = tl(other_user, as_ctx(A1), T_OUT, A2)
    assert merge_timelines([t1, t2], TEXT) == [t1, t2]
    assert merge_timelines([t1, t2], TOKEN) == [t1, t2]


def test_text_equal_token_different_merges_only_at_text_level() -> None:
    t1 = tl(U, A1)
    drifted = ctx("assistant", A1.text, [10, 99, 11], A1.tool_calls)
    t2 = tl(U, drifted, T_OUT, A2)
    outcome = plan_merge([t1, t2], TEXT)
    assert outcome.absorber == [1, None]
    survivor = outcome.merged[1]
    assert survivor.messages[1].token_ids == A1.token_ids  # the sampled ids, not re-encoded
    assert outcome.drifted == {1: [1]}
    assert plan_merge([t1, t2], TOKEN).absorber == [None, None]


def test_tool_calls_are_compared_by_name_and_parsed_arguments() -> None:
    t1 = tl(U, A1)
    same_args = {"id": "other", "type": "function",
                 "function": {"name": "search", "arguments": '{ "query" : "x" }'}}
    t2 = tl(U, ctx("assistant", A1.text, A1.token_ids, [same_args]), T_OUT, A2)
    assert plan_merge([t1, t2], TEXT).absorber == [1, None]
    other_args = {"type": "function", "function": {"name": "search",
                                                   "arguments": '{"query": "y"}'}}
    t3 = tl(U, ctx("assistant", A1.text, A1.token_ids, [other_args]), T_OUT, A2)
    assert plan_merge([t1, t3], TEXT).absorber == [None, None]


def test_tool_lists_matter_only_without_ignore_tools() -> None:
    x = [{"type": "function", "function": {"name": "x"}}]
    y = [{"type": "function", "function": {"name": "y"}}]
    t1 = tl(U, A1, tools=x)
    t2 = tl(U, as_ctx(A1), T_OUT, A2, tools=y)
    assert plan_merge([t1, t2], MergePolicy(ignore_tools=True)).absorber == [1, None]
    assert plan_merge([t1, t2], MergePolicy(ignore_tools=False)).absorber == [None, None]
    t3 = tl(U, as_ctx(A1), T_OUT, A2, tools=list(x))
    assert plan_merge([t1, t3], MergePolicy(ignore_tools=False)).absorber == [1, None]


def test_agents_never_merge_even_when_identical() -> None:
    t1 = tl(U, A1, agent="planner")
    t2 = tl(U, A1, agent="coder")
    t3 = tl(U, as_ctx(A1), T_OUT, A2, agent="coder")
    outcome = plan_merge([t1, t2, t3], TEXT)
    assert outcome.absorber == [None, 2, None]
    assert [t.agent for t in outcome.surviving_timelines()] == ["planner", "coder"]


def test_chain_of_three_collapses_into_the_longest() -> None:
    t_out2 = ctx("tool", "result 2", [22])
    a3 = gen("third", [14, 15, 16])
    t1 = tl(U, A1)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)
    t3 = tl(U, as_ctx(A1), T_OUT, as_ctx(A2), t_out2, a3)
    outcome = plan_merge([t1, t2, t3], TEXT)
    assert outcome.absorber == [2, 2, None]
    (merged,) = outcome.surviving_timelines()
    assert [m.author for m in merged.messages] == ["env", "llm", "tool", "llm", "tool", "llm"]
    assert sum(loss_mask(merged)) == 2 + 2 + 3


def test_fork_the_longer_branch_absorbs_the_common_prefix() -> None:
    t1 = tl(U, A1)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)
    other_out = ctx("tool", "other result", [23])
    a3 = gen("third", [14])
    a4 = gen("fourth", [15])
    t3 = tl(U, as_ctx(A1), other_out, as_ctx(a3), ctx("tool", "r", [24]), a4)
    outcome = plan_merge([t1, t2, t3], TEXT)
    assert outcome.absorber == [2, None, None]
    assert outcome.merged[2].messages[1].is_llm
    assert not outcome.merged[1].messages[1].is_llm  # the shorter branch keeps it as context


def test_prefix_recorded_after_the_longer_timeline_still_merges() -> None:
    t1 = tl(U, A1)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)
    outcome = plan_merge([t2, t1], TEXT)
    assert outcome.absorber == [None, 0]
    assert outcome.merged[0].messages[1].is_llm


def test_identical_duplicates_keep_the_later() -> None:
    early = tl(U, gen("first", [10, 11], lp=-1.0))
    late = tl(U, gen("first", [10, 11], lp=-2.0))
    outcome = plan_merge([early, late], TEXT)
    assert outcome.absorber == [1, None]
    assert outcome.merged[1].messages[1].logprobs == [-2.0, -2.0]
    # With a longer timeline absorbing both, the later copy's tokens and logprobs win.
    early = tl(U, gen("first", [10, 11], lp=-1.0))
    late = tl(U, gen("first", [10, 98, 11], lp=-2.0))
    longer = tl(U, ctx("assistant", "first", [10, 11]), T_OUT, A2)
    outcome = plan_merge([early, late, longer], TEXT)
    assert outcome.absorber == [2, 2, None]
    assert outcome.merged[2].messages[1].token_ids == [10, 98, 11]
    assert outcome.merged[2].messages[1].logprobs == [-2.0, -2.0, -2.0]


def test_truncated_output_keeps_its_flag_and_sampled_mask_after_absorption() -> None:
    cut = gen("partial answ", [30, 31, 32], prompt=2, truncated=True)
    t1 = tl(U, cut)
    t2 = tl(U, ctx("assistant", "partial answ", [90, 91, 30, 31, 32, 7]),
            ctx("user", "go on", [40]), A2)
    (merged,) = merge_timelines([t1, t2], TEXT)
    assert merged.messages[1].truncated is True
    assert merged.messages[1].sampled == [0, 0, 1, 1, 1]
    assert merged.messages[1].token_ids == [90, 91, 30, 31, 32]  # no end token added
    assert loss_mask(merged) == [0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1]


def test_rollback_whose_error_feedback_was_removed_keeps_both() -> None:
    bad = gen("bad", [10, 11], tool_calls=[CALL])
    error = ctx("tool", "NameError: name 'x' is not defined", [50, 51])
    feedback = ctx("user", "The tool call failed, fix it.", [52])
    fixed_call = {"type": "function", "function": {"name": "search",
                                                   "arguments": '{"query": "fixed"}'}}
    fixed = gen("fixed", [12], tool_calls=[fixed_call])
    t_fail = tl(U, bad)
    t_retry = tl(U, as_ctx(bad), error, feedback, fixed)
    t_final = tl(U, as_ctx(fixed), T_OUT, A2)
    outcome = plan_merge([t_fail, t_retry, t_final], TEXT)
    assert outcome.absorber == [1, None, None]
    assert [t.messages[-1].text for t in outcome.surviving_timelines()] == ["fixed", "second"]


def test_loss_mask_is_one_exactly_on_sampled_tokens() -> None:
    m = gen("x", [5, 6, 7], prompt=3)
    t = tl(ctx("system", "s", [1]), U, m)
    assert loss_mask(t) == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    partial = Message(role="assistant", author="llm", text="y", token_ids=[1, 2, 3],
                      logprobs=[0.0, -1.0, 0.0], sampled=[0, 1, 0])
    assert loss_mask(tl(partial)) == [0, 1, 0]
    # ``sampled`` on a context message does not make it trainable.
    assert loss_mask(tl(Message(role="user", author="user", text="u", token_ids=[1],
                                logprobs=None, sampled=[1]))) == [0]


def test_inputs_are_not_modified() -> None:
    t1 = tl(U, A1)
    t2 = tl(U, as_ctx(A1), T_OUT, A2)
    merge_timelines([t1, t2], TEXT)
    assert t2.messages[1].author == "env"


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: merge_timelines("abc", TEXT), TypeError, "timelines must be a sequence"),
        (lambda: merge_timelines([1], TEXT), TypeError, r"timelines\[0\] must be a Timeline"),
        (lambda: merge_timelines([], "text"), TypeError, "policy must be a MergePolicy"),
        (lambda: MergePolicy(compare_level="chars"), ValueError, "'chars'"),
        (lambda: MergePolicy(ignore_tools="yes"), TypeError, "ignore_tools"),
        (lambda: Timeline(agent="a", messages=[]), ValueError, "must not be empty"),
        (lambda: Timeline(agent="", messages=[U]), TypeError, "Timeline.agent"),
        (lambda: Timeline(agent="a", messages=["hi"]), TypeError, r"messages\[0\]"),
        (lambda: Message("user", "user", "t", [1, 2], [0.0]), ValueError, "logprobs has 1"),
        (lambda: Message("user", "user", "t", [1], None, sampled=[2]), ValueError, "0 and 1"),
        (lambda: Message("user", "user", "t", [1.5], None), TypeError, r"token_ids\[0\]"),
        (lambda: Message("", "user", "t", [1], None), TypeError, "Message.role"),
        (lambda: Message("user", "user", None, [1], None), TypeError, "Message.text"),
        (lambda: Message("user", "user", "t", [1], None, tool_calls=["x"]), TypeError,
         r"tool_calls\[0\]"),
        (lambda: loss_mask([U]), TypeError, "timeline must be a Timeline"),
    ],
)
def test_bad_input_is_named(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


# --- random timelines: reference equivalence and shuffle invariance ------------------------


@pytest.mark.parametrize("policy", [TEXT, TOKEN, MergePolicy(ignore_tools=False),
                                    MergePolicy(compare_level="token", ignore_tools=False)])
def test_matches_pairwise_reference_onrandom_episodes(policy: MergePolicy) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        timelines = random_episode(rng, rng.randint(1, 12))
        assert merge_timelines(timelines, policy) == reference_merge(timelines, policy)


def _signature(t: Timeline, policy: MergePolicy) -> tuple:
    tools = tools_key(t.tools) if not policy.ignore_tools else None
    return (t.agent, tools, tuple(message_key(m, policy.compare_level) for m in t.messages))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 10), data=st.data(),
       policy=st.sampled_from([TEXT, TOKEN, MergePolicy(ignore_tools=False)]))
def test_survivors_do_not_depend_on_recording_order(seed: int, n: int, data: st.DataObject,
                                                    policy: MergePolicy) -> None:
    timelines = random_episode(random.Random(seed), n)
    order = data.draw(st.permutations(range(n)))
    shuffled = [timelines[i] for i in order]
    before = sorted(map(repr, (_signature(t, policy) for t in merge_timelines(timelines, policy))))
    after = sorted(map(repr, (_signature(t, policy) for t in merge_timelines(shuffled, policy))))
    assert before == after
    # Which copy of identical duplicates survives follows the tie rule: the later recorded.
    outcome = plan_merge(shuffled, policy)
    for i, a in enumerate(outcome.absorber):
        if a is not None:
            assert (len(shuffled[a]), a) > (len(shuffled[i]), i)
