"""A tiny Qwen3-architecture model with the real Qwen3 tokenizer that has learnt one tool
conversation by heart: asked for 5 plus 3 it calls ``add``, and given the tool's 8 it
answers. Trained here in seconds (teacher forcing on the two generations, loss on the
generated tokens only), so greedy decoding replays the conversation token for token: a real
model behind the gateway for the remote-rollout tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
QUESTION = [{"role": "user", "content": "What is 5 plus 3? Use the add tool."}]
REASONING_1 = "I need to add 5 and 3."
CALL = {"name": "add", "arguments": {"a": 5, "b": 3}}
REASONING_2 = "The tool returned 8."
ANSWER = "The answer is 8."


def generations() -> tuple[str, str]:
    """The two assistant turns as the model writes them (up to, not including, the end
    token)."""
    first = (f"<think>\n{REASONING_1}\n</think>\n\n<tool_call>\n{json.dumps(CALL)}\n"
             "</tool_call>")
    second = f"<think>\n{REASONING_2}\n</think>\n\n{ANSWER}"
    return first, second


def _sequences(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    first, second = generations()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(messages: list[dict[str, Any]]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=True,
                                                  add_generation_prompt=True,
                                                  return_dict=False))

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [end]

    assistant = {"role": "assistant", "content": "", "reasoning_content": REASONING_1,
                 "tool_calls": [{"id": "call-0", "type": "function",
                                 "function": {"name": "add",
                                              "arguments": json.dumps(CALL["arguments"])}}]}
    followup = [*QUESTION, assistant, {"role": "tool", "tool_call_id": "call-0",
                                       "content": "8"}]
    return [(render(QUESTION), encode(first)), (render(followup), encode(second))]


def _config(vocab_size: int, end_ids: list[int]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=end_ids[1], bos_token_id=None, eos_token_id=end_ids[0], dtype="float32",
        architectures=["Qwen3ForCausalLM"])


def build_qwen3_tool_model(directory: Path, *, steps: int = 400, seed: int = 0) -> Path:
    """Train and save the model (with the Qwen3 tokenizer) into ``directory``.

    Training a 151k-token vocabulary densely is slow on a CPU, so the model is trained over
    the few hundred tokens the conversation uses (plus one class standing for every other
    token, whose logit is held at 0), then written out at full vocabulary: the used tokens'
    embedding and output rows where they belong, every other output row 0. Greedy decoding
    then emits the conversation's tokens (their logits beat the 0 of all others)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    from workers.engines.tokenizers import qwen3_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()),
                                              local_files_only=True)
    end_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    sequences = _sequences(tokenizer)
    used = sorted({t for p, g in sequences for t in p + g} | set(end_ids))
    local = {t: i for i, t in enumerate(used)}
    other = len(used)  # the class of every token the conversation does not use
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        small = Qwen3ForCausalLM(_config(len(used) + 1, [local[e] for e in end_ids]))
    with torch.no_grad():
        small.lm_head.weight[other].zero_()
    batches = []
    for prompt, target in sequences:
        ids = torch.tensor([[local[t] for t in prompt + target[:-1]]])
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(target) - 1)
        batches.append((ids, positions, torch.tensor([local[t] for t in target])))
    optimizer = torch.optim.Adam(small.parameters(), lr=1e-2)
    small.train()
    for _ in range(steps):
        loss = torch.zeros(())
        for ids, positions, target in batches:
            hidden = small.model(input_ids=ids).last_hidden_state[0, positions]
            loss = loss + torch.nn.functional.cross_entropy(small.lm_head(hidden), target)
        optimizer.zero_grad()
        loss.backward()
        small.lm_head.weight.grad[other] = 0  # the "other" logit stays 0
        optimizer.step()
        if loss.item() < 1e-3:
            break
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(_config(len(tokenizer), end_ids))
    state = {k: v for k, v in small.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    model.load_state_dict(state, strict=False)
    index = torch.tensor(used)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[index] = small.model.embed_tokens.weight[:other]
        model.lm_head.weight.zero_()
        model.lm_head.weight[index] = small.lm_head.weight[:other]
    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=end_ids, pad_token_id=end_ids[1])
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
