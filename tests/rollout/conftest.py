"""Fixtures of the rollout tests: the tiny model, built once per test session, and vLLM's
OpenAI-compatible server over it, started once for the rollout tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.engines.backend_transformers import TransformersBackend
from workers.engines.tinymodel import tiny_model_path
from workers.rollout.builtin_tools import default_tool_registry
from workers.rollout.sandbox import PythonSandbox
from workers.rollout.tools import ToolRegistry


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 model folder, built once per session in a temporary folder."""
    return tiny_model_path(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def hf_backend(tiny_model_dir: Path) -> TransformersBackend:
    """A transformers backend over the tiny model (shared: tests must not change weights)."""
    return TransformersBackend(tiny_model_dir)


@pytest.fixture
def registry() -> ToolRegistry:
    """Calculator plus a Python sandbox with short limits."""
    return default_tool_registry(sandbox=PythonSandbox(timeout_s=3.0))



@pytest.fixture(scope="package")
def vllm_server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[str]:
    """The URL of vLLM's OpenAI-compatible server over the tiny model, one for all the rollout
    tests that only generate (starting one took a minute or more on two cores, and three
    modules each started their own). Not in development mode: nothing can change its
    weights (a test that does starts a server of its own)."""
    from tests.servers import vllm_server

    with vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm-server")) as url:
        yield url
