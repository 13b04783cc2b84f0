"""Every view against its plain-loop reference (tests/analytics/reference.py) on seeded random
projection rows, unfiltered and under random combinations of filters."""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from collections.abc import Iterator
from typing import Any

import pytest

from store import analytics, migrate
from store.analytics import Filters
from store.db import Database
from tests.analytics.reference import BASE_TIME, REFERENCES, Tables, generate, insert
from tests.analytics.rows import assert_rows
from tests.conftest import PostgresServer


@pytest.fixture(scope="module")
def random_store(pg_server: PostgresServer) -> Iterator[tuple[Database, Tables]]:
    url = pg_server.create_database("trajstore_reference")
    migrate.upgrade(url)
    tables = generate(random.Random(7), episodes=150)
    db = Database(url, max_size=2)
    with db.transaction() as conn:
        insert(conn, tables)
    yield db, tables
    db.close()
    pg_server.drop_database(url)


def _key(row: Any) -> tuple[Any, ...]:
    """Order rows by their fields other than floats (which may differ in the last bit)."""
    return tuple((v is None, str(v)) for f in dataclasses.fields(row)
                 if not isinstance(v := getattr(row, f.name), float))


def random_filters(rng: random.Random, accepted: frozenset[str]) -> Filters:
    low = rng.randint(0, 3)
    start = BASE_TIME + dt.timedelta(minutes=rng.randint(0, 500))
    options: dict[str, Any] = {
        "run_id": rng.choice(["run-a", "run-b", "run-c", "nope"]),
        "min_version": low,
        "max_version": low + rng.randint(0, 2),
        "since": start,
        "until": start + dt.timedelta(minutes=rng.randint(1, 300)),
        "tool": rng.choice(["search", "calc", "shell"]),
        "error_type": rng.choice(["TypeError", "NameError", "KeyError"]),
    }
    chosen = {k: v for k, v in options.items() if k in accepted and rng.random() < 0.4}
    return Filters(**chosen)


def test_the_data_exercises_every_view(random_store: tuple[Database, Tables]) -> None:
    db, _ = random_store
    for spec in analytics.VIEWS.values():
        assert len(analytics.query(db, spec)) >= 5, spec.view


@pytest.mark.parametrize("name", list(analytics.VIEWS))
def test_views_match_their_loop_reference(random_store: tuple[Database, Tables],
                                          name: str) -> None:
    db, tables = random_store
    spec = analytics.VIEWS[name]
    rng = random.Random(name)
    cases = [Filters(), *(random_filters(rng, spec.filters) for _ in range(25))]
    for filters in cases:
        got = sorted(analytics.query(db, spec, filters), key=_key)
        want = sorted(REFERENCES[name](tables, filters), key=_key)
        assert_rows(got, want)
