"""Prompt delta encoding: exact round trips and storage that grows with unique tokens."""

from __future__ import annotations

import uuid

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import codec
from store.db import Database
from store.eventlog import EventStore
from store.events import LLMCalled
from tests.factories import episode_started, trajectory


@st.composite
def agent_streams(draw: st.DrawFn) -> list[LLMCalled]:
    """Random multi-agent call sequences: prompts that extend an earlier call (fully, or
    after cutting some tokens, as templates that strip reasoning do) or start afresh."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 12))
    calls: list[LLMCalled] = []
    history: list[np.ndarray] = []
    for i in range(n):
        mode = draw(st.sampled_from(["extend", "cut", "fresh", "same"]))
        vocab = draw(st.sampled_from([3, 50, 2**31 - 1]))
        if history and mode != "fresh":
            base = history[draw(st.integers(0, len(history) - 1))]
            keep = len(base) if mode in ("extend", "same") else draw(st.integers(0, len(base)))
            tail = 0 if mode == "same" else draw(st.integers(0, 40))
            prompt = np.concatenate([base[:keep], rng.integers(0, vocab, tail)])
        else:
            prompt = rng.integers(0, vocab, draw(st.integers(0, 60)))
        response = rng.integers(0, vocab, draw(st.integers(0, 30)))
        messages = [{"role": "user", "content": f"m{j}"} for j in range(draw(st.integers(0, 3)))]
        calls.append(
            LLMCalled(
                event_id=uuid.uuid4(),
                agent=draw(st.sampled_from(["a", "b"])),
                call_id=f"c{i}",
                messages=messages,
                prompt_ids=prompt,
                response_ids=response,
                logprobs=-rng.random(len(response)),
                response={"role": "assistant", "content": f"r{i}"} if i % 2 else {},
            )
        )
        history.append(np.concatenate([prompt, response]))
    return calls


def _same(a: LLMCalled, b: LLMCalled) -> bool:
    return (
        a.prompt_ids.tolist() == b.prompt_ids.tolist()
        and a.response_ids.tolist() == b.response_ids.tolist()
        and a.logprobs.tobytes() == b.logprobs.tobytes()
        and a.messages == b.messages
        and a.response == b.response
    )


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=agent_streams(), split=st.integers(1, 4))
def test_delta_round_trips(
    store: EventStore, pg_url: str, calls: list[LLMCalled], split: int
) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    store.append(stream, [episode_started()])
    for i in range(0, len(calls), split):
        store.append(stream, calls[i : i + split])
    back = [r.event for r in store.read_stream(stream)][1:]
    assert all(_same(a, b) for a, b in zip(back, calls, strict=True))
    # A second store with a cold cache decodes (and extends) the same stream from the log.
    cold = EventStore(Database(pg_url, max_size=1), store.settings)
    try:
        more = trajectory(1, seed=len(calls))[0]
        more = more.model_copy(update={"prompt_ids": np.concatenate(
            [calls[-1].prompt_ids, calls[-1].response_ids, more.prompt_ids[:5]])})
        cold.append(stream, [more])
        back = [r.event for r in cold.read_stream(stream)][1:]
        assert all(_same(a, b) for a, b in zip(back, [*calls, more], strict=True))
        # Reading a suffix of the stream still expands deltas whose base lies before it.
        tail = cold.read_stream(stream, from_version=len(calls) + 2)
        assert len(tail) == 1 and _same(tail[0].event, more)
    finally:
        cold.close()


def test_thirty_turns_store_only_their_unique_tokens(store: EventStore) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    calls = trajectory(30, first_prompt=2000, response=1000, tool_output=200)
    store.append(stream, [episode_started()])
    for c in calls:
        store.append(stream, [c])
    with store.db.connection() as conn:
        stored_prompt, full_prompt = conn.execute(
            "SELECT sum(length(prompt_ids)), sum(prompt_len) * 4 FROM events"
            " WHERE stream_id = %s",
            (stream,),
        ).fetchone()
    unique_prompt_tokens = 2000 + 29 * 200  # first prompt, then one tool output per turn
    assert stored_prompt == unique_prompt_tokens * 4
    assert full_prompt > 10 * stored_prompt  # what storing every prompt in full would cost


def test_codec_rejects_truncated_payloads() -> None:
    import pytest

    assert codec.unpack_ids(codec.pack_ids(np.array([1, 2**31 - 1]))).tolist() == [1, 2**31 - 1]
    with pytest.raises(ValueError, match="whole number of int32"):
        codec.unpack_ids(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="whole number of float32"):
        codec.unpack_logprobs(b"\x01")
    with pytest.raises(ValueError, match="prefix tokens"):
        codec.expand_prompt(np.arange(3), 5, np.arange(2))


def test_little_endian_on_disk() -> None:
    assert codec.pack_ids(np.array([1], dtype=np.int32)) == b"\x01\x00\x00\x00"
    assert codec.pack_logprobs(np.array([-1.0], dtype=np.float32)) == b"\x00\x00\x80\xbf"
