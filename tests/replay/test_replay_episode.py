"""The replay entry point on whole episodes recorded with Qwen3's tokenizer: rollback with a
negative sample, retokenization drift, agents, the negative cap, and streams that cannot be
replayed (truncation: test_sample_semantics)."""

from __future__ import annotations

import pytest
from replay_episodes import SEARCH_TOOL, Script, tool_call

from store.events import (
    EpisodeFinished,
    EpisodeStarted,
    LLMCalled,
    MergeConfig,
    NegativeConfig,
    RewardAssigned,
    RollbackConfig,
    RunConfig,
    ToolReturned,
)
from workers.replay import ForkPoint, ReplayError, needs_tokenizer, replay_episode
from workers.replay.errors import PromptMismatchError

TOOLS = [SEARCH_TOOL]
QUESTION = {"role": "user", "content": "How many files are in the repo?"}
BAD = {"role": "assistant", "content": "", "reasoning_content": "Count them.",
       "tool_calls": [tool_call("search", {"query": "count(files"}, "c1")]}
FIXED = {"role": "assistant", "content": "", "reasoning_content": "Fix the syntax.",
         "tool_calls": [tool_call("search", {"query": "count(files)"}, "c2")]}
FINAL = {"role": "assistant", "content": "There are 42 files.",
         "reasoning_content": "The tool said 42."}


def rollback_episode(qwen3, *, failures: int = 1, group: str = "group-1") -> Script:
    """Ask, call with a syntax error, get error feedback, regenerate, roll back to the
    checkpoint with the fixed call, run it, answer."""
    s = Script(qwen3, tools=TOOLS, group_id=group)
    history = [QUESTION]
    failed = s.call(history, BAD, call_id="call-bad")
    checkpoint = s.checkpoint("turn_1")
    retry_context = [QUESTION, BAD]
    last_failed = failed.call_id
    for retry in range(failures):
        s.tool("search", "SyntaxError: '(' was never closed", error_type="SyntaxError")
        s.failed(checkpoint, "turn_1", retry_index=retry, failed_call_id=last_failed,
                 errors=["SyntaxError: '(' was never closed"], error_types=["SyntaxError"],
                 tool_calls=BAD["tool_calls"])
        retry_context = [*retry_context,
                         {"role": "tool", "tool_call_id": "c1",
                          "content": "SyntaxError: '(' was never closed"},
                         {"role": "user", "content": "The tool call failed. Fix it."}]
        answer = FIXED if retry == failures - 1 else BAD
        last_failed = s.call(retry_context, answer, call_id=f"call-retry-{retry}").call_id
        retry_context = [*retry_context, answer]
    s.rolled_back(checkpoint, [failed.call_id])
    s.tool("search", "42")
    history = [QUESTION, FIXED, {"role": "tool", "tool_call_id": "c2", "content": "42"}]
    s.call(history, FINAL, call_id="call-final")
    s.finish(1.0)
    return s


def test_rollback_episode(qwen3) -> None:
    events = rollback_episode(qwen3).events
    result = replay_episode(events, config=RunConfig(), tokenizer=qwen3, episode_id="ep-1")
    assert result.call_ids == ["call-bad", "call-retry-0", "call-final"]
    # The rolled-back call takes no part in merging: nothing absorbs it, it survives nowhere.
    assert result.discarded_indices == [0]
    assert result.absorber == [None, None, None]
    assert result.survivor_indices == [1, 2]
    assert (result.group_id, result.status, result.reward) == ("group-1", "completed", 1.0)
    assert result.forks == [ForkPoint("main", 2, 1, 1, "tool_calls")]
    calls = {e.call_id: e for e in events if e.type == "llm_called"}
    final = calls["call-final"]
    retry_sample, final_sample = result.samples
    assert final_sample.token_ids == [*final.prompt_ids, *final.response_ids]
    assert final_sample.reward == retry_sample.reward == 1.0
    # The retry is not a prefix of the final timeline (its error feedback was rolled back),
    # so the fixed call stays context there and is trained in the retry's sample.
    fixed = calls["call-retry-0"]
    trained = [t for t, m in zip(final_sample.token_ids, final_sample.loss_mask, strict=True)
               if m]
    assert trained == list(final.response_ids)
    # The retry's sample is its own call as the engine saw it: the failed call and the error
    # feedback are context (mask 0, logprob 0), only the fix is trained.
    assert retry_sample.token_ids == [*fixed.prompt_ids, *fixed.response_ids]
    context, generated = len(fixed.prompt_ids), len(fixed.response_ids)
    assert retry_sample.loss_mask == [0] * context + [1] * generated
    assert retry_sample.logprobs[:context] == [0.0] * context
    assert retry_sample.logprobs[context:] == pytest.approx(list(fixed.logprobs))
    assert result.discarded_context == {1: [1]}  # the failed call, shown as context
    assert result.survivors[0].messages[1].author != "llm"
    bad = calls["call-bad"]
    (negative,) = result.negatives
    assert negative.call_id == "call-bad"
    assert negative.sample.token_ids == [*bad.prompt_ids, *bad.response_ids]
    assert negative.sample.response_ids == list(bad.response_ids)
    assert negative.sample.reward == -1.0
    assert negative.sample.response_logprobs == pytest.approx(list(bad.logprobs))
    assert (negative.position_key, negative.retry_index, negative.error_types) == \
        ("turn_1", 0, ["SyntaxError"])
    assert (negative.assistant_turns, negative.user_turns) == (1, 0)
    assert negative.group_id == "group-1" and negative.episode_id == "ep-1"
    # Qwen3 drops the reasoning of assistant turns before the last user message, so in the
    # retry's prompt the failed call renders without its <think> block: the context is what
    # the engine saw, not the failed call's sampled ids, and nothing was absorbed or drifted.
    assert result.drifted_messages == 0


def test_negative_cap_and_switch(qwen3) -> None:
    events = rollback_episode(qwen3, failures=3).events
    result = replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert [n.call_id for n in result.failures] == ["call-bad", "call-retry-0", "call-retry-1"]
    assert [n.call_id for n in result.negatives] == ["call-bad"]
    two = RunConfig(negatives=NegativeConfig(max_negative_samples_per_group=2,
                                             negative_reward=-0.5))
    result = replay_episode(events, config=two, tokenizer=qwen3)
    assert [n.call_id for n in result.negatives] == ["call-bad", "call-retry-0"]
    assert [n.sample.reward for n in result.negatives] == [-0.5, -0.5]
    assert [(n.assistant_turns, n.user_turns) for n in result.failures] == \
        [(1, 0), (2, 1), (3, 2)]
    off = RunConfig(rollback=RollbackConfig(save_negative_samples=False))
    assert replay_episode(events, config=off, tokenizer=qwen3).negatives == []


def test_an_abandoned_branch_is_a_negative_sample_never_a_positive_one(qwen3) -> None:
    """A client-side retry (same prefix, another continuation) whose first answer the client
    abandoned (attempt_failed of type Abandoned, rolled_back discarding it): the call
    survives merging (nothing absorbs it) but is no positive sample; its attempt_failed
    makes it the negative one."""
    s = Script(qwen3)
    question = {"role": "user", "content": "Name a prime number."}
    first = s.call([question], {"role": "assistant", "content": "Nine."}, call_id="a")
    s.failed("abandoned:a", "turn_0", retry_index=0, failed_call_id=first.call_id,
             errors=["the client abandoned this attempt"], error_types=["Abandoned"])
    s.rolled_back("abandoned:a", [first.call_id])
    s.call([question], {"role": "assistant", "content": "Seven."}, call_id="b")
    events = s.finish(1.0)
    result = replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert result.absorber == [None, None] and result.discarded_indices == [0]
    assert result.survivor_indices == [1]  # only the retry is a sample
    assert [len(result.samples), result.samples[0].reward] == [1, 1.0]
    (negative,) = result.negatives
    assert (negative.call_id, negative.sample.reward, negative.error_types) == (
        "a", -1.0, ["Abandoned"])
    off = RunConfig(rollback=RollbackConfig(save_negative_samples=False))
    excluded = replay_episode(events, config=off, tokenizer=qwen3)
    assert excluded.negatives == [] and excluded.survivor_indices == [1]
    # Either record of the abandonment is enough (a REST client may send one of them); the
    # agent loop's rollback of a failed tool (no Abandoned type) discards just the same.
    for kept_type in ("rolled_back", "attempt_failed"):
        alone = replay_episode([e for e in events if e.type != kept_type],
                               config=RunConfig(), tokenizer=qwen3)
        assert alone.survivor_indices == [1], kept_type
    loop_style = [e.model_copy(update={"error_types": ["SyntaxError"]})
                  if e.type == "attempt_failed" else e for e in events]
    assert replay_episode(loop_style, config=RunConfig(),
                          tokenizer=qwen3).survivor_indices == [1]
    # With neither, the first answer is an ordinary call: two positive samples.
    neither = [e for e in events if e.type not in ("rolled_back", "attempt_failed")]
    assert replay_episode(neither, config=RunConfig(),
                          tokenizer=qwen3).survivor_indices == [0, 1]


def test_retokenization_drift_is_repaired_at_text_level(qwen3) -> None:
    s = Script(qwen3)
    question = {"role": "user", "content": "Say hello."}
    answer = {"role": "assistant", "content": "hello world", "reasoning_content": "Easy."}
    canonical = s.encode(s.generated_text([question], answer))
    # The engine sampled the same text as other tokens: one token per character.
    sampled = [i for ch in qwen3.decode(canonical[:-1]) for i in s.encode(ch)] + canonical[-1:]
    assert sampled != canonical and qwen3.decode(sampled) == qwen3.decode(canonical)
    s.call([question], answer, response_ids=sampled)
    follow = {"role": "user", "content": "Again."}
    s.call([question, answer, follow], {"role": "assistant", "content": "hello again"})
    events = s.finish(0.5)
    text = replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert text.absorber == [1, None] and text.drifted_messages == 1
    (sample,) = text.samples
    assert sample.num_drifted_messages == 1
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert trained[:len(sampled)] == sampled  # the engine's ids, not the re-encoding
    token = replay_episode(events, config=RunConfig(merge=MergeConfig(compare_level="token")),
                           tokenizer=qwen3)
    assert token.absorber == [None, None] and token.drifted_messages == 0
    assert token.forks == [ForkPoint("main", 1, 0, 1, "token_drift")]


def test_agents_never_merge(qwen3) -> None:
    s = Script(qwen3)
    question = {"role": "user", "content": "Plan it."}
    answer = {"role": "assistant", "content": "Plan: step one."}
    s.call([question], answer, agent="planner")
    s.call([question], answer, agent="critic")
    s.call([question, answer, {"role": "user", "content": "And then?"}],
           {"role": "assistant", "content": "Step two."}, agent="critic")
    result = replay_episode(s.finish(1.0), config=RunConfig(), tokenizer=qwen3)
    assert result.absorber == [None, 2, None]
    assert [x.agent for x in result.samples] == ["planner", "critic"]


def test_failed_call_defaults_to_the_agents_latest_call(qwen3) -> None:
    s = Script(qwen3, tools=TOOLS)
    s.call([QUESTION], BAD, call_id="only")
    cp = s.checkpoint("turn_1")
    s.failed(cp, "turn_1", retry_index=0, failed_call_id=None, errors=["x"],
             error_types=["NameError"])
    result = replay_episode(s.finish(0.0, status="terminated"), config=RunConfig(),
                            tokenizer=qwen3)
    assert [n.call_id for n in result.negatives] == ["only"]
    assert result.negatives[0].tool_calls == BAD["tool_calls"]


def _broken_streams(qwen3):
    s = Script(qwen3)
    s.call([QUESTION], FINAL, call_id="a")
    base = s.events
    dup = Script(qwen3)
    dup.call([QUESTION], FINAL, call_id="a")
    dup.call([QUESTION], FINAL, call_id="a")
    unknown = Script(qwen3)
    unknown.call([QUESTION], FINAL, call_id="a")
    unknown.failed("cp", "turn_0", retry_index=0, failed_call_id="zzz", errors=[],
                   error_types=[])
    other_agent = Script(qwen3)
    other_agent.call([QUESTION], FINAL, call_id="a", agent="planner")
    other_agent.failed("cp", "turn_0", retry_index=0, failed_call_id="a", errors=[],
                       error_types=[], agent="coder")
    mismatch = Script(qwen3)
    event = mismatch.call([QUESTION], FINAL, call_id="a")
    mismatch.events[-1] = event.model_copy(update={"messages": [{"role": "user",
                                                                 "content": "Other."}]})
    return [
        ([], "must begin with episode_started"),
        (base[1:], "must begin with episode_started"),
        ([*base, EpisodeFinished(status="completed"), ToolReturned(name="search")],
         "comes after episode_finished"),
        ([*base, base[0]], "episode_started appears again"),
        (dup.events, "recorded twice"),
        (unknown.events, "names failed call 'zzz'"),
        (other_agent.events, "made by agent 'planner'"),
        (mismatch.events, "not a rendering of the request messages"),
    ]


def test_streams_that_cannot_be_replayed(qwen3) -> None:
    for events, match in _broken_streams(qwen3):
        with pytest.raises(ReplayError, match=match):
            replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    events = _broken_streams(qwen3)[-1][0]
    with pytest.raises(PromptMismatchError) as info:
        replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert info.value.call_id == "a"


def test_bad_arguments(qwen3) -> None:
    events = Script(qwen3).finish(1.0)
    with pytest.raises(TypeError, match="config must be a store.events.RunConfig"):
        replay_episode(events, config={}, tokenizer=qwen3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"events\[1\] must be a store.events.Event"):
        replay_episode([events[0], "x"], config=RunConfig(), tokenizer=qwen3)
    with pytest.raises(TypeError, match="events must be a list"):
        replay_episode("abc", config=RunConfig(), tokenizer=qwen3)  # type: ignore[arg-type]
    result = replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert result.timelines == [] and result.samples == [] and result.reward == 1.0


def _untokenized_call(call_id: str, content: str) -> LLMCalled:
    """An LLM call as OTLP spans record it: messages and answer, no token ids."""
    return LLMCalled(call_id=call_id, messages=[QUESTION], prompt_ids=[], response_ids=[],
                     logprobs=[], response={"role": "assistant", "content": content})


def test_calls_without_token_ids_give_no_samples_and_need_no_tokenizer() -> None:
    events = [EpisodeStarted(run_id="run-1", group_id="g"),
              _untokenized_call("span-1", "Let me search."),
              ToolReturned(name="search", output="boom", is_error=True, error_type="Timeout"),
              _untokenized_call("span-2", "There are 42 files."),
              RewardAssigned(value=1.0), EpisodeFinished(status="completed")]
    assert not needs_tokenizer(events)
    result = replay_episode(events, config=RunConfig(), tokenizer=None)
    assert result.samples == [] and result.timelines == [] and result.call_ids == []
    assert result.untokenized_calls == ["span-1", "span-2"]
    assert result.reward == 1.0 and result.status == "completed"
    assert "captured from OTLP spans without token ids" in (result.untokenized_reason or "")


def test_calls_without_token_ids_beside_tokenized_ones_are_skipped(qwen3) -> None:
    s = rollback_episode(qwen3)
    plain = replay_episode(s.events, config=RunConfig(), tokenizer=qwen3)
    events = [*s.events[:1], _untokenized_call("span-x", "thinking aloud"), *s.events[1:]]
    assert needs_tokenizer(events)
    result = replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert result.untokenized_calls == ["span-x"]
    assert result.call_ids == plain.call_ids
    assert [x.token_ids for x in result.samples] == [x.token_ids for x in plain.samples]
    assert result.untokenized_reason is not None
    assert result.untokenized_reason.startswith(f"1 of the {len(plain.call_ids) + 1} LLM calls")
    assert plain.untokenized_reason is None
