"""The web page's per-call view and its search, served as HTML: each LLM call's latency,
tokens and state with failed calls flagged, and episodes found by episode id, task id or
error, in a run of their own (project ``calls``) and in the seeded store."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.keys import KeyStore
from store import migrate
from store.db import Database
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import (
    EpisodeFinished,
    EpisodeStarted,
    LLMCalled,
    RewardAssigned,
    RunCreated,
    ToolReturned,
)
from store.settings import Settings
from tests.analytics.conftest import Seeded
from tests.analytics.test_ui_pages import cells
from tests.conftest import PostgresServer
from workers.replay.jobs.project import project_episode

QUESTION = [{"role": "user", "content": "Find the flight to Oslo."}]
RATE_LIMITED = {"type": "RateLimitError", "message": "429 Too Many Requests"}


@pytest.fixture(scope="module")
def calls(pg_server: PostgresServer, seeded: Seeded,
          tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[TestClient, dict[str, str]]]:
    """The app over a database of its own (the seeded one is shared with tests that count
    every run's failures) holding a run of project ``calls`` with one episode: a call that
    answers with a tool call (120 ms, 31 tokens in, 12 out, as the client reported), the
    tool failing, and a call whose request failed (rate limited). A second app over the
    seeded store, for searching its run (read only)."""
    url = pg_server.create_database()
    migrate.upgrade(url)
    settings = Settings(database_url=url, data_dir=Path(tmp_path_factory.mktemp("ui-calls")),
                        api_key_scrypt_n=1024)
    store = EventStore(Database(url, max_size=4), settings)
    run, episode = f"calls-{uuid.uuid4().hex[:6]}", f"booking-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run), [RunCreated(run_id=run, project="calls")], NO_STREAM)
    tool_call = {"id": "tc1", "type": "function",
                 "function": {"name": "flights", "arguments": '{"to": "OSL"}'}}
    store.append(episode, [
        EpisodeStarted(run_id=run, group_id="g-oslo", task_id="travel-oslo-7",
                       messages=QUESTION),
        LLMCalled(call_id="c1", messages=QUESTION, prompt_ids=[], response_ids=[],
                  logprobs=[], response={"role": "assistant", "content": "",
                                         "tool_calls": [tool_call]},
                  finish_reason="tool_calls", latency_ms=120.0,
                  usage={"prompt_tokens": 31, "completion_tokens": 12}),
        ToolReturned(tool_call_id="tc1", name="flights", arguments={"to": "OSL"},
                     output="ConnectionError: airline API unreachable", is_error=True,
                     error_type="ConnectionError", error_message="airline API unreachable"),
        LLMCalled(call_id="c2", messages=QUESTION, prompt_ids=[], response_ids=[],
                  logprobs=[], response={"role": "assistant", "content": "",
                                         "error": RATE_LIMITED},
                  finish_reason="error", latency_ms=50.0),
        RewardAssigned(value=0.0),
        EpisodeFinished(status="error", reason="the model was rate limited"),
    ], NO_STREAM)
    assert project_episode(store, episode).outcome == "written"
    keys = KeyStore(store.db, settings)
    other = KeyStore(seeded.db, settings)
    tokens = {"calls": keys.create(project="calls", role="read").token,
              "default": keys.create(project="default", role="read").token,
              "seeded": other.create(project="default", role="read").token,
              "episode": episode, "run": run}
    keys.close()
    other.close()
    with TestClient(create_app(settings, store=store)) as client, \
            TestClient(create_app(settings.model_copy(update={"database_url": seeded.url}),
                                  store=seeded.store)) as on_seeded:
        client.app.state.on_seeded = on_seeded
        yield client, tokens
    store.close()
    pg_server.drop_database(url)


def _get(calls: tuple[TestClient, dict[str, str]], path: str, key: str = "calls",
         **params: str) -> Any:
    client, tokens = calls
    if key == "seeded":
        client = client.app.state.on_seeded
    return client.get(path, params=params,
                      headers={"Authorization": f"Bearer {tokens[key]}"})


def test_each_call_with_latency_tokens_and_state(calls: tuple[TestClient, dict[str, str]]
                                                 ) -> None:
    episode = calls[1]["episode"]
    r = _get(calls, f"/ui/episodes/{episode}")
    assert r.status_code == 200, r.text
    rows = cells(r.text, "call-rows")
    assert [row[1:8] for row in rows] == [
        ["main", "c1", "0", "120", "31", "12", "tool_calls"],
        ["main", "c2", "0", "50", "", "", "error"]]
    assert rows[0][8] == ""
    assert rows[1][8] == "failed RateLimitError: 429 Too Many Requests"
    assert re.search(r'<tr class="call-failed error">', r.text)
    # The event log flags the failed call too, beside the tool's error.
    events = re.findall(r'<tr class="(\w*)"><td class="n">(\d+)</td><td>(\w+)</td>', r.text)
    flags = {(int(version), kind): flag for flag, version, kind in events}
    assert flags[(4, "llm_called")] == "error" and flags[(3, "tool_returned")] == "error"
    assert flags[(2, "llm_called")] == ""
    assert "120 ms" in html.unescape(r.text) and "failed: RateLimitError" in r.text


@pytest.mark.parametrize(("query", "matched"), [
    ("travel-oslo", "task"),
    ("BOOKING-", "episode"),
    ("ratelimit", "failed LLM call"),
    ("airline API", "tool error"),
    ("was rate limited", "finished error"),
])
def test_search_finds_by_task_episode_or_error(calls: tuple[TestClient, dict[str, str]],
                                               query: str, matched: str) -> None:
    r = _get(calls, "/ui/search", q=query)
    assert r.status_code == 200, r.text
    rows = cells(r.text, "matches")
    assert [(row[0], row[5]) for row in rows] == [(calls[1]["episode"], matched)], rows
    # Another project's key finds none of it.
    other = _get(calls, "/ui/search", key="default", q=query)
    assert calls[1]["episode"] not in other.text


def test_search_in_the_seeded_run_and_bad_queries(calls: tuple[TestClient, dict[str, str]],
                                                  seeded: Seeded) -> None:
    r = _get(calls, "/ui/search", key="seeded", q="unexpected argument")
    found = {row[0]: row for row in cells(r.text, "matches")}
    assert set(found) == {seeded.ids[name] for name in ("e1", "e2", "e5", "e8")}
    assert {row[5] for row in found.values()} == {"tool error"}
    # The refused episode is found by the reason replay gave.
    r = _get(calls, "/ui/search", key="seeded", q="not a rendering")
    assert [row[0] for row in cells(r.text, "matches")] == [seeded.ids["e8"]]
    # % and _ are plain characters, not wildcards.
    assert 'id="no-match"' in _get(calls, "/ui/search", key="seeded", q="%").text
    assert "Type part of" in _get(calls, "/ui/search", q="  ").text
    assert "at most 200" in _get(calls, "/ui/search", q="x" * 201).text
