"""vLLM's async engine (``AsyncVLLMBackend``, what rollout workers use): concurrent requests
are batched and give what the same requests give one at a time (vLLM seeds each request),
logprobs match the transformers recomputation, weights reload in place, and a closed engine
fails its requests with ``EngineStopped``. (The OpenAI server client's async path is checked
on the server of ``tests/rollout/test_vllm.py``.)

Skipped when ``vllm`` is not importable. The engine core runs in a child process on CPU."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.rollout.test_vllm import _request
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.backend_vllm import cpu_engine_environment, vllm_available
from workers.engines.batching import EngineStopped
from workers.rollout.agent_tasks import arithmetic_tasks
from workers.rollout.loop import arun_episode
from workers.rollout.sink import ListSink
from workers.rollout.tools import ToolRegistry

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not importable"),
]


def _requests(count: int) -> list[GenerationRequest]:
    return [GenerationRequest(sampling=SamplingParams(temperature=1.0, max_tokens=16, seed=i),
                              messages=task.messages, tools=task.tools)
            for i, task in enumerate(arithmetic_tasks(count, seed=3))]


@pytest.fixture(scope="module")
def async_engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Callable[[], Any]]:
    """The module's engine: started once and shared; started again only for a test that
    comes after one that closed it (the closing test is the module's last, so in file order
    the module starts one engine)."""
    from workers.engines.backend_vllm import AsyncVLLMBackend

    os.environ.update(cpu_engine_environment(tmp_path_factory.mktemp("vllm-async-cache")))
    started: list[Any] = []

    def engine() -> Any:
        if not started or started[-1].dead is not None:
            started.append(AsyncVLLMBackend(tiny_model_dir, distributed_executor_backend="uni",
                                            enforce_eager=True, dtype="float32",
                                            max_model_len=2048, enable_chunked_prefill=False))
        return started[-1]

    yield engine
    for started_engine in started:
        started_engine.close()


@pytest.fixture
def async_engine(async_engines: Callable[[], Any]) -> Any:
    return async_engines()


def test_concurrent_requests_equal_one_at_a_time(async_engine,
                                                 hf_backend: TransformersBackend) -> None:
    requests = _requests(12)
    alone = [async_engine.generate(r) for r in requests]

    async def together() -> list:
        return list(await asyncio.gather(*(async_engine.agenerate(r) for r in requests)))

    for single, batched in zip(alone, asyncio.run(together()), strict=True):
        np.testing.assert_array_equal(single.prompt_ids, batched.prompt_ids)
        np.testing.assert_array_equal(single.response_ids, batched.response_ids)
        np.testing.assert_allclose(
            batched.logprobs, hf_backend.score(batched.prompt_ids, batched.response_ids),
            atol=1e-4)


def test_episodes_in_flight_on_the_async_engine(async_engine,
                                                registry: ToolRegistry) -> None:
    sink = ListSink()

    async def play() -> list:
        return list(await asyncio.gather(*(
            arun_episode(task=task, backend=async_engine, tools=registry, sink=sink,
                         run_id="r", episode_id=f"e{i}",
                         sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=i))
            for i, task in enumerate(arithmetic_tasks(8, seed=4)))))

    results = asyncio.run(play())
    assert all(r.status in ("completed", "truncated", "terminated") for r in results)
    for i in range(8):
        calls = [e for e in sink.events(f"e{i}") if e.type == "llm_called"]
        assert calls and all(c.logprobs.shape == c.response_ids.shape for c in calls)


def test_weights_reload_in_place(async_engine, tiny_model_dir: Path) -> None:
    reference = TransformersBackend(tiny_model_dir)
    weights = [(name, tensor * 3) for name, tensor in reference.model.state_dict().items()]
    async_engine.update_weights(weights, version=5)
    reference.update_weights(weights, version=5)
    request = _request(temperature=0.0, max_tokens=12)
    updated, expected = async_engine.generate(request), reference.generate(request)
    assert updated.policy_version == 5
    np.testing.assert_array_equal(updated.response_ids, expected.response_ids)
    original = TransformersBackend(tiny_model_dir).model.state_dict().items()
    async_engine.update_weights(list(original), version=0)
    with pytest.raises(TypeError, match="version"):
        async_engine.update_weights([], version="6")  # type: ignore[arg-type]


def test_closed_engine_refuses_requests(tiny_model_dir: Path, async_engine) -> None:
    """Closes the module's engine: kept the module's last test."""
    from workers.engines.backend_vllm import AsyncVLLMBackend

    with pytest.raises(ValueError, match="does not exist"):
        AsyncVLLMBackend(tiny_model_dir / "missing")
    with pytest.raises(ValueError, match="logprobs_mode"):
        AsyncVLLMBackend(tiny_model_dir, logprobs_mode="raw_logprobs")
    engine = async_engine
    engine.close()
    with pytest.raises(EngineStopped, match="closed"):
        engine.generate(_request(max_tokens=4))
