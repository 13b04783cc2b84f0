"""A store seeded once per session with episodes whose failures are known, recorded through
``EventStore.append`` and projected by ``project_episode``.

Run ``RUN`` (policy versions 0 and 1; the run's defaults: ``max_tool_retries`` 3, negatives
saved):

========  =====  =======  ==========================================================  =======
episode   group  version  turns (attempts at each position)                           reward
========  =====  =======  ==========================================================  =======
e1        g1     0        turn_1: search TypeError (rolled back), search ok           1.0
e2        g1     0        turn_1: search TypeError ×2 (rolled back), search ok        0.0
e3        g2     0        turn_1: calc NameError ×4: three retries, then terminated   0.0
e4        g2     0        turn_1: search ok; turn_2: calc ZeroDivisionError (kept)    1.0
e5        g3     1        turn_1: search TypeError (rolled back), search ok           1.0
e6        g3     1        turn_1: calc ok                                             0.5
========  =====  =======  ==========================================================  =======

Run ``OTHER``: e7 (as e6) and e8 (as e1 with a corrupted prompt: projected ``invalid``).
``boundary`` is a time after every version-0 episode of ``RUN`` finished and before any
version-1 one did.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from store import migrate
from store.db import Database, scalar
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, LLMCalled, RunConfig, RunCreated
from store.settings import Settings
from tests.analytics.seed import Attempt, Episode, record_events
from tests.conftest import PostgresServer
from tests.replay.replay_tokenizers import qwen3_tokenizer
from workers.replay.jobs.project import project_episode

RUN = "run-analytics"
OTHER = "run-other"


def search_error(name: str, line: int) -> Attempt:
    return Attempt("search", {name: "Dune author"},
                   f"TypeError: unexpected argument '{name}' at /srv/tools/search.py:{line}",
                   "TypeError")


def name_error(name: str) -> Attempt:
    return Attempt("calc", {"expression": f"{name}(2)"},
                   f"NameError: name '{name}' is not defined", "NameError")


SEARCH_OK = Attempt("search", {"query": "Dune author"}, "Frank Herbert")
DUNE = "Who wrote Dune?"
ROOT = "What is the square root of 2?"

EPISODES: dict[str, Episode] = {
    "e1": Episode(RUN, "g1", DUNE, [[search_error("q", 42), SEARCH_OK]], "Frank Herbert.", 1.0),
    "e2": Episode(RUN, "g1", DUNE,
                  [[search_error("q2", 17), search_error("q3", 99), SEARCH_OK]],
                  "Frank Herbert.", 0.0),
    "e3": Episode(RUN, "g2", ROOT, [[name_error("sqrt"), name_error("math"),
                                     name_error("sqrt"), name_error("cmath")]], "", 0.0),
    "e4": Episode(RUN, "g2", ROOT,
                  [[SEARCH_OK], [Attempt("calc", {"expression": "1/0"},
                                         "ZeroDivisionError: division by zero",
                                         "ZeroDivisionError", rollback=False)]],
                  "It cannot be computed.", 1.0),
    "e5": Episode(RUN, "g3", DUNE, [[search_error("q", 7), SEARCH_OK]], "Frank Herbert.", 1.0,
                  policy_version=1),
    "e6": Episode(RUN, "g3", "What is 6*7?", [[Attempt("calc", {"expression": "6*7"}, "42")]],
                  "42.", 0.5, policy_version=1),
    "e7": Episode(OTHER, "g9", "What is 6*7?", [[Attempt("calc", {"expression": "6*7"}, "42")]],
                  "42.", 0.5),
    "e8": Episode(OTHER, "g9", DUNE, [[search_error("q", 42), SEARCH_OK]], "Frank Herbert.",
                  1.0),
}


@dataclass(frozen=True)
class Seeded:
    """The seeded store: its URL, events by episode name, episode ids by name, and the time
    between the version-0 and version-1 episodes of ``RUN``."""

    url: str
    store: EventStore
    events: dict[str, list[Event]]
    ids: dict[str, str]
    boundary: dt.datetime

    @property
    def db(self) -> Database:
        return self.store.db


def _corrupt(events: list[Event]) -> list[Event]:
    """The first LLM call's prompt replaced by ids that render none of its messages."""
    first = next(e for e in events if isinstance(e, LLMCalled))
    bad = first.model_copy(update={"prompt_ids": np.array([1, 2, 3] * 20, dtype=np.int32)})
    return [bad if e is first else e for e in events]


@pytest.fixture(scope="session")
def qwen3() -> Any:
    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def seeded(pg_server: PostgresServer, qwen3: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    url = pg_server.create_database("trajstore_analytics")
    migrate.upgrade(url)
    settings = Settings(database_url=url, data_dir=Path(tmp_path_factory.mktemp("analytics")))
    store = EventStore(Database(url, max_size=4), settings)
    for run in (RUN, OTHER):
        store.append(run_stream_id(run),
                     [RunCreated(run_id=run, config=RunConfig(tokenizer="qwen3"))], NO_STREAM)
    events = {name: record_events(qwen3, ep) for name, ep in EPISODES.items()}
    events["e8"] = _corrupt(events["e8"])
    ids: dict[str, str] = {}
    boundary = None
    for name in EPISODES:
        if name == "e5":
            with store.db.connection() as conn:
                boundary = scalar(conn, "SELECT clock_timestamp()")
        ids[name] = f"{name}-{EPISODES[name].run_id}"
        store.append(ids[name], events[name], NO_STREAM)
        outcome = project_episode(store, ids[name])
        assert outcome.outcome == "written", outcome
        assert outcome.status == ("invalid" if name == "e8" else
                                  "terminated" if name == "e3" else "completed"), outcome
    assert boundary is not None
    yield Seeded(url=url, store=store, events=events, ids=ids, boundary=boundary)
    store.close()
    pg_server.drop_database(url)
