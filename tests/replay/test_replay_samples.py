"""Training samples from timelines: mask, logprobs, split and counts, against a plain loop."""

from __future__ import annotations

import random

import pytest
from replay_messages import A1, A2, T_OUT, U, as_ctx, ctx, gen, random_episode, tl

from workers.replay.samples import build_sample, rollout_logprobs
from workers.replay.timeline import Message, Timeline, merge_timelines


def test_sample_of_a_merged_episode() -> None:
    first = gen("first", [10, 11], prompt=2, lp=-0.25, tool_calls=A1.tool_calls)
    t1 = tl(U, first)
    t2 = tl(U, as_ctx(first), T_OUT, A2)
    (merged,) = merge_timelines([t1, t2])
    s = build_sample(merged, timeline_index=1, drifted_messages=0, reward=1.0)
    assert s.token_ids == [1, 2, 3, 90, 91, 10, 11, 20, 21, 12, 13]
    assert s.loss_mask == [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert s.logprobs == [0.0] * 5 + [-0.25, -0.25, 0.0, 0.0, -0.5, -0.5]
    assert s.prompt_length == 5
    assert s.prompt_ids == [1, 2, 3, 90, 91]
    assert s.response_ids == [10, 11, 20, 21, 12, 13]
    assert s.response_mask == [1, 1, 0, 0, 1, 1]
    assert s.response_logprobs == [-0.25, -0.25, 0.0, 0.0, -0.5, -0.5]
    assert (s.num_messages, s.num_llm_turns, s.num_tokens, s.num_trainable_tokens) == (4, 2, 11, 4)
    assert s.reward == 1.0 and s.timeline_index == 1


def test_logprobs_of_unsampled_tokens_are_zero_even_when_recorded() -> None:
    m = Message(role="assistant", author="llm", text="x", token_ids=[1, 2],
                logprobs=[-3.0, -1.0], sampled=[0, 1])
    ctx_with_lp = Message(role="user", author="user", text="u", token_ids=[5],
                          logprobs=[-2.0])
    assert rollout_logprobs(tl(ctx_with_lp, m)) == [0.0, 0.0, -1.0]


def test_no_trainable_token_means_all_prompt() -> None:
    s = build_sample(tl(U, ctx("assistant", "a", [4])))
    assert s.prompt_length == s.num_tokens == 4
    assert s.response_ids == [] and s.num_trainable_tokens == 0


def _reference(t: Timeline) -> tuple[list[int], list[int], list[float]]:
    ids, mask, lps = [], [], []
    for m in t.messages:
        for p, token in enumerate(m.token_ids):
            trained = m.author == "llm" and (m.sampled is None or m.sampled[p] == 1)
            ids.append(token)
            mask.append(1 if trained else 0)
            lps.append(m.logprobs[p] if trained and m.logprobs is not None else 0.0)
    return ids, mask, lps


def test_matches_plain_loop_on_random_timelines() -> None:
    rng = random.Random(7)
    for _ in range(200):
        for t in merge_timelines(random_episode(rng, rng.randint(1, 8))):
            s = build_sample(t)
            assert (s.token_ids, s.loss_mask, s.logprobs) == _reference(t)
            assert s.prompt_length == next((i for i, v in enumerate(s.loss_mask) if v),
                                           len(s.loss_mask))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeline": "x"}, TypeError, "timeline must be a Timeline"),
        ({"timeline_index": -1}, ValueError, "timeline_index"),
        ({"drifted_messages": 1.5}, ValueError, "drifted_messages"),
        ({"reward": float("nan")}, ValueError, "reward"),
        ({"reward": "1"}, ValueError, "reward"),
    ],
)
def test_bad_input_is_named(kwargs: dict, error: type, match: str) -> None:
    args = {"timeline": tl(U, A2), **kwargs}
    timeline = args.pop("timeline")
    with pytest.raises(error, match=match):
        build_sample(timeline, **args)
    if "timeline" in kwargs:
        with pytest.raises(TypeError, match="timeline must be a Timeline"):
            rollout_logprobs(timeline)
