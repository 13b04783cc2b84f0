"""Fixtures of the dataset tests: Qwen3's tokenizer and the replay tests' episode scripts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "replay"))

from replay_tokenizers import qwen3_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def qwen3():
    return qwen3_tokenizer()
