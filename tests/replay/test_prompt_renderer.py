"""One prompt renderer: the ids rollout and the gateway send are the ids of the text replay
segments, with the tokenizer's template and with a run's own."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from tests.replay.replay_tokenizers import qwen3_tokenizer
from workers.engines.chat_template import CHAT_TEMPLATE
from workers.engines.render import ChatRenderer, prompt_ids

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "id": "c1",
                             "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "content": "5", "tool_call_id": "c1"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"},
                                               "b": {"type": "number"}}}}}]


@pytest.mark.parametrize("template", [None, CHAT_TEMPLATE], ids=["tokenizer's", "run's"])
def test_ids_are_the_encoded_text_replay_renders(template: str | None) -> None:
    tokenizer = qwen3_tokenizer()
    ids = prompt_ids(tokenizer, MESSAGES, tools=TOOLS, chat_template=template)
    text = ChatRenderer(tokenizer, chat_template=template).render(
        MESSAGES, tools=TOOLS, generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_a_custom_template_changes_the_prompt() -> None:
    tokenizer = qwen3_tokenizer()
    own = prompt_ids(tokenizer, MESSAGES[:2], chat_template="{{ messages[-1].content }}")
    assert tokenizer.decode(own) == "What is 2+3?"
    assert own != prompt_ids(tokenizer, MESSAGES[:2])


def test_inputs_are_not_changed_and_no_template_is_refused() -> None:
    tokenizer = qwen3_tokenizer()
    messages = [dict(m) for m in MESSAGES]
    prompt_ids(tokenizer, messages, tools=TOOLS)
    assert messages == MESSAGES
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat_template"):
        prompt_ids(bare, MESSAGES)
    assert prompt_ids(bare, MESSAGES[:2], chat_template="{{ messages[0].content }}") == \
        bare.encode("Be brief.", add_special_tokens=False)
