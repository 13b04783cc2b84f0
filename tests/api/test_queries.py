"""Queries: episode listing (every filter against a plain reference, cursor pages), one
episode with its events, merged timelines, samples and negatives, the Parquet export."""

from __future__ import annotations

import datetime as dt
import io
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.keys import KeyStore
from store.db import Database
from store.eventlog import EventStore
from store.events import EpisodeStarted, LLMCalled, RewardAssigned
from store.settings import Settings
from tests.api.conftest import Project, make_project
from tests.api.episodes import create_run, episode_events
from workers.replay.jobs.project import project_episode


@dataclass
class Episode:
    episode_id: str
    group_id: str
    status: str
    reward: float | None
    policy_version: int
    error_types: set[str]
    tools: set[str]
    started_at: dt.datetime
    negative: bool


@dataclass
class Dataset:
    project: Project
    run_id: str
    episodes: list[Episode]


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def dataset(pg_url: str, qwen3: Any) -> Iterator[Dataset]:
    settings = Settings(database_url=pg_url, api_key_scrypt_n=1024)
    store = EventStore(Database(pg_url, max_size=2), settings)
    project = make_project(KeyStore(store.db, settings))
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(store, run_id, project=project.name, group_size=2, max_negatives=1)
    episodes: list[Episode] = []
    plan = [  # group, reward, failed attempt, tool error, policy version, finish, project
        ("g0", 1.0, True, None, 0, True, True),
        ("g0", 0.0, False, None, 0, True, True),
        ("g1", 1.0, False, "TimeoutError", 1, True, True),
        ("g1", 0.5, False, None, 1, True, True),
        ("g2", 1.0, False, None, 2, True, False),   # finished, not replayed yet
        ("g2", None, False, None, 2, False, False),  # still running
    ]
    for i, (group, reward, failed, tool_error, version, finish, project_it) in enumerate(plan):
        episode_id = f"ep{i}-{uuid.uuid4().hex[:6]}"
        events = episode_events(qwen3, run_id=run_id, group_id=group, a=i + 1, b=2,
                                reward=reward if reward is not None else 0.0,
                                failed_attempt=failed, tool_error=tool_error,
                                policy_version=version, seed=i)
        if not finish:
            events = [e for e in events if e.type not in ("reward_assigned",
                                                          "episode_finished")]
        store.append(episode_id, events, "no_stream")
        if project_it:
            assert project_episode(store, episode_id).outcome == "written"
        started = store.read_stream(episode_id, to_version=1)[0].recorded_at
        errors = {"NameError"} if failed else set()
        if tool_error:
            errors.add(tool_error)
        episodes.append(Episode(episode_id, group, "completed" if finish else "running",
                                reward, version, errors, {"add"}, started, failed))
    yield Dataset(project, run_id, episodes)
    store.close()


def _ids(page: dict[str, Any]) -> list[str]:
    return [e["episode_id"] for e in page["episodes"]]


def _list(client: TestClient, ds: Dataset, **params: Any) -> list[str]:
    """Every page of a listing, stitched."""
    out: list[str] = []
    cursor = None
    while True:
        query = {"run_id": ds.run_id, **params, **({"cursor": cursor} if cursor else {})}
        r = client.get("/v1/episodes", params=query, headers=ds.project.headers("read"))
        assert r.status_code == 200, r.text
        out += _ids(r.json())
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return out


def _reference(ds: Dataset, **f: Any) -> list[str]:
    """The listing computed with plain Python over what the fixture recorded."""
    out = []
    for e in ds.episodes:
        if "group_id" in f and e.group_id != f["group_id"]:
            continue
        if "status" in f and e.status != f["status"]:
            continue
        if "reward_min" in f and (e.reward is None or e.reward < f["reward_min"]):
            continue
        if "reward_max" in f and (e.reward is None or e.reward > f["reward_max"]):
            continue
        if "policy_version" in f and e.policy_version != f["policy_version"]:
            continue
        if "error_type" in f and f["error_type"] not in e.error_types:
            continue
        if "tool_name" in f and f["tool_name"] not in e.tools:
            continue
        if "started_after" in f and e.started_at < f["started_after"]:
            continue
        if "started_before" in f and e.started_at >= f["started_before"]:
            continue
        out.append(e.episode_id)
    return out


@pytest.mark.parametrize("filters", [
    {}, {"group_id": "g1"}, {"status": "completed"}, {"status": "running"},
    {"reward_min": 0.5}, {"reward_max": 0.5}, {"reward_min": 0.2, "reward_max": 0.7},
    {"policy_version": 1}, {"error_type": "NameError"}, {"error_type": "TimeoutError"},
    {"error_type": "KeyError"}, {"tool_name": "add"}, {"tool_name": "search"},
    {"group_id": "g2", "status": "completed"},
])
def test_filters_match_a_plain_reference_at_every_page_size(
        client: TestClient, dataset: Dataset, filters: dict[str, Any]) -> None:
    expected = _reference(dataset, **filters)
    for limit in (1, 2, 50):
        assert _list(client, dataset, limit=limit, **filters) == expected, (filters, limit)


def test_time_range_filter(client: TestClient, dataset: Dataset) -> None:
    third = dataset.episodes[2].started_at
    for f in ({"started_after": third}, {"started_before": third},
              {"started_after": dataset.episodes[1].started_at, "started_before": third}):
        query = {k: v.isoformat() for k, v in f.items()}
        assert _list(client, dataset, **query) == _reference(dataset, **f)


def test_listing_reads_status_and_reward_from_the_log_before_replay(
        client: TestClient, dataset: Dataset) -> None:
    rows = client.get("/v1/episodes", params={"run_id": dataset.run_id, "group_id": "g2"},
                      headers=dataset.project.headers("read")).json()["episodes"]
    finished, running = rows
    assert finished["status"] == "completed" and finished["reward"] == 1.0
    assert finished["projected_version"] is None and finished["llm_calls"] is None
    assert running["status"] == "running" and running["reward"] is None
    replayed = client.get("/v1/episodes", params={"run_id": dataset.run_id, "group_id": "g0"},
                          headers=dataset.project.headers("read")).json()["episodes"][0]
    assert replayed["llm_calls"] == 3 and replayed["attempts_failed"] == 1
    assert replayed["negatives"] == 1 and replayed["projected_version"] == replayed["events"]


def test_listing_without_run_covers_the_project_and_bad_cursor_is_422(
        client: TestClient, dataset: Dataset) -> None:
    r = client.get("/v1/episodes", headers=dataset.project.headers("read"))
    assert _ids(r.json()) == [e.episode_id for e in dataset.episodes]
    r = client.get("/v1/episodes", params={"cursor": "garbage"},
                   headers=dataset.project.headers("read"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "query.cursor"
    r = client.get("/v1/episodes", params={"status": "sleeping"},
                   headers=dataset.project.headers("read"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "query.status"


def test_one_episode_with_summary_and_events(client: TestClient, dataset: Dataset,
                                             api_store: EventStore) -> None:
    episode = dataset.episodes[0].episode_id
    got = client.get(f"/v1/episodes/{episode}", headers=dataset.project.headers("read")).json()
    stored = api_store.read_stream(episode)
    assert [e["type"] for e in got["events"]] == [r.type for r in stored]
    assert got["summary"]["episode_id"] == episode and got["summary"]["reward"] == 1.0
    first_call = next(i for i, r in enumerate(stored) if isinstance(r.event, LLMCalled))
    tokens = got["events"][first_call]["tokens"]
    assert tokens["prompt_ids"] == stored[first_call].event.prompt_ids.tolist()
    assert np.allclose(tokens["logprobs"], stored[first_call].event.logprobs)
    slim = client.get(f"/v1/episodes/{episode}", params={"tokens": "false"},
                      headers=dataset.project.headers("read")).json()
    assert all(e["tokens"] is None for e in slim["events"])
    assert client.get(f"/v1/episodes/{episode}x",
                      headers=dataset.project.headers("read")).status_code == 404


def test_timelines_mask_exactly_the_sampled_tokens(client: TestClient, dataset: Dataset,
                                                   api_store: EventStore) -> None:
    episode = dataset.episodes[1].episode_id  # no failed attempt: one merged timeline
    got = client.get(f"/v1/episodes/{episode}/timelines",
                     headers=dataset.project.headers("read")).json()
    calls = [r.event for r in api_store.read_stream(episode) if isinstance(r.event, LLMCalled)]
    (timeline,) = got["timelines"]
    assert timeline["absorbed"] == [0]
    ids = np.asarray(timeline["token_ids"])
    mask = np.asarray(timeline["loss_mask"], dtype=bool)
    logprobs = np.asarray(timeline["logprobs"], dtype=np.float32)
    # The first call's prompt opens the timeline, the last generation closes it; every
    # generated token is trained, with its recorded logprob, and nothing else is.
    first, last = calls[0].prompt_ids.tolist(), calls[-1].response_ids.tolist()
    assert ids[: len(first)].tolist() == first and ids[-len(last):].tolist() == last
    generated = np.concatenate([c.response_ids for c in calls])
    assert ids[mask].tolist() == generated.tolist()
    assert np.array_equal(logprobs[mask], np.concatenate([c.logprobs for c in calls]))
    assert not logprobs[~mask].any()
    assert timeline["num_trainable"] == int(mask.sum())
    spans = timeline["messages"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == len(ids)
    assert [m["author"] for m in spans if m["trainable"]] == ["llm", "llm"]
    b64 = client.get(f"/v1/episodes/{episode}/timelines", params={"encoding": "base64"},
                     headers=dataset.project.headers("read")).json()["timelines"][0]
    import base64

    assert np.frombuffer(base64.b64decode(b64["loss_mask"]), np.uint8).tolist() == \
        mask.astype(int).tolist()


def test_timelines_report_negatives_and_refuse_unreplayable_episodes(
        client: TestClient, dataset: Dataset, api_store: EventStore) -> None:
    episode = dataset.episodes[0].episode_id
    got = client.get(f"/v1/episodes/{episode}/timelines",
                     headers=dataset.project.headers("read")).json()
    (negative,) = got["negatives"]
    assert negative["error_types"] == ["NameError"] and negative["kept"] is True
    assert negative["reward"] == -1.0
    broken = f"broken-{uuid.uuid4().hex[:6]}"
    api_store.append(broken, [
        EpisodeStarted(run_id=dataset.run_id, group_id="gx"),
        LLMCalled(call_id="c", messages=[{"role": "user", "content": "hi"}],
                  prompt_ids=[1, 2, 3], response_ids=[4], logprobs=[-0.1]),
        RewardAssigned(value=0.0)], "no_stream")
    r = client.get(f"/v1/episodes/{broken}/timelines", headers=dataset.project.headers("read"))
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_replayable"


def test_samples_and_negatives_of_a_run_and_a_group(client: TestClient, dataset: Dataset,
                                                    api_store: EventStore) -> None:
    headers = dataset.project.headers("read")
    every = []
    cursor = None
    while True:
        r = client.get(f"/v1/runs/{dataset.run_id}/samples",
                       params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                       headers=headers).json()
        every += r["samples"]
        cursor = r["next_cursor"]
        if cursor is None:
            break
    projected = [e for e in dataset.episodes[:4]]
    assert {s["episode_id"] for s in every} == {e.episode_id for e in projected}
    negatives = client.get(f"/v1/runs/{dataset.run_id}/samples", params={"kind": "negative"},
                           headers=headers).json()["samples"]
    assert [s["episode_id"] for s in negatives] == [dataset.episodes[0].episode_id]
    assert negatives[0]["is_negative"] and negatives[0]["reward"] == -1.0
    assert negatives[0]["error_types"] == ["NameError"]
    g1 = client.get(f"/v1/runs/{dataset.run_id}/samples", params={"group_id": "g1"},
                    headers=headers).json()["samples"]
    assert {s["uid"] for s in g1} == {"g1"} and len(g1) == 2
    # verl columns agree with the replayed timeline of the episode.
    sample = next(s for s in every if s["episode_id"] == dataset.episodes[1].episode_id)
    timeline = client.get(f"/v1/episodes/{sample['episode_id']}/timelines",
                          headers=headers).json()["timelines"][0]
    assert sample["prompt_ids"] + sample["response_ids"] == timeline["token_ids"]
    p = sample["prompt_length"]
    assert sample["response_mask"] == timeline["loss_mask"][p:]
    assert sample["response_mask"][0] == 1 and not any(timeline["loss_mask"][:p])
    assert np.allclose(sample["rollout_log_probs"], timeline["logprobs"][p:])
    slim = client.get(f"/v1/runs/{dataset.run_id}/samples", params={"tokens": "false"},
                      headers=headers).json()["samples"]
    assert all(s["prompt_ids"] is None for s in slim)


def test_parquet_export_is_streamed_in_row_groups_with_verl_columns(
        pg_url: str, tmp_path: Any, api_store: EventStore, dataset: Dataset) -> None:
    settings = Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024,
                        api_export_rows_per_group=2)
    headers = dataset.project.headers("read")
    with TestClient(create_app(settings, store=api_store)) as client:
        with client.stream("GET", f"/v1/runs/{dataset.run_id}/export.parquet",
                           headers=headers) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/vnd.apache.parquet"
            parts = list(r.iter_raw())
        samples = client.get(f"/v1/runs/{dataset.run_id}/samples", headers=headers,
                             params={"limit": 100}).json()["samples"]
        negatives = client.get(f"/v1/runs/{dataset.run_id}/export.parquet", headers=headers,
                               params={"kind": "negative"})
    f = pq.ParquetFile(io.BytesIO(b"".join(parts)))
    # Four episodes with one positive sample each (the rolled-back call of the first is no
    # positive sample) and the first one's negative.
    assert f.metadata.num_rows == len(samples) == 5
    assert f.metadata.num_row_groups == 3 and len(parts) >= 3  # 2 samples per row group
    table = f.read().to_pylist()
    assert set(table[0]) >= {"prompt_ids", "response_ids", "response_mask",
                             "rollout_log_probs", "reward", "uid", "is_negative"}
    for row, sample in zip(table, samples, strict=True):
        assert row["sample_id"] == sample["sample_id"] and row["uid"] == sample["uid"]
        assert row["prompt_ids"] == sample["prompt_ids"]
        assert row["response_ids"] == sample["response_ids"]
        assert row["response_mask"] == sample["response_mask"]
        assert np.allclose(row["rollout_log_probs"], sample["rollout_log_probs"])
        assert row["is_negative"] == sample["is_negative"]
    neg = pq.read_table(io.BytesIO(negatives.content)).to_pylist()
    assert [r["is_negative"] for r in neg] == [True]
