"""The table of docs/training.md ("What is trained"), one test per event pattern, on episodes
recorded with Qwen3's tokenizer: which calls become positive and negative samples, and which
tokens carry mask 1 in each."""

from __future__ import annotations

import pytest
from replay_episodes import SEARCH_TOOL, Script, tool_call

from store.events import EpisodeFinished, LLMCalled, RewardAssigned, RunConfig
from workers.replay import Sample, discarded_calls, replay_episode

QUESTION = {"role": "user", "content": "Who wrote Dune?"}
BAD = {"role": "assistant", "content": "", "reasoning_content": "Search.",
       "tool_calls": [tool_call("search", {"q": "Dune"}, "c1")]}
GOOD = {"role": "assistant", "content": "", "reasoning_content": "Search properly.",
        "tool_calls": [tool_call("search", {"query": "Dune"}, "c2")]}
RESULT = {"role": "tool", "tool_call_id": "c2", "content": "Frank Herbert"}
ANSWER = {"role": "assistant", "content": "Frank Herbert."}


def failing_search(s: Script) -> tuple[LLMCalled, str]:
    """The failed call ``bad``, its checkpoint, the tool's error and its failed attempt."""
    failed = s.call([QUESTION], BAD, call_id="bad")
    checkpoint = s.checkpoint("turn_1")
    s.tool("search", "TypeError: unexpected argument 'q'", error_type="TypeError")
    s.failed(checkpoint, "turn_1", retry_index=0, failed_call_id="bad",
             errors=["unexpected argument 'q'"], error_types=["TypeError"])
    return failed, checkpoint


def trained(sample: Sample) -> list[int]:
    """The token ids under the loss mask."""
    return [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]


def own(call: LLMCalled) -> tuple[list[int], list[int]]:
    """A call's sample exactly as the engine saw it: (tokens, mask)."""
    prompt, response = call.prompt_ids.tolist(), call.response_ids.tolist()
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def test_clean_calls_merge_and_every_generated_token_is_trained_once(qwen3) -> None:
    s = Script(qwen3, tools=[SEARCH_TOOL])
    first = s.call([QUESTION], GOOD)
    last = s.call([QUESTION, GOOD, RESULT], ANSWER)
    result = replay_episode(s.finish(1.0), config=RunConfig(), tokenizer=qwen3)
    (sample,) = result.samples
    assert result.absorber == [1, None] and sample.reward == 1.0
    assert sample.token_ids == own(last)[0]
    assert trained(sample) == [*first.response_ids, *last.response_ids]
    assert sample.num_trainable_tokens == len(first.response_ids) + len(last.response_ids)


def test_a_retry_regenerated_from_the_checkpoint(qwen3) -> None:
    """The failed call is its own timeline: no positive sample, only its negative one."""
    s = Script(qwen3, tools=[SEARCH_TOOL])
    failed, checkpoint = failing_search(s)
    s.rolled_back(checkpoint, ["bad"])
    retry = s.call([QUESTION], GOOD, call_id="retry")
    last = s.call([QUESTION, GOOD, RESULT], ANSWER, call_id="answer")
    result = replay_episode(s.finish(1.0), config=RunConfig(), tokenizer=qwen3)
    assert result.discarded_indices == [0] and result.survivor_indices == [2]
    assert result.absorber == [None, 2, None]
    (sample,) = result.samples
    assert trained(sample) == [*retry.response_ids, *last.response_ids]
    (negative,) = result.negatives
    assert (negative.sample.token_ids, negative.sample.loss_mask) == own(failed)
    assert negative.sample.reward == -1.0


def test_a_retry_with_the_failed_turn_and_feedback_in_context(qwen3) -> None:
    """As the agent loop records it: the failed call is a prefix of the retry's timeline and
    is context there; the retry is trained in the context it was generated in."""
    s = Script(qwen3, tools=[SEARCH_TOOL])
    failed, checkpoint = failing_search(s)
    feedback = {"role": "user", "content": "The tool call failed. Fix it."}
    retry = s.call([QUESTION, BAD, feedback], GOOD, call_id="retry")
    s.rolled_back(checkpoint, ["bad"])
    last = s.call([QUESTION, GOOD, RESULT], ANSWER, call_id="answer")
    result = replay_episode(s.finish(1.0), config=RunConfig(), tokenizer=qwen3)
    retry_sample, last_sample = result.samples
    assert (retry_sample.token_ids, retry_sample.loss_mask) == own(retry)
    assert (last_sample.token_ids, last_sample.loss_mask) == own(last)
    assert result.discarded_context == {1: [1]}
    # Nowhere is a token of the failed generation trained in a positive sample.
    for sample in result.samples:
        assert sample.reward == 1.0 and set(trained(sample)).isdisjoint(
            set(failed.response_ids.tolist()) - set(retry.response_ids.tolist())
            - set(last.response_ids.tolist()))
    assert [n.call_id for n in result.negatives] == ["bad"]


def test_a_timeline_made_only_of_discarded_calls_is_no_positive_sample(qwen3) -> None:
    """Two failed attempts in a row (each rolled back as the next is made), then a fix."""
    s = Script(qwen3, tools=[SEARCH_TOOL])
    feedback = {"role": "user", "content": "The tool call failed. Fix it."}
    s.call([QUESTION], BAD, call_id="bad-1")
    checkpoint = s.checkpoint("turn_1")
    s.call([QUESTION, BAD, feedback], BAD, call_id="bad-2")
    s.rolled_back(checkpoint, ["bad-1"])
    fix = s.call([QUESTION, BAD, feedback], GOOD, call_id="fix")
    s.rolled_back(checkpoint, ["bad-2"])
    result = replay_episode(s.finish(0.5), config=RunConfig(), tokenizer=qwen3)
    assert discarded_calls(s.events) == ["bad-1", "bad-2"]
    assert result.survivor_indices == [2]
    (sample,) = result.samples
    assert (sample.token_ids, sample.loss_mask) == own(fix)


def test_a_kept_call_that_only_a_discarded_call_extends_keeps_its_sample(qwen3) -> None:
    """A discarded timeline absorbs nothing: the kept call before it is not lost."""
    s = Script(qwen3, tools=[SEARCH_TOOL])
    first = s.call([QUESTION], GOOD, call_id="search")
    s.call([QUESTION, GOOD, RESULT], {"role": "assistant", "content": "Asimov."},
           call_id="wrong")
    s.failed("abandoned:wrong", "turn_1", retry_index=0, failed_call_id="wrong",
             errors=["the client abandoned this attempt"], error_types=["Abandoned"])
    result = replay_episode(s.finish(0.0), config=RunConfig(), tokenizer=qwen3)
    assert result.survivor_indices == [0]
    (sample,) = result.samples
    assert (sample.token_ids, sample.loss_mask) == own(first)
    assert [n.call_id for n in result.negatives] == ["wrong"]


def test_an_abandoned_call_recorded_from_an_error_span_is_never_positive(qwen3) -> None:
    """The OpenTelemetry door records a call whose span ended in error with the error in its
    response: the client did not take the answer. It gives no negative sample (no attempt
    is recorded as failed)."""
    s = Script(qwen3)
    question = {"role": "user", "content": "Name a prime number."}
    errored = s.call([question], {"role": "assistant", "content": "Nine.",
                                  "error": {"type": "ValidationError", "message": "bad"}},
                     call_id="span-1", finish_reason="error")
    kept = s.call([question], {"role": "assistant", "content": "Seven."}, call_id="span-2")
    result = replay_episode(s.finish(1.0), config=RunConfig(), tokenizer=qwen3)
    assert discarded_calls(s.events) == ["span-1"] and errored.response["error"]
    (sample,) = result.samples
    assert (sample.token_ids, sample.loss_mask) == own(kept)
    assert result.failures == []


def test_a_forked_timeline_trains_each_branch_and_the_shared_history_once(qwen3) -> None:
    s = Script(qwen3, tools=[SEARCH_TOOL])
    first = s.call([QUESTION], GOOD)
    one = s.call([QUESTION, GOOD, RESULT], ANSWER)
    other_result = {"role": "tool", "tool_call_id": "c2", "content": "F. Herbert"}
    two = s.call([QUESTION, GOOD, other_result], {"role": "assistant", "content": "Herbert."})
    result = replay_episode(s.finish(1.0), config=RunConfig(), tokenizer=qwen3)
    assert result.absorber == [2, None, None] and len(result.forks) == 1
    branch_one, branch_two = result.samples
    assert trained(branch_one) == list(one.response_ids)
    assert trained(branch_two) == [*first.response_ids, *two.response_ids]


def test_a_truncated_output_trains_what_was_sampled_and_no_end_token(qwen3) -> None:
    s = Script(qwen3)
    question = {"role": "user", "content": "Write a long story."}
    cut = {"role": "assistant", "content": "Once upon a time"}
    ids = s.encode("<think>\n\n</think>\n\nOnce upon a time")
    s.call([question], cut, response_ids=ids, finish_reason="length")
    go_on = s.call([question, cut, {"role": "user", "content": "Go on."}],
                   {"role": "assistant", "content": "there was a file."})
    result = replay_episode(s.finish(0.0, status="truncated"), config=RunConfig(),
                            tokenizer=qwen3)
    (sample,) = result.samples
    assert trained(sample) == [*ids, *go_on.response_ids]
    # The cut-off message is what the model sampled, without the end-of-turn token the next
    # prompt's rendering put after it (the model never sampled one): only the last answer's
    # end token is trained.
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    survivor = result.survivors[0]
    assert survivor.messages[1].truncated and survivor.messages[1].token_ids[-len(ids):] == ids
    assert [m for t, m in zip(sample.token_ids, sample.loss_mask, strict=True)
            if t == end].count(1) == 1
    assert sample.reward == 0.0


@pytest.mark.parametrize("rewards, expected", [([], None), ([1.0], 1.0), ([1.0, 0.25], 0.25)])
def test_the_latest_reward_is_the_episodes_late_ones_included(qwen3, rewards: list[float],
                                                             expected: float | None) -> None:
    s = Script(qwen3)
    s.call([QUESTION], ANSWER)
    events = [*s.events, EpisodeFinished(status="completed"),
              *(RewardAssigned(value=v) for v in rewards)]
    result = replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert result.reward == expected and result.samples[0].reward == expected
