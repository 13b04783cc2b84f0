"""Engines' reports of the policy version they serve (``policy_served``): recorded in the run's
stream, read back per version with lags, bad reports refused before anything is stored, and
policy updates that never lose to a report landing meanwhile."""

from __future__ import annotations

import math
import uuid

import pytest

from store import errors, serving
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import PolicyServed, PolicyUpdated, RunCreated


def new_run(store: EventStore) -> str:
    run_id = f"serve-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id)], NO_STREAM)
    return run_id


def update(store: EventStore, run_id: str, version: int) -> None:
    assert serving.append_policy_updated(store, run_id, PolicyUpdated(
        version=version, step=version, checkpoint=f"/ckpt/v{version}")) is not None


def test_reports_are_read_back_per_version_with_lags(store: EventStore) -> None:
    run_id = new_run(store)
    serving.record_policy_served(store, run_id, version=0, engine="a:1/X", backend="X")
    update(store, run_id, 1)
    serving.record_policy_served(store, run_id, version=1, engine="a:1/X", backend="X",
                                 source="/ckpt/v1", load_seconds=0.25)
    serving.record_policy_served(store, run_id, version=1, engine="b:2/Y", backend="Y",
                                 source="push", load_seconds=1)
    # A reload of a version already reported counts once, at the first report.
    serving.record_policy_served(store, run_id, version=1, engine="a:1/X", backend="X")
    update(store, run_id, 2)

    versions = serving.policy_takeup(store, run_id)
    assert [v.version for v in versions] == [0, 1, 2]
    base, first, second = versions
    assert base.step is None and base.updated_at is None
    assert [e.engine for e in base.engines] == ["a:1/X"]
    assert base.engines[0].lag_seconds is None and base.lag_max_seconds is None
    assert first.step == 1 and first.checkpoint == "/ckpt/v1"
    assert [(e.engine, e.backend, e.source, e.load_seconds) for e in first.engines] == [
        ("a:1/X", "X", "/ckpt/v1", 0.25), ("b:2/Y", "Y", "push", 1.0)]
    for engine in first.engines:
        assert first.updated_at is not None
        assert engine.served_at >= first.updated_at
        assert engine.lag_seconds == (engine.served_at - first.updated_at).total_seconds()
        assert engine.lag_seconds >= 0
    assert first.lag_max_seconds == max(e.lag_seconds for e in first.engines)
    assert second.engines == () and second.lag_max_seconds is None
    assert [v.version for v in serving.policy_takeup(store, run_id, version=1)] == [1]
    assert serving.newest_policy_version(store, run_id) == 2
    assert serving.newest_policy(store, run_id) == (2, "/ckpt/v2")
    assert serving.newest_policy(store, "no-such-run") == (0, None)


@pytest.mark.parametrize("changes,error,words", [
    ({"version": -1}, errors.ValidationError, "version must be >= 0"),
    ({"version": 5}, errors.ValidationError, "has no policy version 5 (its newest is 1)"),
    ({"version": True}, TypeError, "version must be an integer"),
    ({"version": "1"}, TypeError, "version must be an integer"),
    ({"version": 1.0}, TypeError, "version must be an integer"),
    ({"engine": ""}, errors.ValidationError, "engine must be 1 to 200 characters"),
    ({"engine": "  "}, errors.ValidationError, "engine must be 1 to 200 characters"),
    ({"engine": "e" * 201}, errors.ValidationError, "engine must be 1 to 200 characters"),
    ({"engine": 7}, TypeError, "engine must be a string"),
    ({"backend": None}, TypeError, "backend must be a string"),
    ({"source": b"/x"}, TypeError, "source must be a string"),
    ({"load_seconds": -0.5}, errors.ValidationError, "load_seconds must be a finite number"),
    ({"load_seconds": math.nan}, errors.ValidationError, "load_seconds must be a finite"),
    ({"load_seconds": "1"}, TypeError, "load_seconds must be a number"),
])
def test_bad_reports_are_refused_and_store_nothing(store: EventStore, changes: dict,
                                                   error: type, words: str) -> None:
    run_id = new_run(store)
    update(store, run_id, 1)
    before = store.stream_version(run_stream_id(run_id))
    report = {"version": 1, "engine": "a:1/X", "backend": "X"} | changes
    with pytest.raises(error) as caught:
        serving.record_policy_served(store, run_id, **report)
    assert words in str(caught.value)
    assert store.stream_version(run_stream_id(run_id)) == before


def test_unknown_run_is_refused(store: EventStore) -> None:
    with pytest.raises(errors.NotFoundError, match="no run 'nope-"):
        serving.record_policy_served(store, f"nope-{uuid.uuid4().hex[:6]}", version=0,
                                     engine="a", backend="X")
    with pytest.raises(errors.NotFoundError, match="no run"):
        serving.policy_takeup(store, f"nope-{uuid.uuid4().hex[:6]}")
    with pytest.raises(TypeError, match="run_id must be a string"):
        serving.record_policy_served(store, 3, version=0, engine="a",  # type: ignore[arg-type]
                                     backend="X")


def test_the_event_belongs_to_run_streams_only(store: EventStore) -> None:
    with pytest.raises(errors.ValidationError, match="policy_served cannot go to stream"):
        store.append(f"episode-{uuid.uuid4().hex[:6]}", [PolicyServed(
            version=0, engine="a", backend="X")])


def test_policy_update_waits_out_reports_but_never_takes_a_version_twice(
        store: EventStore) -> None:
    run_id = new_run(store)
    update(store, run_id, 1)
    stream = run_stream_id(run_id)

    # A report lands between the trainer's read of the stream and its append: the append
    # is retried, not lost.
    class Racing(EventStore):
        raced = False

        def stream_version(self, stream_id: str) -> int:
            version = super().stream_version(stream_id)
            if not Racing.raced:
                Racing.raced = True
                serving.record_policy_served(store, run_id, version=1, engine="a",
                                             backend="X")
            return version

    racing = Racing(store.db, store.settings)
    result = serving.append_policy_updated(racing, run_id, PolicyUpdated(version=2, step=2))
    assert Racing.raced and result is not None
    types = [r.event.type for r in store.read_stream(stream)]
    assert types == ["run_created", "policy_updated", "policy_served", "policy_updated"]
    # Version 2 is taken: a second trainer's append of it is turned down.
    assert serving.append_policy_updated(store, run_id, PolicyUpdated(version=2, step=3)
                                         ) is None
    assert serving.newest_policy_version(store, run_id) == 2
