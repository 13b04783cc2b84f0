"""The tiny model: deterministic build, loadable by transformers, ChatML tokenizer and template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.engines.tinymodel import (
    SPECIAL_TOKENS,
    TOKEN_MARKERS,
    build_tiny_model,
    tiny_corpus,
    tiny_model_path,
)


def _digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.iterdir()) if f.is_file()}


def test_build_is_deterministic_and_seed_dependent(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny_model_dir)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(again)["model.safetensors"]


def test_cached_path_is_reused(tiny_model_dir: Path) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path(tiny_model_dir.parent, seed=0) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_loads_in_transformers_with_the_specified_architecture(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 32)
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert config.vocab_size == len(tokenizer)
    files = {f.name for f in tiny_model_dir.iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files
    ids = torch.tensor([tokenizer.encode("What is 2 + 3?")])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_tokenizer_special_tokens_and_markers(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for token in SPECIAL_TOKENS + TOKEN_MARKERS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    text = "<think>\nhm</think><tool_call>{}</tool_call><|im_end|>"
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False),
                               skip_special_tokens=True)
    assert decoded == "<think>\nhm</think><tool_call>{}</tool_call>"
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {tokenizer.convert_tokens_to_ids(t)
                                               for t in ("<|im_end|>", "<|endoftext|>")}


def test_any_text_round_trips(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Ünïcödé ✓ 中文 {\"a\": [1, 2.5]}\n\tdef f(): pass"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_tools_reasoning_and_grouped_tool_responses(
        tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "calc",
                                               "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3 and 1+1?"},
        {"role": "assistant", "content": "", "reasoning_content": "two sums",
         "tool_calls": [
             {"id": "a", "type": "function",
              "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}},
             {"id": "b", "type": "function",
              "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "assistant", "content": "5 and 2."},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    expected_tail = (
        "<|im_start|>user\n2+3 and 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ntwo sums\n</think>\n\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n5 and 2.<|im_end|>\n"
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]) in text
    assert text.endswith(expected_tail)
    prompt = tokenizer.apply_chat_template(messages[:2], tools=tools, tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    # History is never rewritten: a conversation renders as a prefix of its continuation.
    assert text.startswith(prompt)


def test_build_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tmp_path / "x", seed=-1)
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(NotADirectoryError, match="file"):
        build_tiny_model(file)
    with pytest.raises(ValueError, match="seed"):
        tiny_model_path(tmp_path, seed=-2)
    with pytest.raises(ValueError, match="size"):
        tiny_corpus(size=0)


def test_tokenizer_config_names_the_generic_fast_class(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == "<|im_end|>"
