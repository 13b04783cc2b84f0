"""A re-projection never changes or deletes a sample a trainer leased or acknowledged: the
sample stays as it was and the projection's wish is recorded in ``projection_conflicts``."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from store import migrate
from store.db import Database
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeStarted, RunCreated
from store.leasing import Leasing
from store.projections import EpisodeProjection, EpisodeRow, Projections, RunRow
from store.settings import Settings, get_settings
from tests.store.test_leasing import T0, _sample, add_group, new_run
from trajstore.cli import app


def _rows(store: EventStore, episode: str) -> list[tuple]:
    with store.db.connection() as conn:
        return conn.execute(
            "SELECT sample_id, kind, timeline_index, reward, token_ids, loss_mask, logprobs,"
            " num_tokens, status, lease_id, consumed_version FROM samples"
            " WHERE episode_id = %s ORDER BY kind, timeline_index", (episode,)).fetchall()


def _projection(store: EventStore, episode: str, *, version: int,
                samples_from: list | None = None) -> EpisodeProjection:
    """The episode's projection as ``add_group`` wrote it, at stream ``version``."""
    with store.db.connection() as conn:
        run_id, group_id = conn.execute(
            "SELECT run_id, group_id FROM episodes WHERE episode_id = %s", (episode,)).fetchone()
    return EpisodeProjection(
        run=RunRow(run_id=run_id, project="p", group_size=2, max_negatives_per_group=1,
                   save_negative_samples=True, config={}, created_at=T0),
        episode=EpisodeRow(episode_id=episode, run_id=run_id, group_id=group_id,
                           status="completed", projected_version=version, reward=1.0,
                           policy_version=0, finished_at=T0),
        samples=samples_from if samples_from is not None
        else [_sample(run_id, group_id, episode, "positive", 0)])


def _trained(store: EventStore) -> tuple[str, list[str]]:
    run = new_run()
    episodes = add_group(store, run, "g", episodes=2, size=2)
    leasing = Leasing(store)
    lease = leasing.lease_batch(run, groups=1, lease_seconds=60)
    assert lease is not None and len(lease.samples) == 2
    assert leasing.ack(lease.lease_id, policy_version=1) == 2
    return run, episodes


def test_a_changed_consumed_sample_stays_and_the_conflict_is_recorded(
        store: EventStore) -> None:
    run, (first, second) = _trained(store)
    before = _rows(store, first)
    assert [r[8] for r in before] == ["consumed"]
    projections = Projections(store)
    (sample,) = _projection(store, first, version=6).samples
    changed = dataclasses.replace(sample, reward=0.25,
                                  token_ids=np.asarray(sample.token_ids) + 1000)
    extra = dataclasses.replace(sample, timeline_index=7)
    assert projections.write(_projection(store, first, version=6,
                                         samples_from=[changed, extra]))
    after = _rows(store, first)
    assert after[0] == before[0]  # the consumed sample, byte for byte and id for id
    assert [(r[1], r[2], r[8]) for r in after[1:]] == [("positive", 7, "ready")]
    assert projections.projected_version(first) == 6
    (conflict,) = projections.conflicts(episode_id=first)
    assert conflict["action"] == "change" and conflict["sample_status"] == "consumed"
    assert sorted(conflict["columns"]) == ["reward", "token_ids"]
    assert conflict["sample_id"] == before[0][0] and conflict["projected_version"] == 6
    assert conflict["run_id"] == run and conflict["recorded_at"] is not None
    # The same projection again is skipped; a projection that changes nothing of a consumed
    # sample records no conflict.
    assert not projections.write(_projection(store, first, version=6,
                                             samples_from=[changed, extra]))
    assert projections.write(_projection(store, second, version=6))
    assert projections.conflicts(episode_id=second) == []
    assert _rows(store, second)[0][8] == "consumed"


def test_a_deleted_leased_sample_stays_and_the_conflict_is_recorded(store: EventStore) -> None:
    run = new_run()
    first, _ = add_group(store, run, "g", episodes=2, size=2)
    lease = Leasing(store).lease_batch(run, groups=1, lease_seconds=60)
    assert lease is not None
    before = _rows(store, first)
    assert before[0][8] == "leased"
    projections = Projections(store)
    # An invalid projection (a second episode_finished, a replay bug) makes no sample.
    invalid = _projection(store, first, version=7, samples_from=[])
    invalid = dataclasses.replace(invalid, episode=dataclasses.replace(
        invalid.episode, status="invalid", invalid_reason="two episode_finished"))
    assert projections.write(invalid)
    assert _rows(store, first) == before
    (conflict,) = projections.conflicts(run_id=run)
    assert (conflict["action"], conflict["columns"], conflict["sample_status"]) == (
        "delete", [], "leased")
    # The trainer's acknowledgement still lands on the sample it trained.
    assert Leasing(store).ack(lease.lease_id, policy_version=1) == 2
    assert _rows(store, first)[0][8] == "consumed"


def test_conflict_listing_refuses_a_bad_limit(store: EventStore) -> None:
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError, match="limit"):
            Projections(store).conflicts(limit=bad)  # type: ignore[arg-type]


@pytest.fixture
def own_store(fresh_db: str, tmp_path: Path) -> Iterator[EventStore]:
    """A store of its own: a rebuild empties every projection of its database."""
    migrate.upgrade(fresh_db)
    s = EventStore(Database(fresh_db, max_size=2), Settings(database_url=fresh_db,
                                                            data_dir=tmp_path))
    yield s
    s.close()


def test_rebuild_keeps_trained_samples_and_records_what_the_replay_wanted(
        own_store: EventStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store = own_store
    run, (first, second) = _trained(store)
    ready = add_group(store, run, f"h-{uuid.uuid4().hex[:4]}", episodes=1, size=2)
    before = {e: _rows(store, e) for e in (first, second)}
    projections = Projections(store)
    assert projections.rebuild() == 2
    with store.db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM samples WHERE episode_id = %s",
                            (ready[0],)).fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
    assert projections.projected_version(first) == 0
    # The replay after the rebuild (here: a code change that makes other tokens, and one
    # episode that no longer yields its sample).
    (sample,) = _projection(store, first, version=5).samples
    assert projections.write(_projection(store, first, version=5, samples_from=[
        dataclasses.replace(sample, logprobs=np.asarray(sample.logprobs) - 0.1)]))
    assert projections.write(_projection(store, second, version=5, samples_from=[]))
    assert {e: _rows(store, e) for e in (first, second)} == before
    got = {(c["episode_id"], c["action"], tuple(c["columns"]))
           for c in projections.conflicts(run_id=run)}
    assert got == {(first, "change", ("logprobs",)), (second, "delete", ())}
    assert projections.conflict_count() == 2
    # Operators see them with `trajstore conflicts`, which names runs and episodes of the log
    # (the samples above were written as projections alone: record their run and episode).
    store.append(run_stream_id(run), [RunCreated(run_id=run)], NO_STREAM)
    store.append(first, [EpisodeStarted(run_id=run, group_id="g")], NO_STREAM)
    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", store.db.url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        done = runner.invoke(app, ["conflicts", "--run", run, "--json"])
        assert done.exit_code == 0, done.output
        lines = [json.loads(line) for line in done.output.splitlines()]
        assert {(r["episode_id"], r["action"]) for r in lines} == {
            (first, "change"), (second, "delete")}
        table = runner.invoke(app, ["conflicts", "--episode", first])
        assert table.exit_code == 0 and "logprobs" in table.output
        assert "consumed" in table.output
        # An unknown id is an error naming it, not an empty answer.
        unknown = runner.invoke(app, ["conflicts", "--episode", "no-such-episode"])
        assert unknown.exit_code == 1 and "no episode 'no-such-episode'" in unknown.output
        unknown = runner.invoke(app, ["conflicts", "--run", "no-such-run"])
        assert unknown.exit_code == 1 and "no run 'no-such-run'" in unknown.output
        bad = runner.invoke(app, ["conflicts", "--limit", "0"])
        assert bad.exit_code == 2 and "--limit" in bad.output
    finally:
        get_settings.cache_clear()
