"""Templates that read the clock (``strftime_now``: Llama 3.x writes today's date into its
system block) replay with the date their prompt was rendered on, whatever the day of the
replay: the date is read back from the recorded prompt."""

from __future__ import annotations

from datetime import datetime

import pytest
from replay_episodes import SEARCH_TOOL, Script, tool_call
from replay_tokenizers import LLAMA_STYLE_TEMPLATE

from store.events import MergeConfig, RunConfig
from store.settings import get_settings
from workers.engines.render import ChatRenderer, RenderBudgetExceeded, budgets_spent
from workers.replay import ReplayError, replay_episode
from workers.replay.errors import PromptMismatchError
from workers.replay.segment import Segmenter

DATED = LLAMA_STYLE_TEMPLATE.replace(
    "{{- system }}", "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}{{- system }}")
assert DATED != LLAMA_STYLE_TEMPLATE
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"}]


def day(text: str):
    return lambda format: datetime.strptime(text, "%d %b %Y").strftime(format)


def prompt(tokenizer, messages, clock, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True, chat_template=DATED,
                                         strftime_now=clock)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_renderer_takes_the_clock_it_is_given(llama) -> None:
    renderer = ChatRenderer(llama, chat_template=DATED)
    assert renderer.reads_clock(tools=False)
    assert not ChatRenderer(llama).reads_clock(tools=False)
    # Past the renders compared with apply_chat_template's, the compiled template too.
    for _ in range(12):
        text = renderer.render(MESSAGES, tools=None, generation_prompt=True,
                               clock=day("01 Jan 2020"))
        assert "Today Date: 01 Jan 2020\n\n" in text
    today = renderer.render(MESSAGES, tools=None, generation_prompt=True)
    assert f"Today Date: {datetime.now():%d %b %Y}" in today


@pytest.mark.parametrize("date", ["01 Jan 2020", "31 Dec 2031"])
def test_a_prompt_rendered_on_another_day_segments(llama, date) -> None:
    ids = prompt(llama, MESSAGES, day(date))
    for reuse in (True, False):
        seg = Segmenter(llama, chat_template=DATED, reuse=reuse).segment(MESSAGES,
                                                                        prompt_ids=ids)
        system = llama.decode(seg.message_ids[0], skip_special_tokens=False)
        assert system.endswith(f"Today Date: {date}\n\nBe brief.<|eot_id|>")
        assert [i for m in seg.message_ids for i in m] + seg.generation_prompt_ids == ids


def test_a_prompt_that_no_date_explains_is_still_refused(llama) -> None:
    text = llama.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                     chat_template=DATED, strftime_now=day("01 Jan 2020"))
    forged = text.replace("Be brief.", "Be long.")
    ids = llama(forged, add_special_tokens=False)["input_ids"]
    with pytest.raises(PromptMismatchError, match="Be long"):
        Segmenter(llama, chat_template=DATED).segment(MESSAGES, prompt_ids=ids)


def test_an_episode_replays_with_the_dates_its_calls_were_rendered_on(llama) -> None:
    """Two calls on 1 January merge; the third, after midnight, renders another system
    block: it cannot extend them and trains in a sample of its own, with its own date."""
    s = Script(llama, tools=[SEARCH_TOOL], chat_template=DATED)
    s.clock = day("01 Jan 2020")
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = tool_call("search", {"query": "Paris"}, "c1")
    first = {"role": "assistant", "content": "Looking.", "tool_calls": [call]}
    s.call(list(history), first)
    s.tool("search", "sunny")
    history += [first, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    second = {"role": "assistant", "content": "Sunny, and what about Rome?",
              "tool_calls": [tool_call("search", {"query": "Rome"}, "c2")]}
    s.call(list(history), second)
    s.tool("search", "rain")
    history += [second, {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    s.clock = day("02 Jan 2020")
    s.call(list(history), {"role": "assistant", "content": "Paris sunny, Rome rain."})
    events = s.finish(1.0)
    calls = [e for e in events if e.type == "llm_called"]
    token = RunConfig(chat_template=DATED, merge=MergeConfig(compare_level="token"))
    result = replay_episode(events, config=token, tokenizer=llama)
    assert result.absorber == [1, None, None]
    assert len(result.samples) == 2
    texts = [llama.decode(sample.token_ids, skip_special_tokens=False)
             for sample in result.samples]
    assert "Today Date: 01 Jan 2020" in texts[0] and "02 Jan" not in texts[0]
    assert "Today Date: 02 Jan 2020" in texts[1] and "01 Jan" not in texts[1]
    assert result.samples[1].token_ids == [*calls[2].prompt_ids, *calls[2].response_ids]
    trained = [[t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
               for sample in result.samples]
    assert trained == [[*calls[0].response_ids, *calls[1].response_ids],
                       list(calls[2].response_ids)]
    # Text level compares the messages, not the template's date: the last call's timeline
    # absorbs the first two, as the same conversation in the prompt the engine saw last.
    text = replay_episode(events, config=RunConfig(chat_template=DATED), tokenizer=llama)
    assert text.absorber == [2, 2, None]
    (sample,) = text.samples
    assert sample.token_ids == [*calls[2].prompt_ids, *calls[2].response_ids]


#: Loops that never end in practice, printing nothing.
BUSY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template", [BUSY + LLAMA_STYLE_TEMPLATE, BUSY + DATED],
                         ids=["plain", "reads the clock"])
def test_a_template_past_its_budget_spends_it_once_per_episode(
        llama, template, monkeypatch: pytest.MonkeyPatch) -> None:
    """The episode is refused at the first render past the budget: neither the full path
    nor the clock's marker render tries the template again (each would cost the budget)."""
    monkeypatch.setenv("TRAJSTORE_RENDER_BUDGET_S", "0.2")
    get_settings.cache_clear()
    try:
        s = Script(llama, tools=[SEARCH_TOOL])
        history = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = {"role": "assistant", "content": "Looking.",
                 "tool_calls": [tool_call("search", {"query": "Paris"}, "c1")]}
        s.call(list(history), first)
        history += [first, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        s.call(list(history), {"role": "assistant", "content": "Sunny."})
        before = budgets_spent()
        with pytest.raises(ReplayError, match="TRAJSTORE_RENDER_BUDGET_S") as refused:
            replay_episode(s.finish(1.0), config=RunConfig(chat_template=template),
                           tokenizer=llama)
        assert isinstance(refused.value.__cause__, RenderBudgetExceeded)
        assert budgets_spent() - before == 1
    finally:
        get_settings.cache_clear()
