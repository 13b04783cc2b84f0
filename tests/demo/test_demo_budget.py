"""The demo's rollout groups go through the run's project's rollout budget
(``workers.rollout.fair.send_budgeted``), as every other producer's: each group queued takes
one of the project's places and carries its ticket to the worker, and a batch past
``rollout_project_queued`` is refused naming the setting. A real embedded Redis as broker."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from store import embedded
from store.settings import Settings
from trajstore.demo import DemoOptions, _send_batch
from workers.rollout import fair
from workers.rollout.fair import RolloutBudgetExceeded


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> str:
    return embedded.redis_url(Settings(data_dir=tmp_path_factory.mktemp("demo-broker")))


def _queued(settings: Settings) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """The rollout queue's messages: task name, args, kwargs."""
    url = str(settings.redis_url)
    client = redis.Redis.from_url("unix://" + url.removeprefix("redis+socket://"))
    try:
        out = []
        for raw in client.lrange(f"{settings.redis_key_prefix}rollout", 0, -1):
            message = json.loads(raw)
            args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            out.append((message["headers"]["task"], args, kwargs))
        return out
    finally:
        client.close()


def test_a_batch_takes_the_projects_places_and_carries_their_tickets(
        broker: str, tmp_path: Path) -> None:
    settings = Settings(redis_url=broker, data_dir=tmp_path, rollout_project_queued=5)
    project, run_id = f"demo-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    options = DemoOptions(groups_per_step=3)
    _send_batch(settings, project, options, run_id, 0, policy=0)
    assert fair.in_use(settings, project) == (3, 0)
    mine = [m for m in _queued(settings) if m[1][0] == run_id]
    assert len(mine) == 3
    for task, _args, kwargs in mine:
        assert task == "trajstore.rollout_group"
        assert kwargs["budget"]["project"] == project and kwargs["budget"]["ticket"]
        assert kwargs["policy_version"] == 0
    # The next batch does not fit: refused naming the setting, the places already taken kept.
    with pytest.raises(RolloutBudgetExceeded, match="TRAJSTORE_ROLLOUT_PROJECT_QUEUED"):
        _send_batch(settings, project, options, run_id, 1, policy=0)
    assert fair.in_use(settings, project)[0] == 5
    # Another project's batch is not counted against it.
    _send_batch(settings, f"{project}-other", options, run_id, 2, policy=0)
    assert fair.in_use(settings, f"{project}-other") == (3, 0)
