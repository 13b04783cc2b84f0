"""A tiny Qwen3 model and tokenizer built locally from a config, for tests, demos and benchmarks.

Nothing is downloaded: the byte-level BPE tokenizer is trained in memory on a small generated
corpus (arithmetic, tool calls, Python, English) and the model weights are randomly initialised
from a seed. The folder written by :func:`build_tiny_model` holds ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files, so that both
``transformers`` and vLLM load it like any Hugging Face checkpoint.

Architecture: ``Qwen3ForCausalLM`` with hidden size 64, 2 layers, 2 query heads and 1 key/value
head of ``head_dim`` 32 (vLLM's CPU attention accepts head sizes 32, 64, 80, …), untied input and
output embeddings (weights are later pushed into inference engines tensor by tensor).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from workers.engines.chat_template import CHAT_TEMPLATE, TOOL_SYSTEM_PREAMBLE
from workers.engines.transformers_lock import LOCK

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "SPECIAL_TOKENS",
    "TINY_MODEL_VERSION",
    "TOKEN_MARKERS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "tiny_corpus",
    "tiny_model_path",
]

#: Bump when the recipe changes, so that cached folders of an older recipe are not reused.
TINY_MODEL_VERSION = 2

#: ChatML control tokens: special (skipped when decoding with ``skip_special_tokens``).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Markup tokens that stay visible in decoded text (as in Qwen3, they are not "special").
TOKEN_MARKERS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

_VOCAB_SIZE = 768
_HIDDEN = 64
_LAYERS = 2
_HEADS = 2
_KV_HEADS = 1
_HEAD_DIM = 32
_INTERMEDIATE = 128
_MAX_POSITIONS = 4096

_WORDS = (
    "the a an and or but if then else when while for with without into onto from to of in on "
    "at by about over under between after before during model agent tool call result answer "
    "number sum product difference quotient value error retry function argument name python "
    "code print return list dict string integer float compute calculate check verify think "
    "step first second next finally because so therefore we need use get give find the total "
    "user assistant system question please thanks weather city temperature search query file "
    "read write open close time date price order book flight hotel email send message"
).split()

_CODE_SNIPPETS = (
    "print(sum(range(10)))",
    "x = 3\ny = 4\nprint(x * y)",
    "import math\nprint(math.sqrt(16))",
    "def f(n):\n    return n * 2\nprint(f(21))",
    "values = [1, 2, 3]\nprint(len(values))",
    "for i in range(3):\n    print(i)",
    "result = {'a': 1}\nprint(result['a'])",
)


def tiny_corpus(*, seed: int = 0, size: int = 3000) -> list[str]:
    """Generate the training corpus of the tiny tokenizer, deterministically from ``seed``.

    Returns ``size`` short documents mixing arithmetic questions, calculator and Python tool
    calls with ``<think>`` reasoning, tool responses, code and English word salad.
    Raises ValueError when ``size`` is not a positive integer.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    rng = random.Random(seed)
    ops = ["+", "-", "*", "/", "//", "%", "**"]
    docs: list[str] = [TOOL_SYSTEM_PREAMBLE]
    for index in range(size):
        kind = index % 5
        a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(0, 50)
        expression = f"{a} {rng.choice(ops[:4])} {b} {rng.choice(ops[:3])} {c}"
        if kind == 0:
            docs.append(f"What is {expression}? Use the calculator tool.")
        elif kind == 1:
            arguments = json.dumps({"expression": expression})
            docs.append(
                "<think>\nI need to compute the value, so I call the calculator.\n</think>\n\n"
                f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'
            )
        elif kind == 2:
            code = rng.choice(_CODE_SNIPPETS)
            arguments = json.dumps({"code": code})
            docs.append(
                "<think>\nLet me run some python code.\n</think>\n\n"
                f'<tool_call>\n{{"name": "python", "arguments": {arguments}}}\n</tool_call>'
            )
        elif kind == 3:
            docs.append(
                f"<tool_response>\n{rng.randint(-5000, 5000)}\n</tool_response>"
                f" The answer is {rng.randint(0, 99999)}."
            )
        else:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 20))]
            docs.append(" ".join(words).capitalize() + ".")
    return docs


def build_tiny_tokenizer(*, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer in memory and wrap it as a fast HF tokenizer.

    ChatML control tokens get ids 0, 1, 2 (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``);
    the markup tokens (``<think>`` … ``</tool_response>``) follow and are kept when decoding.
    ``eos_token`` is ``<|im_end|>``, ``pad_token`` is ``<|endoftext|>`` and the chat template is
    :data:`workers.engines.chat_template.CHAT_TEMPLATE`. Any text can be encoded (the initial
    alphabet holds all 256 bytes). Raises ValueError for a negative ``seed``.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS) + list(TOKEN_MARKERS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus(seed=seed), trainer=trainer)
    # Markers must not be special: decoders keep them, as Qwen3 does for <think> and <tool_call>.
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False)
                          for marker in TOKEN_MARKERS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        model_max_length=_MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(directory: str | os.PathLike[str], *, seed: int = 0,
                     hidden_size: int = _HIDDEN, layers: int = _LAYERS,
                     heads: int = _HEADS) -> Path:
    """Build the tiny Qwen3 model and tokenizer from ``seed`` and save both into ``directory``.

    ``hidden_size``, ``layers`` and ``heads`` (query heads of ``head_dim`` 32, one key/value
    head; the MLP is twice the hidden size) widen the default 64 × 2 × 2 for a policy that
    must learn more than the tests need; each must be a positive integer (ValueError).

    Deterministic: the same seed writes byte-identical weights and tokenizer files. The folder
    is created if missing; existing files of the same names are overwritten. Weights are
    float32 safetensors. Returns the folder path. Raises ValueError for a negative ``seed`` and
    NotADirectoryError when ``directory`` exists as a file.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    for name, value in (("hidden_size", hidden_size), ("layers", layers), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"directory {str(path)!r} exists and is not a folder")
    import torch

    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer(seed=seed)
    eos_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"),
               tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=_INTERMEDIATE * hidden_size // _HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_KV_HEADS,
        head_dim=_HEAD_DIM,
        max_position_embeddings=_MAX_POSITIONS,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        dtype="float32",
        architectures=["Qwen3ForCausalLM"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # transformers 5 records its own class name; the generic fast class loads in 4.x as well.
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    return path


def tiny_model_path(data_dir: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Return the folder of the tiny model for ``seed`` under ``data_dir``, building it once.

    The folder name carries the recipe version and the seed. Building happens in a temporary
    sibling folder that is renamed into place, so concurrent callers never see a half-written
    model (the loser of a race discards its copy). Raises ValueError for a negative ``seed``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tiny-qwen3-v{TINY_MODEL_VERSION}-seed{seed}"
    if (target / "model.safetensors").exists():
        return target
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
    try:
        build_tiny_model(staging, seed=seed)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target

