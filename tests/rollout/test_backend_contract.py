"""The generation backend contract (``workers.engines.backend``), written once and run against
every backend: transformers, the replay backend, the remote trainer's completions endpoint,
vLLM's offline engine, vLLM's async engine and the OpenAI-compatible vLLM server.

What every backend promises for a :class:`GenerationRequest`: the prompt ids the engine saw
(for messages, the tiny model's chat template rendered with the generation prompt), int32
response ids of at most ``max_tokens``, one float32 log-probability per response token under
the sampling distribution (what the transformers backend recomputes), a finish reason,
the same response for the same seed, the text cut before a stop string, and a TypeError for
anything that is not a request. Where a backend differs by design the subject says so
(``samples``: the replay backend forces recorded output instead of sampling, so greedy
decoding, seeds and stop strings do not apply to it).

The vLLM subjects are marked and skipped as the other vLLM tests are; each engine is started
for the whole module and stopped before the next subject starts; the server is the one the
rollout tests share (``tests/rollout/conftest.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.rollout.remote_trainer import TrainerServer
from workers.engines.backend import GenerationRequest, GenerationResult, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.backend_vllm import cpu_engine_environment, vllm_available
from workers.engines.prompt import end_of_turn_ids
from workers.engines.render import prompt_ids
from workers.rollout.calculator import Calculator

MESSAGES = ({"role": "user", "content": "What is 12 * 7? Use the calculator."},)
TOOLS = (Calculator.schema,)
SCRIPT = "<think>\nsmall numbers\n</think>\n\nIt is 84, twelve times seven."

_VLLM = [pytest.mark.vllm,
         pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")]
_SLOW_VLLM = [*_VLLM, pytest.mark.slow]


@dataclass
class Subject:
    """One backend under the contract: ``make()`` gives a backend ready for one request
    (stateful backends, a remote rollout or a replay script, get a new one each time)."""

    name: str
    make: Callable[[], Any]
    samples: bool = True

    def generate(self, request: GenerationRequest) -> GenerationResult:
        backend = self.make()
        return backend.generate(request)


def _request(**sampling: Any) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(**sampling), messages=MESSAGES,
                             tools=TOOLS)


@pytest.fixture(scope="module")
def vllm_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    environment = cpu_engine_environment(tmp_path_factory.mktemp("vllm-contract-cache"))
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module", params=[
    "transformers", "replay", "remote-trainer",
    pytest.param("vllm-offline", marks=_VLLM),
    pytest.param("vllm-async", marks=_SLOW_VLLM),
    pytest.param("openai-server", marks=_SLOW_VLLM),
])
def subject(request: pytest.FixtureRequest, hf_backend: TransformersBackend,
            tiny_model_dir: Path) -> Iterator[Subject]:
    kind = request.param
    if kind == "transformers":
        yield Subject(kind, lambda: hf_backend)
    elif kind == "replay":
        from workers.engines.backend_replay import ReplayBackend

        yield Subject(kind, lambda: ReplayBackend(hf_backend, [SCRIPT]), samples=False)
    elif kind == "remote-trainer":
        from workers.engines.backend_remote import RemoteTrainerBackend

        with TrainerServer(hf_backend) as server:
            yield Subject(kind, lambda: RemoteTrainerBackend(
                server.url, rollout_id=uuid.uuid4().hex, tokenizer=hf_backend.tokenizer))
    elif kind == "vllm-offline":
        from workers.engines.backend_vllm import VLLMBackend

        request.getfixturevalue("vllm_environment")
        engine = VLLMBackend(tiny_model_dir, distributed_executor_backend="uni",
                             enforce_eager=True, dtype="float32", max_model_len=2048, seed=0)
        yield Subject(kind, lambda: engine)
    elif kind == "vllm-async":
        from workers.engines.backend_vllm import AsyncVLLMBackend

        request.getfixturevalue("vllm_environment")
        async_engine = AsyncVLLMBackend(tiny_model_dir, distributed_executor_backend="uni",
                                        enforce_eager=True, dtype="float32",
                                        max_model_len=2048, enable_chunked_prefill=False)
        try:
            yield Subject(kind, lambda: async_engine)
        finally:
            async_engine.close()
    else:
        from workers.engines.backend_openai import OpenAIServerBackend

        client = OpenAIServerBackend(request.getfixturevalue("vllm_server_url"), model="tiny")
        try:
            yield Subject(kind, lambda: client)
        finally:
            client.close()


def test_result_has_the_documented_shapes_and_types(subject: Subject) -> None:
    result = subject.generate(_request(temperature=1.0, max_tokens=12, seed=5))
    assert isinstance(result, GenerationResult)
    assert result.prompt_ids.dtype == np.int32 and result.prompt_ids.ndim == 1
    assert result.prompt_ids.shape[0] > 0
    assert result.response_ids.dtype == np.int32 and result.response_ids.ndim == 1
    assert 1 <= result.response_ids.shape[0] <= 12
    assert result.logprobs.dtype == np.float32
    assert result.logprobs.shape == result.response_ids.shape
    assert np.isfinite(result.logprobs).all() and (result.logprobs <= 0).all()
    assert result.finish_reason in ("stop", "length")
    assert isinstance(result.text, str) and result.policy_version == 0


def test_prompt_ids_are_the_chat_template_rendering(subject: Subject,
                                                    hf_backend: TransformersBackend) -> None:
    result = subject.generate(_request(max_tokens=4, seed=1))
    assert result.prompt_ids.tolist() == prompt_ids(hf_backend.tokenizer, MESSAGES,
                                                    tools=TOOLS)


def test_given_prompt_ids_are_what_the_engine_sees(subject: Subject) -> None:
    if subject.name == "remote-trainer":
        # The remote-rollout protocol carries messages: token ids are refused, by name.
        with pytest.raises(ValueError, match="prompt_ids"):
            subject.generate(GenerationRequest(sampling=SamplingParams(max_tokens=4),
                                               prompt_ids=(1, 2, 3)))
        return
    result = subject.generate(GenerationRequest(sampling=SamplingParams(max_tokens=4, seed=2),
                                                prompt_ids=(1, 2, 3)))
    assert result.prompt_ids.tolist() == [1, 2, 3]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_are_those_of_the_sampling_distribution(
        subject: Subject, hf_backend: TransformersBackend, temperature: float,
        top_p: float) -> None:
    result = subject.generate(_request(temperature=temperature, top_p=top_p, max_tokens=16,
                                       seed=3))
    recomputed = hf_backend.score(result.prompt_ids, result.response_ids,
                                  temperature=temperature, top_p=top_p)
    np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)


def test_max_tokens_bounds_the_response(subject: Subject,
                                        hf_backend: TransformersBackend) -> None:
    result = subject.generate(_request(temperature=1.0, max_tokens=1, seed=4))
    assert result.response_ids.shape[0] == 1
    ended = int(result.response_ids[-1]) in end_of_turn_ids(hf_backend.tokenizer)
    assert result.finish_reason == ("stop" if ended else "length")


def test_greedy_and_seeded_sampling_are_reproducible(
        subject: Subject, hf_backend: TransformersBackend) -> None:
    if not subject.samples:
        pytest.skip(f"{subject.name} forces recorded output; it does not sample")
    greedy = subject.generate(_request(temperature=0.0, max_tokens=10))
    reference = hf_backend.generate(_request(temperature=0.0, max_tokens=10))
    assert greedy.response_ids.tolist() == reference.response_ids.tolist()
    assert greedy.text == reference.text
    first = subject.generate(_request(temperature=1.0, max_tokens=16, seed=11))
    again = subject.generate(_request(temperature=1.0, max_tokens=16, seed=11))
    assert first.response_ids.tolist() == again.response_ids.tolist()


def test_a_stop_string_ends_the_response_and_cuts_the_text(subject: Subject) -> None:
    if not subject.samples:
        pytest.skip(f"{subject.name} forces recorded output, stop strings included")
    free = subject.generate(_request(temperature=0.0, max_tokens=30))
    text = free.text
    start = next(i for i in range(4, len(text) - 3)
                 if text.find(text[i:i + 3]) == i and text[i:i + 3].strip() == text[i:i + 3])
    stop = text[start:start + 3]
    stopped = subject.generate(_request(temperature=0.0, max_tokens=30, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:start] and stop not in stopped.text
    length = stopped.response_ids.shape[0]
    assert stopped.response_ids.tolist() == free.response_ids[:length].tolist()


def test_anything_but_a_request_is_refused(subject: Subject) -> None:
    with pytest.raises(TypeError, match="GenerationRequest"):
        subject.generate({"prompt": [1, 2]})  # type: ignore[arg-type]
