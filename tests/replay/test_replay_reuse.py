"""Reuse across the calls of an episode and fast template rendering give exactly what the full
path gives: the same segmentations, the same replay, the same errors; a call whose prompt
does not extend the earlier one is segmented in full."""

from __future__ import annotations

import random

import jinja2
import numpy as np
import pytest
from replay_episodes import SEARCH_TOOL, Script, tool_call

from store.events import LLMCalled, RunConfig
from workers.engines.render import CHECKED, ChatRenderer, _verified
from workers.replay.episode import replay_episode
from workers.replay.errors import PromptMismatchError, ReplayError
from workers.replay.offsets import decode_appendable
from workers.replay.segment import Segmenter, _render_key

TOOLS = [SEARCH_TOOL]


def tool_episode(tok, *, turns: int, reasoning: bool, seed: int = 0) -> list:
    """An agent loop: a user query, then ``turns`` calls, each answered with a tool call and
    a tool result (two results every third turn), then a final answer."""
    script = Script(tok, tools=TOOLS, seed=seed)
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": f"Look up {turns} things, please. ✓"}]
    for t in range(turns):
        calls = [tool_call("search", {"query": f"thing {t}"}, f"c{t}")]
        if t % 3 == 2:
            calls.append(tool_call("search", {"query": f"other {t}"}, f"d{t}"))
        answer = {"role": "assistant", "content": f"Looking up thing {t}.", "tool_calls": calls}
        if reasoning:
            answer["reasoning_content"] = f"I need thing {t}."
        script.call(list(messages), answer)
        messages = [*messages, answer]
        for c in calls:
            output = f"result of {c['function']['arguments']} — {t * 7}"
            script.tool("search", output)
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": output})
    script.call(list(messages), {"role": "assistant", "content": "All found."})
    return script.finish(1.0)


def as_tuple(seg) -> tuple:
    return (seg.text, seg.ends, seg.message_ids, seg.generation_prompt_ids, seg.relocated)


def segment_all(tok, events, *, reuse: bool, chat_template: str | None = None):
    segmenter = Segmenter(tok, chat_template=chat_template, reuse=reuse)
    out = [segmenter.segment(e.messages, tools=e.tools, prompt_ids=e.prompt_ids,
                             call_id=e.call_id)
           for e in events if isinstance(e, LLMCalled)]
    return out, segmenter


def same_replay(a, b) -> None:
    assert a.absorber == b.absorber and a.survivor_indices == b.survivor_indices
    assert [t.messages for t in a.timelines] == [t.messages for t in b.timelines]
    assert a.samples == b.samples and a.forks == b.forks
    assert a.drifted_messages == b.drifted_messages


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("reasoning", [False, True])
def test_reused_segmentations_equal_the_full_path(name: str, reasoning: bool, request) -> None:
    tok = request.getfixturevalue(name)
    events = tool_episode(tok, turns=7, reasoning=reasoning)
    fast, segmenter = segment_all(tok, events, reuse=True)
    full, _ = segment_all(tok, events, reuse=False)
    assert [as_tuple(s) for s in fast] == [as_tuple(s) for s in full]
    # Every call after the first took over the earlier call's messages.
    assert fast[0].reused == 0 and all(s.reused > 0 for s in fast[1:])
    assert [s.base for s in fast[1:]] == [s.key for s in fast[:-1]]
    assert segmenter.verify()


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_replay_with_reuse_equals_replay_in_full(name: str, request, monkeypatch) -> None:
    tok = request.getfixturevalue(name)
    events = tool_episode(tok, turns=5, reasoning=True, seed=3)
    reused = replay_episode(events, config=RunConfig(), tokenizer=tok)
    original = Segmenter.__init__

    def full_only(self, *args, **kwargs):
        kwargs["reuse"] = False
        original(self, *args, **kwargs)

    monkeypatch.setattr(Segmenter, "__init__", full_only)
    same_replay(reused, replay_episode(events, config=RunConfig(), tokenizer=tok))


def test_history_rendered_differently_falls_back_to_the_full_path(qwen3) -> None:
    # A new user query makes Qwen3 drop the reasoning of the earlier assistant turn, so the
    # third prompt does not extend the second one; it still extends the first call's prompt
    # (which ends before that turn), and is segmented from that one.
    script = Script(qwen3, tools=TOOLS)
    first = [{"role": "user", "content": "Find x."}]
    answer = {"role": "assistant", "content": "Looking.", "reasoning_content": "Search it.",
              "tool_calls": [tool_call("search", {"query": "x"}, "c1")]}
    script.call(first, answer)
    second = [*first, answer, {"role": "tool", "tool_call_id": "c1", "content": "x is 1"}]
    done = {"role": "assistant", "content": "x is 1.", "reasoning_content": "Found."}
    script.call(second, done)
    third = [*second, done, {"role": "user", "content": "And y?"}]
    script.call(third, {"role": "assistant", "content": "Let me see."})
    events = script.finish(1.0)
    calls = [e for e in events if isinstance(e, LLMCalled)]
    assert list(calls[2].prompt_ids[:len(calls[1].prompt_ids)]) != list(calls[1].prompt_ids)
    fast, segmenter = segment_all(qwen3, events, reuse=True)
    full, _ = segment_all(qwen3, events, reuse=False)
    assert [as_tuple(s) for s in fast] == [as_tuple(s) for s in full]
    assert fast[1].base == fast[0].key and fast[2].base == fast[0].key
    assert fast[2].relocated == [1, 2, 3]
    assert segmenter.verify()
    # Without the first call, nothing is extended: the third call is segmented in full.
    alone, _ = segment_all(qwen3, [calls[1], calls[2]], reuse=True)
    assert alone[1].base is None and as_tuple(alone[1]) == as_tuple(full[2])


def test_other_tools_or_other_history_are_not_reused(qwen3) -> None:
    script = Script(qwen3, tools=TOOLS)
    messages = [{"role": "user", "content": "Find x."}]
    answer = {"role": "assistant", "content": "Sure.",
              "tool_calls": [tool_call("search", {"query": "x"}, "c1")]}
    script.call(messages, answer)
    later = [*messages, answer, {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    script.call(later, {"role": "assistant", "content": "Done."}, tools=None)
    other = [{"role": "user", "content": "Find y."}, answer,
             {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    script.call(other, {"role": "assistant", "content": "Done."})
    events = script.finish(0.0)
    fast, _ = segment_all(qwen3, events, reuse=True)
    full, _ = segment_all(qwen3, events, reuse=False)
    assert [as_tuple(s) for s in fast] == [as_tuple(s) for s in full]
    assert [s.reused for s in fast] == [0, 0, 0]


def test_a_prompt_that_is_not_a_rendering_fails_as_in_the_full_path(qwen3) -> None:
    # The second call's prompt shows another tool result than its messages record. The
    # reused path takes the last message's rendering from the prompt; the check of the chain
    # finds it wrong and the episode is replayed in full, which names the call.
    script = Script(qwen3, tools=TOOLS)
    messages = [{"role": "user", "content": "Find x."}]
    answer = {"role": "assistant", "content": "Sure.",
              "tool_calls": [tool_call("search", {"query": "x"}, "c1")]}
    script.call(messages, answer)
    recorded = [*messages, answer, {"role": "tool", "tool_call_id": "c1", "content": "x is 1"}]
    shown = [*messages, answer, {"role": "tool", "tool_call_id": "c1", "content": "x is 2"}]
    bad = script.call(shown, {"role": "assistant", "content": "Done."}, call_id="bad")
    events = script.finish(1.0)
    events = [e.model_copy(update={"messages": recorded}) if e is bad else e for e in events]
    fast, segmenter = segment_all(qwen3, events, reuse=True)
    assert fast[1].reused == 1 and not segmenter.verify()
    with pytest.raises(PromptMismatchError) as full_error:
        segment_all(qwen3, events, reuse=False)
    with pytest.raises(ReplayError) as replay_error:
        replay_episode(events, config=RunConfig(), tokenizer=qwen3)
    assert type(replay_error.value) is PromptMismatchError
    assert str(replay_error.value) == str(full_error.value) and "'bad'" in str(full_error.value)


def test_renderer_gives_apply_chat_template_text(qwen3, llama) -> None:
    events = tool_episode(qwen3, turns=4, reasoning=True)
    history = [e for e in events if isinstance(e, LLMCalled)][-1].messages
    for tok in (qwen3, llama):
        renderer = ChatRenderer(tok)
        for k in range(1, len(history) + 1):
            for tools in (None, TOOLS):
                for generation_prompt in (False, True):
                    expected = tok.apply_chat_template(
                        history[:k], tools=tools, tokenize=False,
                        add_generation_prompt=generation_prompt)
                    for _ in range(2):  # the first renders are checked, later ones not
                        assert renderer.render(history[:k], tools=tools,
                                               generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('no') }}", jinja2.TemplateError),
    ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),
    ("{{ messages[0].update({'x': 1}) }}", jinja2.exceptions.SecurityError),
    ("{{ messages[0].nothing.strip() }}", jinja2.exceptions.UndefinedError),
])
def test_renderer_refuses_what_the_sandbox_refuses(qwen3, template: str, error) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(error):
        qwen3.apply_chat_template(messages, tokenize=False, chat_template=template)
    renderer = ChatRenderer(qwen3, chat_template=template)
    for _ in range(CHECKED + 2):
        with pytest.raises(error):
            renderer.render(messages, tools=None, generation_prompt=False)


def test_renderer_sees_safe_attributes_as_the_sandbox_does(qwen3) -> None:
    template = ("{{ messages.__class__ }}|{{ messages[0].content.__class__ is defined }}|"
                "{{ messages[0].content.upper() }}|{{ messages[0].items is defined }}|"
                "{{ messages[0].role }}|{{ '{0}'.format(messages[0].content) }}|"
                "{{ messages[0].content.__len__ is defined }}|{% for m in messages %}"
                "{{ loop.index }}{{ loop.last }}{{ loop.index0 }}{{ loop.revindex }}"
                "{{ loop.revindex0 }}{{ loop.first }}{{ loop.length }}{{ loop.depth }}"
                "{{ loop.depth0 }}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}"
                "{{ loop.cycle('a', 'b') }}{{ loop._iterator is defined }}{% endfor %}|"
                "{% set ns = namespace(a=1) %}{{ ns.a }}{{ ns.b is defined }}|"
                "{% set ns2 = namespace(s='x', l=[1], n=none, f=messages[0].content.upper,"
                " d={'k': 2}) %}{{ ns2.s }}{{ ns2.l }}{{ ns2.n }}{{ ns2.f() }}{{ ns2.d.k }}"
                "{{ ns2._Namespace__attrs is defined }}{{ ns2.__class__ is defined }}"
                "{{ ns2.items is defined }}{% set ns2.s = 'y' %}{{ ns2.s }}|"
                # Indexes: in and out of range, negative, bool, of a str and of a dict.
                "{{ messages[1].role }}{{ messages[-1].role }}{{ messages[-3] is defined }}"
                "{{ messages[7] is defined }}{{ messages[true].role }}{{ 'abc'[1] }}"
                "{{ {1: 'a'}[1] }}{{ messages[1.0] is defined }}"
                "{% for m in messages %}{{ messages[loop.index0 - 1].role }}{% endfor %}|"
                "{{ messages[0].get('role') }}{{ messages[0].keys() | list }}"
                "{{ messages[0].content.split(sep='i') }}{{ messages[0].nothing is defined }}"
                "{{ messages[0].content.rstrip('i') }}|"
                # str methods called straight away on a str, through the sandbox on others.
                "{{ messages.count(1) }}{{ messages[0].content.startswith('h', 0) }}"
                "{{ messages[0].content.replace('h', 'j').upper() }}"
                "{{ messages[0].content.center(6, '*') }}{{ '{}!'.format(1) }}"
                "{{ ' x '.strip() }}{{ messages[1].items.real }}"
                "{{ '{0.__class__}'.format(messages) }}{{ '{x.__class__}'.format_map({'x': 1}) }}|"
                # Lookups the compiled template makes inline (dict keys, loop values), next
                # to the sandbox's own: keys named like dict methods or loop values, missing
                # keys, attributes of other types, nested lookups.
                "{% for m in messages %}{{ m['content'] }}{{ m['nothing'] is defined }}"
                "{{ m['__class__'] is defined }}{{ m['items'] is defined }}{{ m.items is defined }}"
                "{{ m.last }}{% if m.extra %}{{ m.extra.name }}{{ m['extra']['name'] }}{% endif %}"
                "{{ loop['index'] }}"
                "{{ m.content.upper is defined }}{{ m.content['x'] is defined }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo", "last": "L", "items": 3,
                 "extra": {"name": "nested"}}]
    expected = qwen3.apply_chat_template(messages, tokenize=False, chat_template=template)
    renderer = ChatRenderer(qwen3, chat_template=template)
    assert [renderer.render(messages, tools=None, generation_prompt=False)
            for _ in range(CHECKED + 2)] == [expected] * (CHECKED + 2)
    # The compiled template's own renders matched (none fell back to apply_chat_template).
    assert _verified[(template, renderer._variables_key)] == CHECKED


def test_renderer_loops_by_position_as_loop_context_does(qwen3) -> None:
    """Loops whose body reads only position values of ``loop`` are compiled to iterate a
    list by position; every value, over every kind of iterable, nested either way, with
    ``else``, and with names the body reads from the context, is what Jinja's LoopContext
    gives."""
    values = ("{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
              "{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.depth }}"
              "{{ loop.depth0 }}")
    template = (
        # Over lists (reversed, empty with else), a tuple, a str, a dict, a generator.
        f"{{% for m in messages[::-1] %}}{{{{ m.role }}}}{values};{{% endfor %}}|"
        f"{{% for m in [] %}}{values}{{% else %}}empty{{{{ loop is defined }}}}{{% endfor %}}|"
        f"{{% for x in (1, 2) %}}{values}{{% endfor %}}|"
        f"{{% for c in 'ab' %}}{{{{ c }}}}{values}{{% endfor %}}|"
        f"{{% for k in {{'p': 1, 'q': 2}} %}}{{{{ k }}}}{values}{{% endfor %}}|"
        f"{{% for m in messages | selectattr('role', 'ne', 'tool') %}}{values}{{% endfor %}}|"
        # A positional loop inside one that is not (previtem), and the other way round.
        "{% for m in messages %}{{ loop.previtem is defined }}{% for c in m.role %}"
        "{{ loop.index }}{{ loop.last }}{% endfor %}{{ loop.index }}{% endfor %}|"
        "{% for m in messages %}{% for c in m.role %}{{ loop.cycle('x', 'y') }}{% endfor %}"
        "{{ loop.last }}{% for c in m.role %}{% else %}{{ loop.index }}{% endfor %}{% endfor %}|"
        # A filtered loop and a macro seeing the loop stay with LoopContext.
        "{% for m in messages if m.role != 'tool' %}{{ loop.length }}{% endfor %}|"
        "{% for m in messages %}{% macro f() %}{{ loop.index }}{% endmacro %}{{ f() }}"
        "{{ loop.last }}{% endfor %}|"
        # Names the body reads from the context: set before the loop, set in it on some
        # iterations only (the outer value again on the others), never set.
        "{% set content = 'outer' %}{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% if loop.first %}{% set content = m.content %}{% endif %}{{ content }}"
        "{{ undefined_name is defined }}{% set ns.n = ns.n + loop.index %}{% endfor %}"
        "{{ content }}{{ ns.n }}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "tool", "content": "42"}]
    expected = qwen3.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert "empty" in expected and "outeryo" not in expected
    renderer = ChatRenderer(qwen3, chat_template=template)
    assert [renderer.render(messages, tools=None, generation_prompt=False)
            for _ in range(CHECKED + 2)] == [expected] * (CHECKED + 2)
    # The compiled template's own renders matched (none fell back to apply_chat_template).
    assert _verified[(template, renderer._variables_key)] == CHECKED
    # ... and its positional loops were compiled as such.
    from workers.engines.render import _fast_template
    fast = _fast_template(renderer._source(False))
    code = fast.template.environment.compile(template, raw=True)
    assert code.count(") is list else LoopContext(") == 9


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_appendable_decodings_concatenate(name: str, request) -> None:
    tok = request.getfixturevalue(name)
    rng = random.Random(5)
    text = "Température 21 °C — 🚀 中文 <|im_end|> {\"a\": 1}\n\n" * 3
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"])
    whole, starts, _ = decode_appendable(tok, ids)
    checked = 0
    for _ in range(60):
        cut = rng.randint(0, len(ids))
        try:
            head, head_starts, head_ok = decode_appendable(tok, ids[:cut])
            tail, tail_starts, tail_ok = decode_appendable(tok, ids[cut:])
        except ReplayError:  # a cut inside a character: not a decoding of its own
            continue
        if head_ok and tail_ok:
            checked += 1
            assert head + tail == whole
            assert np.concatenate([head_starts, tail_starts + len(head)]).tolist() == \
                starts.tolist()
    assert checked > 10


def test_decodings_that_are_not_byte_level_are_not_appendable(metaspace) -> None:
    ids = metaspace("hello world", add_special_tokens=False)["input_ids"]
    assert decode_appendable(metaspace, ids)[2] is False


def test_renderer_falls_back_when_its_render_differs(qwen3, monkeypatch) -> None:
    import workers.engines.render as render

    class Wrong:
        def render(self, **variables) -> str:
            return "something else"

    template = "{% for m in messages %}[{{ m.role }}]{% endfor %}"
    monkeypatch.setattr(render, "_fast_template", lambda source: Wrong())
    renderer = ChatRenderer(qwen3, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert [renderer.render(messages, tools=None, generation_prompt=False)
            for _ in range(CHECKED + 2)] == ["[user]"] * (CHECKED + 2)
    assert render._verified[(template, renderer._variables_key)] == -1


def test_render_cache_tells_key_orders_apart(qwen3) -> None:
    """Two messages equal as dicts but written in another key order render differently under
    a template that loops over their items; the render cache must not hand one the other's
    text."""
    template = ("{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};"
                "{% endfor %}\n{% endfor %}")
    one = [{"role": "user", "content": "hi"}]
    other = [{"content": "hi", "role": "user"}]
    segmenter = Segmenter(qwen3, chat_template=template)
    first = segmenter.render(one, tools=None, generation_prompt=False)
    assert segmenter._prefix_render(segmenter._interner.child(
        segmenter._interner.root(_render_key([])), _render_key(one[0])), one, None) == first
    node = segmenter._interner.child(segmenter._interner.root(_render_key([])),
                                     _render_key(other[0]))
    second = segmenter._prefix_render(node, other, None)
    assert first.startswith("role=user;content=hi;")
    assert second.startswith("content=hi;role=user;")


def test_renderer_tojson_memo_tells_types_orders_and_options_apart(qwen3) -> None:
    """The memoized ``tojson`` answers as transformers' does for values equal in Python but
    not in JSON (1, 1.0, True; key orders) and for each set of options."""
    template = ("{% for m in messages %}{{ m.args | tojson }}{{ m.args | tojson(indent=2) }}"
                "{{ m.args | tojson(sort_keys=true) }}\n{% endfor %}")
    messages = [{"role": "user", "content": "", "args": args} for args in (
        {"b": 1, "a": [1, 2]}, {"a": [1, 2], "b": 1}, {"b": 1.0, "a": [1, 2]},
        {"b": True, "a": [1, 2]}, {"b": "é", "a": (1, 2)}, {"b": None, "a": []})]
    expected = qwen3.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert '{"b": 1, "a"' in expected and '{"b": 1.0, "a"' in expected
    renderer = ChatRenderer(qwen3, chat_template=template)
    assert [renderer.render(messages, tools=None, generation_prompt=False)
            for _ in range(CHECKED + 2)] == [expected] * (CHECKED + 2)
    # The compiled template's own renders matched (none fell back to apply_chat_template).
    assert _verified[(template, renderer._variables_key)] == CHECKED


def test_tojson_memo_dumps_what_marshal_refuses_each_time() -> None:
    import enum
    import json

    from workers.engines.render import _memoized_tojson

    class Level(enum.IntEnum):
        HIGH = 2

    calls: list[object] = []

    def dump(value, **options):
        calls.append(value)
        return json.dumps(value, **options)

    tojson = _memoized_tojson(dump)
    assert tojson({"a": 1}) == tojson({"a": 1}) == '{"a": 1}' and len(calls) == 1
    assert tojson([Level.HIGH]) == tojson([Level.HIGH]) == "[2]" and len(calls) == 3
    assert tojson({"a": 1}, separators=[",", ":"]) == '{"a":1}' and len(calls) == 4


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_episodes_that_open_alike_share_the_first_segmentation(name: str, request,
                                                               monkeypatch) -> None:
    """Two episodes of one group (same opening prompt, different continuations): the second
    takes the first call's segmentation without rendering or decoding it again, and both
    replay as in full. Another template override does not share it."""
    import workers.replay.segment as segment

    tok = request.getfixturevalue(name)
    first, second = (tool_episode(tok, turns=3, reasoning=r) for r in (False, True))
    calls = [[e for e in episode if isinstance(e, LLMCalled)] for episode in (first, second)]
    assert calls[0][0].messages == calls[1][0].messages and calls[0][1:] != calls[1][1:]
    monkeypatch.setattr(segment, "_FIRST_CALLS", segment.weakref.WeakKeyDictionary())
    full_segmentations = []
    original = Segmenter._full

    def counting(self, *args, **kwargs):
        full_segmentations.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Segmenter, "_full", counting)
    reused = [replay_episode(episode, config=RunConfig(), tokenizer=tok)
              for episode in (first, second)]
    assert len(full_segmentations) == 1  # the second episode's opening came from the first
    fast, _ = segment_all(tok, second, reuse=True)
    assert len(full_segmentations) == 1
    full, _ = segment_all(tok, second, reuse=False)  # every call in full, no sharing
    assert len(full_segmentations) == 1 + len(full)
    assert [as_tuple(s) for s in fast] == [as_tuple(s) for s in full]
    template = "{# another template #}" + tok.chat_template  # its own segmentation
    segment_all(tok, second, reuse=True, chat_template=template)
    assert len(full_segmentations) == 2 + len(full)
    monkeypatch.setattr(Segmenter, "_full", original)
    original_init = Segmenter.__init__

    def full_only(self, *args, **kwargs):
        kwargs["reuse"] = False
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(Segmenter, "__init__", full_only)
    for episode, replayed in zip((first, second), reused, strict=True):
        same_replay(replayed, replay_episode(episode, config=RunConfig(), tokenizer=tok))


def test_two_calls_that_extend_one_call_segment_as_in_full(qwen3) -> None:
    """A retry after a rollback extends the same earlier call as the attempt it replaces:
    both take over that call's segmentation (the second copies the token starts the first
    appended to), and both equal the full path's."""
    from test_replay_project_batch import rollback_episode

    events = rollback_episode(qwen3)
    fast, segmenter = segment_all(qwen3, events, reuse=True)
    full, _ = segment_all(qwen3, events, reuse=False)
    assert [as_tuple(s) for s in fast] == [as_tuple(s) for s in full]
    first, fix, answer = fast
    assert fix.base == answer.base == first.key
    assert segmenter.verify()
