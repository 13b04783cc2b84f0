"""Tokenizers shared by the replay tests (built once per session; all offline)."""

from __future__ import annotations

import pytest
from replay_tokenizers import llama_style_tokenizer, metaspace_tokenizer, qwen3_tokenizer


@pytest.fixture(scope="session")
def qwen3():
    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def llama():
    return llama_style_tokenizer()


@pytest.fixture(scope="session")
def metaspace():
    return metaspace_tokenizer()
