"""vLLM backends (offline engine and OpenAI-compatible server) against the transformers backend.

Skipped when ``vllm`` is not importable. The offline engine runs in process on CPU
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager mode, float32) on the tiny model.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.servers import vllm_server
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_openai import OpenAIServerBackend, ServerResponseError
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.backend_vllm import VLLMBackend, cpu_engine_environment, vllm_available
from workers.rollout.agent_tasks import arithmetic_tasks
from workers.rollout.calculator import Calculator
from workers.rollout.loop import run_episode
from workers.rollout.sink import ListSink
from workers.rollout.tools import ToolRegistry

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not importable"),
]

MESSAGES = ({"role": "user", "content": "What is 12 * 7?"},)


def _request(**sampling: object) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(**sampling), messages=MESSAGES,
                             tools=(Calculator.schema,))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[VLLMBackend]:
    environment = cpu_engine_environment(tmp_path_factory.mktemp("vllm-cache"))
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        yield VLLMBackend(tiny_model_dir, distributed_executor_backend="uni",
                          enforce_eager=True, dtype="float32", max_model_len=2048, seed=0)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.9, 0.8),
                                                    (0.0, 1.0)])
def test_offline_engine_matches_transformers(engine: VLLMBackend,
                                             hf_backend: TransformersBackend,
                                             temperature: float, top_p: float) -> None:
    request = _request(temperature=temperature, top_p=top_p, max_tokens=24, seed=3)
    result = engine.generate(request)
    assert result.prompt_ids.tolist() == hf_backend.prompt_ids(request)
    assert result.response_ids.shape == result.logprobs.shape
    recomputed = hf_backend.score(result.prompt_ids, result.response_ids,
                                  temperature=temperature, top_p=top_p)
    np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)
    if temperature == 0.0:
        greedy = hf_backend.generate(request)
        assert np.array_equal(greedy.response_ids, result.response_ids)
        assert greedy.text == result.text


def test_offline_seed_and_batch(engine: VLLMBackend) -> None:
    first = engine.generate(_request(max_tokens=16, seed=21))
    again = engine.generate(_request(max_tokens=16, seed=21))
    assert np.array_equal(first.response_ids, again.response_ids)
    batch = engine.generate_batch([_request(temperature=0.0, max_tokens=8),
                                   GenerationRequest(sampling=SamplingParams(temperature=0.0,
                                                                             max_tokens=8),
                                                     prompt_ids=(1, 2, 3))])
    assert np.array_equal(batch[0].response_ids,
                          engine.generate(_request(temperature=0.0, max_tokens=8)).response_ids)
    assert batch[1].prompt_ids.tolist() == [1, 2, 3]


def test_offline_episode_records_engine_tokens(engine: VLLMBackend,
                                               hf_backend: TransformersBackend,
                                               registry: ToolRegistry) -> None:
    sink = ListSink()
    result = run_episode(task=arithmetic_tasks(1)[0], backend=engine, tools=registry,
                         sink=sink, run_id="r", episode_id="e",
                         sampling=SamplingParams(temperature=1.0, max_tokens=20, seed=0))
    assert result.status in ("completed", "truncated")
    for call in [e for e in sink.events("e") if e.type == "llm_called"]:
        np.testing.assert_allclose(
            call.logprobs, hf_backend.score(call.prompt_ids, call.response_ids), atol=1e-4)


def test_offline_weight_update(engine: VLLMBackend, tiny_model_dir: Path) -> None:
    reference = TransformersBackend(tiny_model_dir)
    weights = [(name, tensor * 3) for name, tensor in reference.model.state_dict().items()]
    engine.update_weights(weights, version=2)
    reference.update_weights(weights, version=2)
    request = _request(temperature=0.0, max_tokens=12)
    updated, expected = engine.generate(request), reference.generate(request)
    assert updated.policy_version == 2
    assert np.array_equal(updated.response_ids, expected.response_ids)
    np.testing.assert_allclose(updated.logprobs, expected.logprobs, atol=1e-4)
    original = TransformersBackend(tiny_model_dir).model.state_dict().items()
    engine.update_weights(list(original), version=3)  # restore for other tests
    with pytest.raises(TypeError, match="version"):
        engine.update_weights([], version="4")  # type: ignore[arg-type]


def test_offline_bad_arguments(tmp_path: Path, engine: VLLMBackend) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        VLLMBackend(tmp_path / "missing")
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMBackend(tmp_path, logprobs_mode="raw_logprobs")
    with pytest.raises(ValueError, match="leaves no room"):
        engine.generate(GenerationRequest(sampling=SamplingParams(), prompt_ids=(5,) * 2048))


@pytest.fixture
def dev_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """A vLLM server of the test's own in development mode (the weight-update routes): a
    reload from a missing folder leaves the server unable to load weights again, so no other
    test may share it."""
    folder = tmp_path / "vllm-server"
    folder.mkdir()
    with vllm_server(tiny_model_dir, folder, env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url


def _chat_and_completions_return_engine_tokens(server: str,
                                                hf_backend: TransformersBackend) -> None:
    """The chat and completions routes of ``server`` return the engine's tokens and their
    logprobs (the transformers recomputation's); an unknown model name is a 404."""
    client = OpenAIServerBackend(server, model="tiny")
    chat = _request(temperature=0.8, top_p=0.9, max_tokens=20, seed=4)
    rendered = tuple(hf_backend.prompt_ids(chat))
    completion = GenerationRequest(sampling=chat.sampling, prompt_ids=rendered)
    try:
        for request in (chat, completion):
            result = client.generate(request)
            assert result.prompt_ids.tolist() == list(rendered)
            assert result.response_ids.shape == result.logprobs.shape == (20,)
            recomputed = hf_backend.score(result.prompt_ids, result.response_ids,
                                          temperature=0.8, top_p=0.9)
            np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)
        wrong = OpenAIServerBackend(server, model="not-served")
        with pytest.raises(ServerResponseError, match="returned 404"):
            wrong.generate(chat)
        wrong.close()
    finally:
        client.close()


def _async_path_matches_sync(server: str) -> None:
    """The client's async path (concurrent requests on one connection pool) gives what its
    sync path gives, request by request; a pool of no connections is refused."""
    client = OpenAIServerBackend(server, model="tiny", max_connections=4)
    requests = [GenerationRequest(sampling=SamplingParams(temperature=1.0, max_tokens=16,
                                                          seed=i),
                                  messages=task.messages, tools=task.tools)
                for i, task in enumerate(arithmetic_tasks(8, seed=3))]
    try:
        alone = [client.generate(r) for r in requests]

        async def together() -> list:
            return list(await asyncio.gather(*(client.agenerate(r) for r in requests)))

        for single, concurrent in zip(alone, asyncio.run(together()), strict=True):
            np.testing.assert_array_equal(single.response_ids, concurrent.response_ids)
    finally:
        client.close()
    with pytest.raises(ValueError, match="max_connections"):
        OpenAIServerBackend(server, model="tiny", max_connections=0)


@pytest.mark.slow
def test_server_returns_engine_tokens_and_reloads_a_checkpoint(
        dev_server: str, hf_backend: TransformersBackend, tiny_model_dir: Path,
        tmp_path: Path, store: Any) -> None:
    """The server's chat and completions routes return the engine's tokens, and the client's
    async path gives what its sync path gives (checked first, on the base weights: one
    server start for all three). A remote server wrapped as a rollout
    engine loads the checkpoint ``policy_updated`` names through its weight-update route,
    serves the new weights, and reports the version under its own address; back to the base
    weights for another run."""
    _chat_and_completions_return_engine_tokens(dev_server, hf_backend)
    _async_path_matches_sync(dev_server)
    import uuid

    from safetensors.torch import save_file

    from store.eventlog import NO_STREAM, run_stream_id
    from store.events import PolicyUpdated, RunCreated
    from store.serving import policy_takeup
    from workers.rollout.group_log import PolicyState, StoreGroupLog
    from workers.rollout.worker_engine import RolloutEngine

    reference = TransformersBackend(tiny_model_dir)
    checkpoint = tmp_path / "v000001"
    checkpoint.mkdir()
    weights = {name: (tensor * 3).contiguous()
               for name, tensor in reference.model.state_dict().items()}
    save_file(weights, str(checkpoint / "model.safetensors"))
    run_id = f"srv-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id)], NO_STREAM)
    store.append(run_stream_id(run_id), [PolicyUpdated(version=1, step=1,
                                                       checkpoint=str(checkpoint))])
    client = OpenAIServerBackend(dev_server, model="tiny")
    request = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=12),
                                prompt_ids=tuple(reference.prompt_ids(_request())))
    try:
        base = client.generate(request)
        engine = RolloutEngine(client, kind="vllm-server", model_dir=tiny_model_dir)
        log = StoreGroupLog(store)
        engine.ensure(run_id, log.policy(run_id), report=log.policy_served)
        reference.update_weights(weights.items(), version=1)
        updated, expected = client.generate(request), reference.generate(request)
        assert updated.policy_version == 1 and engine.loads == 1
        assert np.array_equal(updated.response_ids, expected.response_ids)
        np.testing.assert_allclose(updated.logprobs, expected.logprobs, atol=1e-4)
        (version,) = policy_takeup(store, run_id)
        (took,) = version.engines
        assert (took.engine, took.backend, took.source) == (
            dev_server, "OpenAIServerBackend", str(checkpoint))
        assert took.lag_seconds is not None and took.lag_seconds >= 0

        engine.ensure("another-run", PolicyState(0))  # the base weights, from its folder
        again = client.generate(request)
        assert again.policy_version == 0
        assert np.array_equal(again.response_ids, base.response_ids)
        np.testing.assert_allclose(again.logprobs, base.logprobs, atol=1e-4)
        with pytest.raises(TypeError, match="update_weights_from"):
            client.update_weights([], version=2)
        with pytest.raises(ValueError, match="version must be >= 0"):
            client.update_weights_from(checkpoint, version=-1)
        with pytest.raises(TypeError, match="version must be an integer"):
            client.update_weights_from(checkpoint, version="2")  # type: ignore[arg-type]
        with pytest.raises(ServerResponseError, match="returned"):
            client.update_weights_from(tmp_path / "missing", version=2)
        assert client.policy_version == 0
    finally:
        client.close()
