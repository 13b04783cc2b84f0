"""Prometheus metrics read from the database, and JSON logs."""

from __future__ import annotations

import json
import logging
import re
import uuid

from store.eventlog import EventStore
from store.logs import JsonFormatter
from store.metrics import render
from tests.factories import closing, episode_started, trajectory


def _value(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} missing"
    return float(match[1])


def test_metrics_agree_with_the_database(store: EventStore) -> None:
    store.append(f"ep-{uuid.uuid4().hex}", [episode_started(), *trajectory(2), *closing()])
    text = render(store)
    for event_type, n in store.counts_by_type().items():
        assert _value(text, "trajstore_events_total", f'{{type="{event_type}"}}') == n
    assert _value(text, "trajstore_append_seconds_count") >= 1
    assert _value(text, "trajstore_append_seconds_bucket", '{le="+Inf"}') == \
        _value(text, "trajstore_append_seconds_count")
    # The episode above finished and nothing projected it: it is replay lag.
    assert _value(text, "trajstore_replay_lag_episodes") >= 1
    assert _value(text, "trajstore_replay_lag_seconds") >= 0
    for status in ("ready", "leased", "consumed", "stale", "skipped"):
        _value(text, "trajstore_samples", f'{{status="{status}"}}')
    assert "# TYPE trajstore_append_seconds histogram" in text


def test_json_log_lines() -> None:
    record = logging.LogRecord("trajstore.test", logging.WARNING, __file__, 1,
                               "replay of %s failed", ("ep-1",), None)
    record.episode_id = "ep-1"
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "WARNING" and line["message"] == "replay of ep-1 failed"
    assert line["logger"] == "trajstore.test" and line["episode_id"] == "ep-1"
    assert line["time"].endswith("+00:00")
