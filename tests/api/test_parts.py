"""Smaller pieces: cursors, the body limit, message normalisation, sampling limits,
completion reports, engine and upstream configuration, readiness."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.cursor import decode_cursor, encode_cursor
from api.errors import ApiError, field_path
from api.gateway.local_engine import engine_model_dir
from api.gateway.messages import normalize_messages, sampling_params
from api.gateway.upstream import Upstream
from api.limits import BodyLimit
from api.routers.rollout import completion_events
from api.schemas.openai import ChatMessage
from api.schemas.remote import RolloutCompleted
from store import migrate, queries
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings


def test_cursor_round_trip_and_refusal() -> None:
    for key in (0, 1, 123456789, 2**62):
        assert decode_cursor(encode_cursor(key)) == key
    assert decode_cursor(None) == 0
    for bad in ("!!!", encode_cursor(5)[:-1] + "~", "aGVsbG8"):
        with pytest.raises(ApiError) as exc:
            decode_cursor(bad)
        assert exc.value.status == 422 and exc.value.extra["field"] == "query.cursor"


def test_field_path() -> None:
    assert field_path(("body", "events", 3, "logprobs")) == "body.events[3].logprobs"
    assert field_path(()) == "(request)"


def test_body_limit_refuses_a_nonpositive_limit() -> None:
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        BodyLimit(object(), max_bytes=0)


def test_messages_drop_nulls_and_keep_unknown_keys() -> None:
    messages = normalize_messages([
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": None,
                                    "x_meta": {"k": 1}}),
        {"role": "user", "content": "hi", "name": None}])
    assert messages == [{"role": "assistant", "content": "", "x_meta": {"k": 1}},
                        {"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match=r"messages\[0\] must be a mapping, got str"):
        normalize_messages(["hi"])  # type: ignore[list-item]


def test_sampling_params_defaults_and_limit() -> None:
    p = sampling_params(temperature=None, top_p=None, max_tokens=None, seed=None, stop="x",
                        cap=64)
    assert (p.temperature, p.top_p, p.max_tokens, p.stop) == (1.0, 1.0, 64, ("x",))
    with pytest.raises(ApiError) as exc:
        sampling_params(temperature=0, top_p=1, max_tokens=65, seed=None, stop=None, cap=64)
    assert exc.value.status == 422 and "max_tokens 65" in exc.value.message


@pytest.mark.parametrize("report, status, reward", [
    ({"status": "COMPLETED", "finish_reason": "stop", "reward": 1.0}, "completed", 1.0),
    ({"status": "COMPLETED", "finish_reason": "max_turns"}, "truncated", None),
    ({"status": "ERROR", "error_message": "boom", "extra_fields": {"reward": -1}}, "error",
     -1.0),
])
def test_completion_report_events(report: dict, status: str, reward: float | None) -> None:
    body = RolloutCompleted.model_validate({"rollout_id": "r1", **report})
    events, got_status, got_reward = completion_events(body)
    assert (got_status, got_reward) == (status, reward)
    assert events[-1].type == "episode_finished" and events[-1].status == status
    assert [e.type for e in events[:-1]] == (["reward_assigned"] if reward is not None else [])
    again, _, _ = completion_events(body)
    assert [e.event_id for e in again] == [e.event_id for e in events]  # retries dedupe


def test_a_boolean_reward_in_a_completion_report_is_refused_naming_the_field() -> None:
    body = RolloutCompleted.model_validate({"rollout_id": "r1", "status": "COMPLETED",
                                            "extra_fields": {"reward": True}})
    with pytest.raises(ApiError) as exc:
        completion_events(body)
    assert exc.value.status == 422 and "extra_fields.reward" in exc.value.message


def test_engine_and_upstream_configuration_errors(tmp_path: Path) -> None:
    assert engine_model_dir(Settings(data_dir=tmp_path)) is None
    with pytest.raises(ValueError, match="is not a model folder"):
        engine_model_dir(Settings(data_dir=tmp_path, gateway_engine_model="/no/such/dir"))
    with pytest.raises(ValueError, match="gateway_upstream_url is not set"):
        Upstream(Settings())
    with pytest.raises(ValueError, match="not an HTTP URL"):  # refused by the settings
        Settings(gateway_upstream_url="ftp://x")
    up = Upstream(Settings(gateway_upstream_url="http://h:1/", gateway_upstream_model="m"))
    assert up.base_url == "http://h:1/v1"
    body = up.prepare({"model": "a", "messages": [], "top_logprobs": None}, chat=True)
    assert body == {"model": "m", "messages": [], "return_token_ids": True, "logprobs": True}
    assert up.prepare({"prompt": "x", "logprobs": 3}, chat=False)["logprobs"] == 3
    assert up.prepare({"prompt": "x", "logprobs": True}, chat=False)["logprobs"] == 0


def test_query_arguments_are_checked(api_store: EventStore) -> None:
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        queries.list_episodes(api_store, queries.EpisodeFilters(run_ids=["r"]), limit=0)
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        queries.list_samples(api_store, queries.SampleFilters(run_id="r"), limit=0)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        next(queries.iter_samples(api_store, queries.SampleFilters(run_id="r"), chunk=0))
    assert queries.list_episodes(api_store, queries.EpisodeFilters(run_ids=[])) == []


@pytest.fixture
def old_schema_app(fresh_db: str, tmp_path: Path) -> Iterator[TestClient]:
    migrate.upgrade(fresh_db, "0003")
    settings = Settings(database_url=fresh_db, data_dir=tmp_path)
    store = EventStore(Database(fresh_db, max_size=2), settings)
    with TestClient(create_app(settings, store=store)) as c:
        yield c
    store.close()


def test_ready_needs_the_newest_schema(old_schema_app: TestClient, client: TestClient) -> None:
    assert old_schema_app.get("/health").status_code == 200
    r = old_schema_app.get("/ready")
    assert r.status_code == 503
    assert r.json()["revision"] == "0003" and "trajstore migrate" in r.json()["detail"]
    ok = client.get("/ready")
    assert ok.status_code == 200 and ok.json()["revision"] == migrate.head_revision()


def test_unknown_route_and_method_are_json_errors(client: TestClient) -> None:
    r = client.get(f"/v1/{uuid.uuid4().hex}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.delete("/v1/runs")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = client.post("/v1/runs", content=b"{not json", headers={
        "Content-Type": "application/json", "Authorization": "Bearer x"})
    assert r.status_code in (400, 401, 422) and "error" in r.json()
