"""A run's own ``chat_template`` renders under a time budget (``RENDER_BUDGET_S``): a
template with nested loops makes its episode ``invalid`` with the reason when replayed, and
its timelines request a 422 naming the limit, within about the budget; another project's
timelines request meanwhile answers as usual.

Real PostgreSQL, the real Qwen3 tokenizer and template, replay's own projection."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from store.eventlog import EventStore, run_stream_id
from store.events import RunConfig, RunCreated
from store.settings import get_settings
from tests.api.conftest import Project
from tests.api.episodes import create_run, episode_events
from workers.engines.render import ChatRenderer, RenderBudgetExceeded
from workers.replay.jobs.project import project_episode

#: Loops that never end in practice (10^10 steps), printing nothing.
BUSY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    monkeypatch.setenv("TRAJSTORE_RENDER_BUDGET_S", "0.5")
    get_settings.cache_clear()
    yield 0.5
    monkeypatch.delenv("TRAJSTORE_RENDER_BUDGET_S")
    get_settings.cache_clear()


def _episode(store: EventStore, run_id: str, tokenizer: object) -> str:
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(episode, episode_events(tokenizer, run_id=run_id, group_id="g0", a=3, b=4,
                                         reward=1.0), "no_stream")
    return episode


def test_the_renderer_stops_at_the_budget_and_says_so() -> None:
    from workers.engines.tokenizers import load_tokenizer

    qwen3 = load_tokenizer("qwen3")
    renderer = ChatRenderer(qwen3, chat_template=BUSY + qwen3.chat_template, budget_s=0.3)
    started = time.perf_counter()
    with pytest.raises(RenderBudgetExceeded, match="TRAJSTORE_RENDER_BUDGET_S"):
        renderer.render([{"role": "user", "content": "hi"}], tools=None,
                        generation_prompt=True)
    assert time.perf_counter() - started < 3
    # A template within the budget renders as before, and nothing fires afterwards.
    plain = ChatRenderer(qwen3, budget_s=0.3)
    for _ in range(3):
        out = plain.render([{"role": "user", "content": "hi"}], tools=None,
                           generation_prompt=True)
    time.sleep(0.5)
    assert out == qwen3.apply_chat_template([{"role": "user", "content": "hi"}],
                                            tokenize=False, add_generation_prompt=True)


def test_a_run_template_over_the_budget_is_refused_and_the_neighbour_not_held(
        client: TestClient, project: Project, other_project: Project, api_store: EventStore,
        budget: float) -> None:
    from workers.engines.tokenizers import load_tokenizer

    qwen3 = load_tokenizer("qwen3")
    hostile_run, quiet_run = (f"run-{uuid.uuid4().hex[:8]}" for _ in range(2))
    config = RunConfig(group_size=1, tokenizer="qwen3",
                       chat_template=BUSY + qwen3.chat_template)
    api_store.append(run_stream_id(hostile_run), [RunCreated(
        run_id=hostile_run, project=project.name, config=config)], "no_stream")
    create_run(api_store, quiet_run, project=other_project.name, group_size=1)
    hostile = _episode(api_store, hostile_run, qwen3)
    neighbour = _episode(api_store, quiet_run, qwen3)

    def timelines(p: Project, episode: str) -> tuple[int, dict[str, object], float]:
        started = time.perf_counter()
        r = client.get(f"/v1/episodes/{episode}/timelines", headers=p.headers("read"))
        return r.status_code, r.json(), time.perf_counter() - started

    quiet = timelines(other_project, neighbour)
    assert quiet[0] == 200, quiet
    results: dict[str, tuple[int, dict[str, object], float]] = {}
    attacker = threading.Thread(
        target=lambda: results.__setitem__("hostile", timelines(project, hostile)))
    attacker.start()
    time.sleep(0.05)
    loaded = timelines(other_project, neighbour)
    attacker.join(30)
    assert not attacker.is_alive()
    status, body, took = results["hostile"]
    assert status == 422, body
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "render_budget"
    assert "TRAJSTORE_RENDER_BUDGET_S" in str(error["message"])
    assert took < budget + 5, took
    assert loaded[0] == 200 and loaded[1] == quiet[1]
    assert loaded[2] < 2 * quiet[2] + 1.0, (quiet[2], loaded[2])

    # Replay records the episode invalid with the reason, within about the budget.
    started = time.perf_counter()
    outcome = project_episode(api_store, hostile)
    assert time.perf_counter() - started < budget + 5
    assert outcome.status == "invalid", outcome
    assert "TRAJSTORE_RENDER_BUDGET_S" in (outcome.reason or "")
    fine = project_episode(api_store, neighbour)
    assert fine.status == "completed", fine
