"""The generation backends a rollout worker builds by name (``workers.engines.registry``)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from store.settings import Settings
from trajstore.cli import Backend
from workers.engines.backend import GenerationBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.registry import BACKENDS, make_backend


def test_the_setting_and_the_command_line_name_the_registered_backends() -> None:
    """``store`` cannot import ``workers``, so the setting spells the names again: the three
    spellings are held to one another here."""
    setting = typing.get_args(Settings.model_fields["rollout_backend"].annotation)
    assert sorted(setting) == list(BACKENDS.names()) == sorted(b.value for b in Backend)


def test_a_name_registered_twice_is_refused() -> None:
    before = BACKENDS.get("transformers")
    with pytest.raises(ValueError, match="'transformers' is already registered"):
        BACKENDS.register("transformers")
    assert BACKENDS.get("transformers") is before


def test_an_unknown_name_fails_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown rollout_backend 'sglang'; known: "
                                         r"transformers, vllm"):
        make_backend("sglang", tmp_path, settings=Settings(data_dir=tmp_path))


def test_make_backend_builds_the_named_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, rollout_max_batch=3)
    backend = make_backend("transformers", tiny_model_dir, settings=settings)
    assert isinstance(backend, TransformersBackend) and isinstance(backend, GenerationBackend)
    assert backend.max_batch == 3
