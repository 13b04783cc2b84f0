"""Token streaming from the in-process engine (the tiny model) in a real ``trajstore serve``:
the ``openai`` client receives the answer in many chunks while it is sampled, and the
recorded ``llm_called`` is the one the same call records unstreamed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI

from api.gateway.streaming import LiveText
from store.eventlog import EventStore
from store.events import LLMCalled
from store.settings import Settings
from tests.api.conftest import Project, Server
from trajstore.client import TrajstoreClient
from workers.engines.prompt import decode_response

pytestmark = [pytest.mark.timeout(600)]

MESSAGES = [{"role": "user", "content": "Tell me a long story about numbers."}]


@pytest.fixture(scope="module")
def module_settings(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("gateway-stream"),
                    api_key_scrypt_n=1024)


@pytest.fixture(scope="module")
def server(module_settings: Settings, tiny_model_dir: Path) -> Iterator[Server]:
    s = Server(module_settings, module_settings.data_dir / "engine.log",
               TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tiny_model_dir),
               TRAJSTORE_GATEWAY_MAX_TOKENS="64")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def last_call(store: EventStore, episode: str) -> LLMCalled:
    return [r.event for r in store.read_stream(episode) if isinstance(r.event, LLMCalled)][-1]


def same_call(a: LLMCalled, b: LLMCalled) -> None:
    assert a.prompt_ids.tolist() == b.prompt_ids.tolist()
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert np.array_equal(a.logprobs, b.logprobs)
    assert (a.response, a.finish_reason, a.messages, a.tools, a.usage) == (
        b.response, b.finish_reason, b.messages, b.tools, b.usage)


@pytest.mark.parametrize("seed", [3, 4])
def test_chat_streams_token_by_token_and_records_the_same_call(
        server: Server, project: Project, api_store: EventStore, seed: int) -> None:
    ts = TrajstoreClient(server.url, project.ingest)
    episode = ts.episode(f"stream-{uuid.uuid4().hex[:8]}")
    llm = OpenAI(**episode.openai_kwargs)
    plain = llm.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48,
                                        seed=seed, temperature=1.0)
    unstreamed = last_call(api_store, episode.episode_id)
    chunks = list(llm.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=48, seed=seed, temperature=1.0,
        stream=True, logprobs=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}))
    streamed = last_call(api_store, episode.episode_id)
    same_call(streamed, unstreamed)
    pieces = [c.choices[0].delta.content for c in chunks
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1, pieces  # sent while sampled, not as one chunk
    assert "".join(pieces) == plain.choices[0].message.content == streamed.response["content"]
    ids = [i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get(
        "token_ids") or []]
    assert ids == streamed.response_ids.tolist()
    lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert np.allclose(lps, streamed.logprobs)
    assert chunks[-1].usage.completion_tokens == len(streamed.response_ids)
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason


def test_completion_streams_and_records_the_same_call(
        server: Server, project: Project, api_store: EventStore) -> None:
    ts = TrajstoreClient(server.url, project.ingest)
    episode = ts.episode(f"stream-{uuid.uuid4().hex[:8]}")
    llm = OpenAI(**episode.openai_kwargs)
    plain = llm.completions.create(model="tiny", prompt="Once upon a time", max_tokens=32,
                                   seed=9)
    unstreamed = last_call(api_store, episode.episode_id)
    chunks = list(llm.completions.create(model="tiny", prompt="Once upon a time",
                                         max_tokens=32, seed=9, stream=True))
    same_call(last_call(api_store, episode.episode_id), unstreamed)
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) > 1 and "".join(texts) == plain.choices[0].text


def test_live_text_adds_up_to_the_final_answer(tiny_model_dir: Path) -> None:
    """What is sent live is always the start of the final answer; markers, stop strings and
    surrounding whitespace are held back."""
    from api.gateway.openai_format import assistant_message
    from workers.engines.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))

    def run(text: str, *, chat: bool, tools: bool, stop: tuple[str, ...] = ()
            ) -> tuple[list[str], str, LiveText]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        live = LiveText(lambda xs: decode_response(tokenizer, xs, stop=stop)[0], chat=chat,
                        tools=tools, stop=stop)
        pieces = [p for p in (live.feed(i) for i in ids) if p]
        final = decode_response(tokenizer, ids, stop=stop)[0]
        return pieces, final, live

    pieces, final, _ = run("  Four plus four is eight.  ", chat=True, tools=False)
    assert len(pieces) > 1
    assert "".join(pieces) == assistant_message(final, call_id="c", parse_tools=False)[
        "content"]
    pieces, final, live = run('Let me call it. <tool_call>{"name": "f", "arguments": {}}'
                              '</tool_call>', chat=True, tools=True)
    message = assistant_message(final, call_id="c", parse_tools=True)
    assert live.structured and "<" not in "".join(pieces)
    assert message["content"].startswith("".join(pieces))
    pieces, final, live = run("<think>hmm</think>Eight.", chat=True, tools=False)
    assert pieces == [] and live.structured
    pieces, final, _ = run("one two STOP three", chat=False, tools=False, stop=("STOP",))
    assert "".join(pieces) == final == "one two "
    assert not any("S" in p for p in pieces)
