"""Struck owners render at idle priority (``workers.engines.render``): once a project's chat
template renders past ``RENDER_BUDGET_S``, for ``RENDER_STRIKE_S`` its renders run, in a
process that isolates them (a replay worker's pool process), on a render thread at nice 19,
under the same budget; the replay's outcome and samples are those of an in-thread render.
Another project's renders, a process that does not isolate (the API's, the default), and
an owner whose strike is older than the setting render in the caller's thread.

Real PostgreSQL, the real Qwen3 tokenizer and template, replay's own projection
(``project_episode``), and a real ``trajstore worker --queues replay``."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, RunConfig, RunCreated
from store.settings import get_settings
from tests.replay.replay_episodes import SEARCH_TOOL, Script, tool_call
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.conftest import wait_for
from tests.workers.test_replay_budget import BUSY, episode, record
from tests.workers.test_replay_dispatch import project_run
from workers.engines import render
from workers.replay.jobs.project import project_episode

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a thread's own nice value is Linux's")

BUDGET = "0.3"
#: A template that writes the clock (``strftime_now``), so a render can tell its thread.
DATED = "{{ strftime_now('%Y') }}|{% for m in messages %}{{ m.content }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return qwen3_tokenizer()


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Sets TRAJSTORE_* variables for this process's settings (the render budget 0.3 s)."""

    def put(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(f"TRAJSTORE_{name}", value)
        get_settings.cache_clear()

    put(RENDER_BUDGET_S=BUDGET)
    yield put
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.fixture
def isolated(settings_env: Callable[..., None]) -> Iterator[None]:
    """This process isolates struck renders, as a replay worker's pool process does."""
    assert render.isolate_struck_renders()
    yield
    render.isolate_struck_renders(False)


def tool_episode(tokenizer: Any, run_id: str, group_id: str) -> list[Event]:
    """A question, a search, its result and the answer: two calls with tools."""
    s = Script(tokenizer, tools=[SEARCH_TOOL], group_id=group_id, seed=5)
    s.events[0] = s.events[0].model_copy(update={"run_id": run_id})
    question = {"role": "user", "content": "How many files are there?"}
    search = {"role": "assistant", "content": "",
              "tool_calls": [tool_call("search", {"query": "files"}, "c1")]}
    s.call([question], search)
    s.tool("search", "42")
    s.call([question, search, {"role": "tool", "tool_call_id": "c1", "content": "42"}],
           {"role": "assistant", "content": "There are 42 files."})
    return s.finish(1.0)


def hostile_run(store: EventStore, project: str, tokenizer: Any) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(
        run_id=run_id, project=project, config=RunConfig(
            tokenizer="qwen3", chat_template=BUSY + tokenizer.chat_template))], NO_STREAM)
    return run_id


def samples(store: EventStore, episode_id: str) -> list[tuple[Any, ...]]:
    """What an episode's samples hold, but for the ids and times of their rows."""
    with store.db.connection() as conn:
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                for row in conn.execute(
                    "SELECT kind, agent, timeline_index, reward, policy_version, prompt_length,"
                    " num_tokens, num_trainable, num_drifted, token_ids, loss_mask, logprobs,"
                    " position_key, retry_index, error_types, error_messages FROM samples"
                    " WHERE episode_id = %s ORDER BY kind, timeline_index",
                    (episode_id,)).fetchall()]


def rendering_thread(renderer: render.ChatRenderer) -> int:
    """The kernel id of the thread ``renderer`` renders ``DATED`` on (its clock tells)."""
    seen: list[int] = []

    def clock(format: str) -> str:
        seen.append(threading.get_native_id())
        return "2026"

    assert renderer.render(MESSAGES, tools=None, generation_prompt=False,
                           clock=clock) == "2026|hi"
    assert len(set(seen)) == 1  # the render, and the check against apply_chat_template's
    return seen[0]


def test_a_struck_projects_replays_render_on_the_idle_thread_with_the_same_results(
        worker_store: EventStore, isolated: None, qwen3: Any) -> None:
    store = worker_store
    project = f"hostile-{uuid.uuid4().hex[:6]}"
    bad_run, good_run = hostile_run(store, project, qwen3), project_run(store, project)
    neighbour_run = project_run(store, f"neighbour-{uuid.uuid4().hex[:6]}")
    before_strike = record(store, tool_episode(qwen3, good_run, "g-a"), "plain")
    after_strike = record(store, tool_episode(qwen3, good_run, "g-b"), "plain")
    hostile = [record(store, episode(qwen3, bad_run, i), f"bad{i}") for i in range(2)]
    neighbour = record(store, episode(qwen3, neighbour_run, 7), "neighbour")

    # Not struck yet: the project's episode renders in this thread.
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    isolated_at = render.isolated_renders()
    assert project_episode(store, before_strike).status == "completed"
    assert render.isolated_renders() == isolated_at and not render.is_struck(project)
    expected = samples(store, before_strike)
    assert expected

    # Its template runs past the budget: refused, one budget spent, the project struck.
    spent = render.budgets_spent()
    outcome = project_episode(store, hostile[0])
    assert outcome.status == "invalid" and "TRAJSTORE_RENDER_BUDGET_S" in (outcome.reason or "")
    assert render.budgets_spent() == spent + 1
    assert render.isolated_renders() == isolated_at
    assert render.is_struck(project)

    # Its next hostile episode renders on the idle thread, at nice 19: refused the same way,
    # for one budget again.
    again = project_episode(store, hostile[1])
    assert again.status == "invalid" and again.reason == outcome.reason
    assert render.budgets_spent() == spent + 2
    assert render.isolated_renders() == isolated_at + 1
    thread = render.isolation_thread()
    assert thread is not None and thread != threading.get_native_id()
    assert os.getpriority(os.PRIO_PROCESS, thread) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # unchanged

    # An ordinary episode of the struck project renders there too, into the same samples.
    assert project_episode(store, after_strike).status == "completed"
    assert render.isolated_renders() > isolated_at + 1
    assert samples(store, after_strike) == expected
    assert render.budgets_spent() == spent + 2

    # Another project's renders stay in the calling thread.
    isolated_now = render.isolated_renders()
    assert project_episode(store, neighbour).status == "completed"
    assert render.isolated_renders() == isolated_now
    assert samples(store, neighbour)


def test_a_struck_owners_render_runs_on_the_niced_thread_and_gives_the_same_text(
        isolated: None, qwen3: Any) -> None:
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    hostile = render.ChatRenderer(qwen3, chat_template=BUSY + DATED, owner=owner)
    with pytest.raises(render.RenderBudgetExceeded, match="TRAJSTORE_RENDER_BUDGET_S"):
        hostile.render(MESSAGES, tools=None, generation_prompt=False)
    dated = render.ChatRenderer(qwen3, chat_template=DATED, owner=owner)
    count = render.isolated_renders()
    thread = rendering_thread(dated)
    assert render.isolated_renders() == count + 1
    assert thread == render.isolation_thread() != threading.get_native_id()
    assert os.getpriority(os.PRIO_PROCESS, thread) == 19
    # The template's own errors reach the caller as they are.
    broken = render.ChatRenderer(qwen3, chat_template="{{ raise_exception('no') }}",
                                 owner=owner)
    with pytest.raises(Exception, match="no") as raised:
        broken.render(MESSAGES, tools=None, generation_prompt=False)
    assert type(raised.value).__name__ == "TemplateError"
    # Qwen3's own template, with tools: the text an unstruck owner's render gives.
    plain = render.ChatRenderer(qwen3, owner=owner)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    struck_text = plain.render(MESSAGES, tools=tools, generation_prompt=True)
    assert render.isolated_renders() == count + 3
    other = render.ChatRenderer(qwen3, owner=f"other-{uuid.uuid4().hex[:6]}")
    assert other.render(MESSAGES, tools=tools, generation_prompt=True) == struck_text
    assert render.isolated_renders() == count + 3
    # Without an owner the template stands for it.
    anonymous = render.ChatRenderer(qwen3, chat_template=BUSY + DATED + "{# anon #}")
    with pytest.raises(render.RenderBudgetExceeded):
        anonymous.render(MESSAGES, tools=None, generation_prompt=False)
    with pytest.raises(render.RenderBudgetExceeded):
        anonymous.render(MESSAGES, tools=None, generation_prompt=False)
    assert render.isolated_renders() == count + 4


def test_the_strike_expires_after_render_strike_s_and_zero_turns_it_off(
        isolated: None, settings_env: Callable[..., None], qwen3: Any) -> None:
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    with pytest.raises(render.RenderBudgetExceeded):
        render.ChatRenderer(qwen3, chat_template=BUSY + DATED, owner=owner).render(
            MESSAGES, tools=None, generation_prompt=False)
    assert render.is_struck(owner)
    # Setting 0: off, the struck owner renders in the calling thread.
    settings_env(RENDER_STRIKE_S="0")
    count = render.isolated_renders()
    assert rendering_thread(render.ChatRenderer(qwen3, chat_template=DATED, owner=owner)) \
        == threading.get_native_id()
    assert render.isolated_renders() == count
    # 0.2 s: the strike, older than that, has expired and is forgotten.
    settings_env(RENDER_STRIKE_S="0.2")
    time.sleep(0.3)
    assert rendering_thread(render.ChatRenderer(qwen3, chat_template=DATED, owner=owner)) \
        == threading.get_native_id()
    assert render.isolated_renders() == count
    assert not render.is_struck(owner, 3600)


def test_without_isolation_a_struck_owner_renders_in_the_calling_thread(
        settings_env: Callable[..., None], qwen3: Any) -> None:
    """The default, and the API process's rule: no process isolates unless asked."""
    assert render.isolation_thread() is None
    owner = f"owner-{uuid.uuid4().hex[:6]}"
    with pytest.raises(render.RenderBudgetExceeded):
        render.ChatRenderer(qwen3, chat_template=BUSY + DATED, owner=owner).render(
            MESSAGES, tools=None, generation_prompt=False)
    assert render.is_struck(owner)
    count = render.isolated_renders()
    assert rendering_thread(render.ChatRenderer(qwen3, chat_template=DATED, owner=owner)) \
        == threading.get_native_id()
    assert render.isolated_renders() == count


def test_a_bad_owner_is_refused(qwen3: Any) -> None:
    with pytest.raises(TypeError, match="owner must be a project id"):
        render.ChatRenderer(qwen3, owner=3)  # type: ignore[arg-type]


@pytest.mark.timeout(600)
def test_a_replay_worker_isolates_a_struck_projects_renders(
        worker_store: EventStore, start_worker: Any, qwen3: Any) -> None:
    """A real ``trajstore worker --queues replay``: its pool processes isolate struck renders
    (the log says so), the project whose template ran past the budget is struck, its later
    hostile episodes are refused the same way and its ordinary episode, like a neighbour's,
    is projected as usual."""
    store = worker_store
    project = f"hostile-{uuid.uuid4().hex[:6]}"
    bad_run, good_run = hostile_run(store, project, qwen3), project_run(store, project)
    neighbour_run = project_run(store, f"neighbour-{uuid.uuid4().hex[:6]}")
    worker = start_worker("--queues", "replay", "--concurrency", "1",
                          TRAJSTORE_RENDER_BUDGET_S=BUDGET)
    worker.wait_ready()
    log = worker.log_path
    wait_for(lambda: b"past their budget run at nice 19" in log.read_bytes(),
             what="the pool process's isolation")
    first = record(store, episode(qwen3, bad_run, 0), "bad0")
    projected = lambda e: project_status(store, e)  # noqa: E731
    wait_for(lambda: projected(first), what="the first hostile episode")
    later = [record(store, episode(qwen3, bad_run, i), f"bad{i}") for i in (1, 2)]
    plain = record(store, episode(qwen3, good_run, 3), "plain")
    neighbour = record(store, episode(qwen3, neighbour_run, 4), "neighbour")
    wait_for(lambda: all(projected(e) for e in [*later, plain, neighbour]), timeout=300,
             what="the later episodes")
    for e in [first, *later]:
        status, reason = projected(e)
        assert status == "invalid" and "TRAJSTORE_RENDER_BUDGET_S" in reason, (e, reason)
    assert projected(plain)[0] == projected(neighbour)[0] == "completed"
    text = log.read_text()
    assert f"{project}: a chat template ran past its render budget" in text
    assert text.count("ran past its render budget") == 1  # struck once, by the first
    # The pool process's render thread is at nice 19 and did the later episodes' renders
    # (CPU time of its own; it only renders).
    found = re.search(r"past their budget run at nice 19 on thread (\d+)", text)
    assert found is not None
    thread = int(found.group(1))
    assert os.getpriority(os.PRIO_PROCESS, thread) == 19
    fields = Path(f"/proc/{thread}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(fields[11]) + int(fields[12]) > 0  # utime + stime, in clock ticks
    assert worker.proc.poll() is None


def project_status(store: EventStore, episode_id: str) -> tuple[str, str] | None:
    with store.db.connection() as conn:
        row = conn.execute("SELECT status, invalid_reason FROM episodes"
                           " WHERE episode_id = %s AND projected_at IS NOT NULL",
                           (episode_id,)).fetchone()
    return None if row is None else (row[0], row[1] or "")
