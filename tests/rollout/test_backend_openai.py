"""The OpenAI-compatible server client: argument checks and error answers.

Requests against a real vLLM server are in ``test_vllm.py`` (they need vLLM installed).
"""

from __future__ import annotations

import pytest

from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_openai import OpenAIServerBackend, ServerResponseError


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIServerBackend("localhost:8000", model="m")
    with pytest.raises(ValueError, match="model"):
        OpenAIServerBackend("http://localhost:8000", model="")
    client = OpenAIServerBackend("http://127.0.0.1:9", model="m", timeout_s=2)
    with pytest.raises(TypeError, match="GenerationRequest"):
        client.generate({"prompt": [1]})  # type: ignore[arg-type]
    client.close()


def test_request_bodies_follow_the_protocol() -> None:
    client = OpenAIServerBackend("http://127.0.0.1:9", model="m")
    params = SamplingParams(temperature=0.5, max_tokens=7, seed=2, stop=("END",))
    chat = client.request_body(GenerationRequest(sampling=params,
                                          messages=({"role": "user", "content": "hi"},),
                                          tools=({"type": "function",
                                                  "function": {"name": "f"}},)))
    assert chat["return_token_ids"] is True and chat["logprobs"] is True
    assert chat["top_logprobs"] == 0 and chat["tool_choice"] == "none"
    assert (chat["seed"], chat["stop"], chat["max_tokens"]) == (2, ["END"], 7)
    completion = client.request_body(GenerationRequest(sampling=params, prompt_ids=(4, 5)))
    assert completion["prompt"] == [4, 5] and completion["logprobs"] == 0
    assert "messages" not in completion
    client.close()


def test_unreachable_server_raises_a_connection_error() -> None:
    import httpx

    client = OpenAIServerBackend("http://127.0.0.1:9", model="m", timeout_s=2)
    with pytest.raises(httpx.ConnectError):
        client.generate(GenerationRequest(sampling=SamplingParams(), prompt_ids=(1,)))
    client.close()
    assert issubclass(ServerResponseError, RuntimeError)
