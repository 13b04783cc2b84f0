"""Prompt segmentation with Qwen3's real tokenizer and chat template, including tool calls,
grouped tool responses and the template's rewriting of earlier assistant turns."""

from __future__ import annotations

import pytest
from replay_episodes import SEARCH_TOOL, Script, tool_call

from workers.replay.errors import PromptMismatchError, ReplayError, SegmentationError
from workers.replay.initial import build_initial_timeline
from workers.replay.segment import Segmenter

TOOLS = [SEARCH_TOOL]


def prompt_ids(tok, messages, *, tools=TOOLS, **template_kwargs) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=True, **template_kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def segments(tok, messages, *, tools=TOOLS, ids=None):
    seg = Segmenter(tok).segment(messages, tools=tools,
                                 prompt_ids=ids if ids is not None else prompt_ids(tok, messages,
                                                                                  tools=tools))
    texts = [tok.decode(m, skip_special_tokens=False) for m in seg.message_ids]
    # The segments and the generation prompt are the prompt ids, in order, nothing lost.
    flat = [i for m in seg.message_ids for i in m] + seg.generation_prompt_ids
    assert flat == (ids if ids is not None else prompt_ids(tok, messages, tools=tools))
    return seg, texts, tok.decode(seg.generation_prompt_ids, skip_special_tokens=False)


CALL_X = tool_call("search", {"query": "x"}, "c1")
CALL_Y = tool_call("search", {"query": "y"}, "c2")


def test_tool_flow_with_reasoning(qwen3) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Find x and y."},
        {"role": "assistant", "content": "Searching both.", "reasoning_content": "Two calls.",
         "tool_calls": [CALL_X, CALL_Y]},
        {"role": "tool", "tool_call_id": "c1", "content": "x is 1"},
        {"role": "tool", "tool_call_id": "c2", "content": "y is 2"},
    ]
    seg, texts, gen = segments(qwen3, messages)
    assert seg.relocated == []
    assert texts[0].startswith("<|im_start|>system\nYou are helpful.\n\n# Tools")
    assert texts[0].endswith("</tool_call><|im_end|>")
    assert texts[1] == "\n<|im_start|>user\nFind x and y.<|im_end|>"
    assert texts[2] == (
        '\n<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nSearching both.\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "y"}}\n</tool_call><|im_end|>')
    assert texts[3] == "\n<|im_start|>user\n<tool_response>\nx is 1\n</tool_response>"
    assert texts[4] == "\n<tool_response>\ny is 2\n</tool_response><|im_end|>"
    assert gen == "\n<|im_start|>assistant\n"


def test_final_assistant_turn_without_reasoning_is_relocated(qwen3) -> None:
    # As the last message, Qwen3 writes an empty <think></think> block into the assistant
    # turn; once a tool response follows it does not.
    messages = [
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": "", "tool_calls": [CALL_X]},
        {"role": "tool", "tool_call_id": "c1", "content": "x is 1"},
    ]
    seg, texts, _ = segments(qwen3, messages)
    assert seg.relocated == [1]
    assert texts[1] == ('\n<|im_start|>assistant\n<tool_call>\n{"name": "search", '
                        '"arguments": {"query": "x"}}\n</tool_call><|im_end|>')
    assert texts[2] == "\n<|im_start|>user\n<tool_response>\nx is 1\n</tool_response><|im_end|>"


def test_reasoning_stripped_before_a_later_user_query(qwen3) -> None:
    messages = [
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Search it.",
         "tool_calls": [CALL_X]},
        {"role": "tool", "tool_call_id": "c1", "content": "same"},
        {"role": "tool", "tool_call_id": "c1", "content": "same"},
        {"role": "assistant", "content": "x is 1.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks, and y?"},
    ]
    seg, texts, gen = segments(qwen3, messages, tools=None)
    assert seg.relocated == [1, 2, 3, 4]
    assert texts[1] == ('\n<|im_start|>assistant\nLooking.\n<tool_call>\n{"name": "search", '
                        '"arguments": {"query": "x"}}\n</tool_call><|im_end|>')
    assert texts[2] == "\n<|im_start|>user\n<tool_response>\nsame\n</tool_response>"
    assert texts[3] == "\n<tool_response>\nsame\n</tool_response><|im_end|>"
    assert texts[4] == "\n<|im_start|>assistant\nx is 1.<|im_end|>"
    assert texts[5] == "\n<|im_start|>user\nThanks, and y?<|im_end|>"
    assert gen == "\n<|im_start|>assistant\n"


def test_non_ascii_content(qwen3) -> None:
    messages = [{"role": "user", "content": "Température à Paris ? 🚀 中文"},
                {"role": "assistant", "content": "21 °C — ensoleillé."},
                {"role": "user", "content": "Merci ✓"}]
    _, texts, _ = segments(qwen3, messages, tools=None)
    assert texts == ["<|im_start|>user\nTempérature à Paris ? 🚀 中文<|im_end|>",
                     "\n<|im_start|>assistant\n21 °C — ensoleillé.<|im_end|>",
                     "\n<|im_start|>user\nMerci ✓<|im_end|>"]


def test_generation_prompt_from_template_options_is_accepted(qwen3) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    ids = prompt_ids(qwen3, messages, tools=None, enable_thinking=False)
    _, texts, gen = segments(qwen3, messages, tools=None, ids=ids)
    assert texts == ["<|im_start|>user\nHi<|im_end|>"]
    assert gen == "\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_generated_turn_equals_its_later_segment_token_for_token(qwen3) -> None:
    script = Script(qwen3, tools=TOOLS)
    first = [{"role": "user", "content": "Find x."}]
    answer = {"role": "assistant", "content": "Looking.", "reasoning_content": "Search it.",
              "tool_calls": [CALL_X]}
    c1 = script.call(first, answer)
    second = [*first, answer, {"role": "tool", "tool_call_id": "c1", "content": "x is 1"}]
    c2 = script.call(second, {"role": "assistant", "content": "x is 1."})
    segmenter = Segmenter(qwen3)
    t1, t2 = (build_initial_timeline(agent=c.agent, messages=c.messages, tools=c.tools,
                                     prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                                     logprobs=c.logprobs, response=c.response,
                                     finish_reason=c.finish_reason, segmenter=segmenter)
              for c in (c1, c2))
    assert t1.messages[1].token_ids == t2.messages[1].token_ids
    assert qwen3.decode(t1.messages[1].token_ids).startswith("\n<|im_start|>assistant\n<think>")
    assert t1.messages[1].sampled == [0] * 4 + [1] * len(c1.response_ids)


def test_initial_timeline_refuses_bad_arguments(qwen3) -> None:
    script = Script(qwen3, tools=TOOLS)
    call = script.call([{"role": "user", "content": "Find x."}],
                       {"role": "assistant", "content": "x is 1."})
    args = dict(agent=call.agent, messages=call.messages, tools=call.tools,
                prompt_ids=call.prompt_ids, response_ids=call.response_ids,
                logprobs=call.logprobs, response=call.response,
                finish_reason=call.finish_reason)
    timeline = build_initial_timeline(**args, segmenter=Segmenter(qwen3))
    assert timeline.agent == call.agent and timeline.tools == call.tools
    assert timeline.tools is not call.tools and len(timeline) == 2
    for bad, match in ((dict(agent=""), "agent must be a non-empty string"),
                       (dict(agent=7), "agent must be a non-empty string"),
                       (dict(segmenter="s"), "segmenter must be a Segmenter"),
                       (dict(messages=[]), "no request messages")):
        with pytest.raises((TypeError, ReplayError), match=match):
            build_initial_timeline(**{**args, "segmenter": Segmenter(qwen3), **bad})
    with pytest.raises(ReplayError, match="cannot render"):
        build_initial_timeline(**{**args, "tools": "calculator"}, segmenter=Segmenter(qwen3))
    with pytest.raises(ReplayError, match="logprobs has 1 entries"):
        build_initial_timeline(**{**args, "logprobs": [0.0]}, segmenter=Segmenter(qwen3))


def test_prompt_of_other_messages_is_refused(qwen3) -> None:
    messages = [{"role": "user", "content": "Find x."}]
    ids = prompt_ids(qwen3, [{"role": "user", "content": "Find y."}], tools=None)
    with pytest.raises(PromptMismatchError, match="not a rendering of the request messages"):
        Segmenter(qwen3).segment(messages, prompt_ids=ids, call_id="c-9")
    with pytest.raises(PromptMismatchError, match="'c-9'"):
        Segmenter(qwen3).segment(messages, prompt_ids=ids, call_id="c-9")


def test_prompt_with_an_unrecorded_message_is_refused(qwen3) -> None:
    messages = [{"role": "user", "content": "Find x."}]
    ids = prompt_ids(qwen3, [*messages, {"role": "assistant", "content": "Sure."},
                             {"role": "user", "content": "Now."}], tools=None)
    with pytest.raises(PromptMismatchError, match="not a rendering"):
        Segmenter(qwen3).segment(messages, prompt_ids=ids)


def test_template_that_cuts_through_a_message_is_reported(qwen3) -> None:
    # Rewrites part of the last message's text: the prefix rendering disagrees inside it.
    rewriting = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
                 "{%- if loop.last %}{{ m.content | replace('there', 'THERE') }}"
                 "{%- else %}{{ m.content }}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}")
    messages = [{"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "general kenobi"}]
    text = qwen3.apply_chat_template(messages, tokenize=False, chat_template=rewriting)
    ids = qwen3(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(SegmentationError, match="cuts through message 0") as info:
        Segmenter(qwen3, chat_template=rewriting).segment(messages, prompt_ids=ids)
    assert info.value.message_index == 0


def test_system_prompt_folded_into_the_first_user_turn(qwen3) -> None:
    # Gemma-style: the system text is written inside the first user turn; the system message
    # keeps only what the template writes for it (nothing here), the user segment carries it.
    folding = ("{%- set sys = messages[0].content if messages[0].role == 'system' else '' %}"
               "{%- for m in messages if m.role != 'system' %}"
               "{{ '<|im_start|>' + m.role + '\\n' }}{%- if loop.first and sys %}"
               "{{ sys + '\\n\\n' }}{%- endif %}{{ m.content + '<|im_end|>\\n' }}"
               "{%- endfor %}")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}]
    text = qwen3.apply_chat_template(messages, tokenize=False, chat_template=folding)
    ids = qwen3(text, add_special_tokens=False)["input_ids"]
    seg = Segmenter(qwen3, chat_template=folding).segment(messages, prompt_ids=ids)
    assert seg.message_ids[0] == []
    assert qwen3.decode(seg.message_ids[1]) == "<|im_start|>user\nBe brief.\n\nHi<|im_end|>"


def test_template_errors_and_bad_arguments(qwen3) -> None:
    strict = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(SegmentationError, match="roles must alternate"):
        Segmenter(qwen3, chat_template=strict).segment([{"role": "user", "content": "x"}],
                                                       prompt_ids=[1])
    with pytest.raises(TypeError, match="non-empty list of message mappings"):
        Segmenter(qwen3).segment([], prompt_ids=[1])
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        Segmenter(qwen3).segment([{"content": "no role"}], prompt_ids=[1])
    with pytest.raises(TypeError, match="chat_template must be a string"):
        Segmenter(qwen3, chat_template=3)  # type: ignore[arg-type]
