"""A process that plays the group of one episode of :mod:`tests.rollout.test_resume` with its
ledger tool hanging after it writes ``a``, for the test to SIGKILL it there.

``python -m tests.rollout.resume_player DATABASE_URL DATA_DIR RUN_ID MODEL_DIR LEDGER``."""

from __future__ import annotations

import sys
from pathlib import Path

from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings
from tests.rollout.test_resume import SCRIPT, TASK, Ledger
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.group import play_group
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.tools import ToolRegistry


def main(url: str, data_dir: str, run_id: str, model_dir: str, ledger: str) -> None:
    store = EventStore(Database(url, max_size=2), Settings(database_url=url,
                                                            data_dir=Path(data_dir)))
    backend = ReplayBackend(TransformersBackend(Path(model_dir)), SCRIPT)
    play_group(log=StoreGroupLog(store), run_id=run_id, task=TASK, backend=backend,
               tools=ToolRegistry([Ledger(Path(ledger), hang_after="a")]), policy_version=0)


if __name__ == "__main__":
    main(*sys.argv[1:6])
