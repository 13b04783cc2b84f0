"""Prompt segmentation with a second template family: Llama-3-style header blocks over a
byte-level BPE trained for the tests, tool calls as JSON and tool results as ``ipython``."""

from __future__ import annotations

from replay_episodes import SEARCH_TOOL, Script, tool_call

from workers.replay.initial import build_initial_timeline
from workers.replay.segment import Segmenter
from workers.replay.timeline import MergePolicy, loss_mask, plan_merge

TOOLS = [SEARCH_TOOL]
CALL = tool_call("search", {"query": "weather in Paris"}, "c1")


def test_tool_flow_segments(llama) -> None:
    messages = [
        {"role": "system", "content": "  You are a helpful assistant.  "},
        {"role": "user", "content": "What is the weather in Paris today?"},
        {"role": "assistant", "content": "Let me look that up.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 degrees"},
    ]
    text = llama.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    ids = llama(text, add_special_tokens=False)["input_ids"]
    seg = Segmenter(llama).segment(messages, tools=TOOLS, prompt_ids=ids)
    texts = [llama.decode(m, skip_special_tokens=False) for m in seg.message_ids]
    assert seg.relocated == []
    assert texts[0].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>"
                               "\n\nEnvironment: ipython")
    assert texts[0].endswith("\n\nYou are a helpful assistant.<|eot_id|>")
    assert texts[1] == ("<|start_header_id|>user<|end_header_id|>\n\n"
                        "What is the weather in Paris today?<|eot_id|>")
    assert texts[2] == ('<|start_header_id|>assistant<|end_header_id|>\n\nLet me look that up.\n'
                        '{"name": "search", "parameters": {"query": "weather in Paris"}}'
                        "<|eom_id|>")
    assert texts[3] == "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21 degrees<|eot_id|>"
    assert llama.decode(seg.generation_prompt_ids, skip_special_tokens=False) == \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert [i for m in seg.message_ids for i in m] + seg.generation_prompt_ids == ids


def test_calls_of_an_episode_merge_at_token_level(llama) -> None:
    script = Script(llama, tools=TOOLS)
    history = [{"role": "user", "content": "What is the weather in Paris today?"}]
    answers = [
        {"role": "assistant", "content": "Let me look that up.", "tool_calls": [CALL]},
        {"role": "assistant", "content": "It is sunny, 21 degrees."},
    ]
    calls = [script.call(list(history), answers[0])]
    history += [answers[0], {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"}]
    calls.append(script.call(list(history), answers[1]))
    segmenter = Segmenter(llama)
    timelines = [build_initial_timeline(
        agent=c.agent, messages=c.messages, tools=c.tools, prompt_ids=c.prompt_ids,
        response_ids=c.response_ids, logprobs=c.logprobs, response=c.response,
        finish_reason=c.finish_reason, segmenter=segmenter) for c in calls]
    outcome = plan_merge(timelines, MergePolicy(compare_level="token"))
    assert outcome.absorber == [1, None]
    merged = outcome.merged[1]
    assert merged.token_ids == [*calls[1].prompt_ids, *calls[1].response_ids]
    assert [m.author for m in merged.messages] == ["user", "llm", "tool", "llm"]
    trained = [t for t, m in zip(merged.token_ids, loss_mask(merged), strict=True) if m]
    assert trained == [*calls[0].response_ids, *calls[1].response_ids]
