"""``/metrics`` over HTTP: Prometheus text from ``prometheus_client``, behind an admin key,
parsed with ``prometheus_client``'s own parser: episodes by status, queue depth per Celery
queue, lease ages, follower and replay lag."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from store import embedded
from store.eventlog import EventStore
from store.followers import save_cursor
from store.leasing import Leasing
from store.settings import Settings
from tests.api.conftest import Project, make_project
from tests.api.episodes import create_run, episode_events, record_group
from workers.app import QUEUES, configure


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


def test_metrics_need_a_key_and_speak_prometheus(client: TestClient, project) -> None:
    assert client.get("/metrics").status_code == 401
    # The figures count every project's runs and samples: an admin key only.
    for role in ("read", "ingest"):
        assert client.get("/metrics", headers=project.headers(role)).status_code == 403
    response = client.get("/metrics", headers=project.headers("admin"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    body = response.text
    for name in ("trajstore_events_total", "trajstore_replay_lag_seconds", "trajstore_samples",
                 "trajstore_lease_expiries_total", "trajstore_trainer_tokens_per_second",
                 "trajstore_append_seconds", "trajstore_episodes", "trajstore_queue_depth",
                 "trajstore_lease_oldest_age_seconds", "trajstore_follower_lag_seconds"):
        assert f"# TYPE {name} " in body
    # No Redis named and the embedded one not running: the broker is down, the page is not,
    # and no Redis was started to answer.
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert families["trajstore_broker_up"].samples[0].value == 0
    assert families["trajstore_queue_depth"].samples == []


def _scrape(client: TestClient, project: Project) -> dict[str, Any]:
    r = client.get("/metrics", headers=project.headers("admin"))
    assert r.status_code == 200, r.text
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_read_the_database_and_the_broker(
        pg_url: str, tmp_path: Path, api_store: EventStore, key_store: Any, qwen3: Any) -> None:
    broker = embedded.redis_url(Settings(data_dir=tmp_path / "broker"))
    prefix = f"m{uuid.uuid4().hex[:8]}:"
    settings = Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024,
                        redis_url=broker, redis_key_prefix=prefix)
    project = make_project(key_store)
    run = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run, project=project.name, group_size=2)
    with TestClient(create_app(settings, store=api_store)) as client:
        before = _scrape(client, project)
        record_group(api_store, qwen3, run_id=run, group_id="g0", size=2)
        record_group(api_store, qwen3, run_id=run, group_id="g1", size=2, project_now=False)
        running = episode_events(qwen3, run_id=run, group_id="g2", a=1, b=2, reward=1.0)[:2]
        api_store.append(f"ep-{uuid.uuid4().hex[:8]}", running, "no_stream")
        lease = Leasing(api_store).lease_batch(run, groups=1, lease_seconds=600)
        assert lease is not None
        # Tasks waiting in two queues, sent through a Celery app configured as the workers'.
        celery = Celery("metrics-test")
        configure(celery, settings)
        for i in range(3):
            celery.send_task("trajstore.replay_episode", args=[f"ep-{i}"])
        celery.send_task("trajstore.train_step", args=[run])
        celery.close()
        follower = f"test-follower-{uuid.uuid4().hex[:6]}"
        first = api_store.read_all(None, limit=1)[0]
        save_cursor(api_store, follower, first.log_position)
        after = _scrape(client, project)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert after[("trajstore_broker_up", ())] == 1
    assert {q: after[("trajstore_queue_depth", (("queue", q),))] for q in QUEUES} == {
        "replay": 3, "rollout": 0, "train": 1}
    # Other tests share the database: compare with the scrape before.
    assert delta("trajstore_episodes", status="completed") == 2
    assert delta("trajstore_episodes", status="running") == 1
    assert delta("trajstore_replay_lag_episodes") == 2
    assert delta("trajstore_events_total", type="episode_started") == 5
    # Leases of earlier tests end (expire, are acknowledged) while this one runs, so the
    # gauge is compared with the table as the scrape left it, with this test's lease live.
    with api_store.db.connection() as conn:
        (live,) = conn.execute("SELECT count(*) FROM leases WHERE ended IS NULL").fetchone()
        (mine,) = conn.execute("SELECT ended IS NULL FROM leases WHERE lease_id = %s",
                               (lease.lease_id,)).fetchone()
    assert mine and after[("trajstore_leases_active", ())] == live >= 1
    assert 0 <= after[("trajstore_lease_oldest_age_seconds", ())]
    assert after[("trajstore_follower_lag_events", (("follower", follower),))] >= 20
    assert after[("trajstore_follower_lag_seconds", (("follower", follower),))] > 0
    assert after[("trajstore_append_seconds_count", ())] >= 1
