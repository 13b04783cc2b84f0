"""Fair replay between projects on the shared replay queue (``workers.fair``,
``replay_project_running``), with real ``trajstore worker --queues replay`` processes, a real
PostgreSQL and a real Redis: a project that finishes 60 episodes at once has at most its places'
worth of replays ahead of another project's one episode, which is projected before the
flood's backlog (then every episode is, once); parked replays survive the worker killed in the
middle of the flood's replay; the sweep leaves the replays the budget holds to it and hands
it the others; a flood past ``replay_project_parked`` keeps its Redis list at the cap and is
still all projected; and a replay worker's default slots leave another project's episode a
slot while a project's replay renders a hostile template at its budget."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, RunConfig, RunCreated
from store.followers import ReplayDue
from store.projections import Projections
from store.settings import Settings
from tests.replay.replay_episodes import Script
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.conftest import wait_for
from tests.workers.test_replay_dispatch import project_run
from workers import fair
from workers.replay.jobs.dispatch import queue_replay
from workers.replay.jobs.sweep import sweep_unprojected

FLOOD = 60


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return qwen3_tokenizer()


def episode(tokenizer: Any, run_id: str, seed: int) -> list[Event]:
    """One answered question, rewarded and finished."""
    s = Script(tokenizer, group_id=f"g{seed % 4}", seed=seed)
    s.events[0] = s.events[0].model_copy(update={"run_id": run_id})
    s.call([{"role": "user", "content": f"What is {seed} + 1?"}],
           {"role": "assistant", "content": f"{seed + 1}."})
    return s.finish(1.0)


def record(store: EventStore, events: list[Event], name: str) -> str:
    episode_id = f"ep-{name}-{uuid.uuid4().hex[:8]}"
    store.append(episode_id, events, NO_STREAM)
    return episode_id


def projected_at(store: EventStore, episode_ids: list[str]) -> dict[str, Any]:
    with store.db.connection() as conn:
        return dict(conn.execute("SELECT episode_id, projected_at FROM episodes"
                                 " WHERE episode_id = ANY(%s)", (episode_ids,)).fetchall())


def samples_per_episode(store: EventStore, episode_ids: list[str]) -> dict[str, int]:
    """The samples written for each of ``episode_ids`` (those with none left out)."""
    with store.db.connection() as conn:
        return dict(conn.execute("SELECT episode_id, count(*) FROM samples"
                                 " WHERE episode_id = ANY(%s) GROUP BY episode_id",
                                 (episode_ids,)).fetchall())


def settled(settings: Settings, project: str) -> bool:
    """Nothing of ``project`` held or parked (the last replay has handed its place back)."""
    return (fair.places_held(settings, fair.REPLAY, project) == 0
            and fair.parked_count(settings, fair.REPLAY, project) == 0)


@pytest.mark.timeout(600)
def test_a_flooding_projects_backlog_leaves_the_neighbours_episode_projected_early(
        worker_store: EventStore, worker_settings: Settings, start_worker: Any,
        qwen3: Any) -> None:
    store = worker_store
    flood_run, neighbour_run = project_run(store, "flood"), project_run(store, "neighbour")
    flood = [record(store, episode(qwen3, flood_run, i), f"flood{i}") for i in range(FLOOD)]
    neighbour = record(store, episode(qwen3, neighbour_run, 1000), "neighbour")
    # The log is read up to the oldest transaction running on the server, this database's or
    # another's: while another test's transactions hold part of the flood back, the follower
    # would see the flood a slice at a time and replay a slice before the neighbour's
    # episode is even readable. The test is of the budget, so it starts the worker once
    # nothing is held back.
    wait_for(lambda: not store.held_back(), what="the appended events readable")
    # Two places per project (so three worker slots, the default). The worker's follower of
    # the log starts after all of it finished: its first batch is the flood, then the
    # neighbour's.
    # Each replay holds its transaction 0.5 s: a pool process's first replay (opening its
    # store, loading the tokenizer) takes seconds, and without the delay the flood's backlog
    # went through a warm slot, 10 to 40 ms a replay, while the neighbour's episode, sent
    # third, was still in its slot's first replay.
    worker = start_worker("--queues", "replay", TRAJSTORE_REPLAY_PROJECT_RUNNING="2",
                          TRAJSTORE_FAULT_REPLAY_DELAY_S="0.5")
    worker.wait_ready()
    projections = Projections(store)
    wait_for(lambda: projections.projected_version(neighbour), what="the neighbour's episode")
    # Without budgets the neighbour's episode would be the 61st replay; with them, the
    # flood's two queued replays are all that is ahead of it. They run beside it, each slot
    # starting cold, so one more replay of each of the flood's two places may end before the
    # neighbour's slower first one does: at most four end first.
    at = projected_at(store, [neighbour])[neighbour]
    ahead = sorted(t for t in projected_at(store, flood).values() if t < at)
    assert len(ahead) <= 4, f"{len(ahead)} of the flood's replays went first"
    assert len(projected_at(store, flood)) < FLOOD, "the flood's backlog was done first"
    # The flood's backlog is replayed in turn, every episode once, and nothing stays held.
    wait_for(lambda: len(projected_at(store, flood)) == FLOOD, timeout=300,
             what="the flood's backlog")
    wait_for(lambda: settled(worker_settings, "flood") and settled(worker_settings,
                                                                   "neighbour"),
             timeout=60, what="the places handed back")
    assert samples_per_episode(store, [*flood, neighbour]) == dict.fromkeys([*flood, neighbour],
                                                                           1)
    assert worker.proc.poll() is None


@pytest.mark.timeout(600)
def test_parked_replays_survive_a_worker_killed_mid_replay(
        worker_store: EventStore, worker_settings: Settings, start_worker: Any,
        qwen3: Any) -> None:
    store = worker_store
    run_id = project_run(store, "flood")
    slow = start_worker("--queues", "replay", TRAJSTORE_FAULT_REPLAY_DELAY_S="60",
                        TRAJSTORE_REPLAY_PROJECT_RUNNING="1")
    slow.wait_ready()
    episodes = [record(store, episode(qwen3, run_id, i), f"k{i}") for i in range(3)]
    # the first replay sleeps inside its transaction; the other two wait parked in Redis
    wait_for(lambda: fair.parked_count(worker_settings, fair.REPLAY, "flood") == 2,
             what="two replays parked")

    def replay_in_flight() -> bool:
        with store.db.connection() as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                " AND datname = current_database() AND pid <> pg_backend_pid()"
                " AND query LIKE 'INSERT%%'").fetchone()
            return bool(row and row[0])

    wait_for(replay_in_flight, what="the first replay to be mid-transaction")
    slow.kill()
    killed = time.monotonic()
    projections = Projections(store)
    assert not any(projections.projected_version(e) for e in episodes)
    # The broker gives the killed replay back once it is older than the visibility timeout,
    # to a worker that starts after it (conftest's test of the SIGKILL without budgets).
    time.sleep(max(0.0, worker_settings.visibility_timeout_s + 1 - (time.monotonic() - killed)))
    fresh = start_worker("--queues", "replay", TRAJSTORE_REPLAY_PROJECT_RUNNING="1")
    fresh.wait_ready()
    wait_for(lambda: all(projections.projected_version(e) for e in episodes), timeout=180,
             what="the redelivered replay and the two parked ones")
    wait_for(lambda: settled(worker_settings, "flood"), timeout=60,
             what="the places handed back")


def test_the_sweep_leaves_the_replays_the_budget_holds_and_hands_it_the_others(
        worker_store: EventStore, worker_settings: Settings, qwen3: Any) -> None:
    """No worker consumes the queue here: three replays of one project are queued or parked
    through the budget, one episode's message was lost. The periodic sweep hands the lost
    one to the budget (parked behind the others: projecting it here would let the
    project's backlog past its places) and nothing more the next time; an operator's
    replay of everything projects them all."""
    store = worker_store
    settings = worker_settings.model_copy(update={"replay_project_running": 1})
    store.settings = settings
    run_id = project_run(store, "flood")
    sent = [record(store, episode(qwen3, run_id, i), f"s{i}") for i in range(3)]
    lost = record(store, episode(qwen3, run_id, 9), "lost")
    send = queue_replay(settings)
    for episode_id in sent:
        send(ReplayDue(episode_id, store.stream_version(episode_id), "flood"))
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 2
    assert sweep_unprojected(store, leave_budgeted=True) == 1
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 3
    projections = Projections(store)
    assert not any(projections.projected_version(e) for e in [*sent, lost])
    assert sweep_unprojected(store, leave_budgeted=True) == 0
    assert sweep_unprojected(store) == 4


def test_past_the_parked_cap_a_replay_is_refused_and_the_sweep_offers_it_again(
        worker_store: EventStore, worker_settings: Settings, qwen3: Any) -> None:
    """One place and two parked at most: of five replays sent, one is queued, two parked,
    two refused (nothing kept of them in Redis); the sweep finds the refused ones in
    PostgreSQL and offers them again, refused while the list is full, parked once it has
    room."""
    store = worker_store
    settings = worker_settings.model_copy(update={"replay_project_running": 1,
                                                  "replay_project_parked": 2})
    store.settings = settings
    run_id = project_run(store, "flood")
    episodes = [record(store, episode(qwen3, run_id, i), f"c{i}") for i in range(5)]
    answers = [fair.offer(settings, fair.REPLAY, "trajstore.replay_episode", [e], {},
                          project="flood", ticket=f"{e}@{store.stream_version(e)}")
               for e in episodes]
    assert answers == [1, 0, 0, -1, -1]
    k = fair.keys(settings, fair.REPLAY, "flood")
    redis = fair.broker.redis_client(settings)
    assert redis.llen(k.parked) == 2 and redis.scard(k.parked_tickets) == 2
    assert sweep_unprojected(store, leave_budgeted=True) == 0  # still full
    # The parked ones leave the list (as a hand-on queues them): the sweep parks the rest.
    redis.delete(k.parked, k.parked_tickets)
    assert sweep_unprojected(store, leave_budgeted=True) == 2
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 2


@pytest.mark.timeout(600)
def test_a_flood_past_the_parked_cap_is_all_projected_with_its_list_bounded(
        worker_store: EventStore, worker_settings: Settings, start_worker: Any,
        qwen3: Any) -> None:
    """A project finishes 40 episodes at once with one place and five parked at most: its
    Redis list never holds more than five, the 34 refused are offered again by the sweep
    (the worker's beat, every second here) as the list drains, and every episode is
    projected once; another project's episode is projected before the flood's backlog."""
    store = worker_store
    flood_run, neighbour_run = project_run(store, "flood"), project_run(store, "neighbour")
    flood = [record(store, episode(qwen3, flood_run, i), f"cap{i}") for i in range(FLOOD - 20)]
    neighbour = record(store, episode(qwen3, neighbour_run, 2000), "neighbour")
    worker = start_worker("--queues", "replay", "--beat", TRAJSTORE_REPLAY_PROJECT_RUNNING="1",
                          TRAJSTORE_REPLAY_PROJECT_PARKED="5")
    worker.wait_ready()
    projections = Projections(store)
    most = 0

    def done() -> bool:
        nonlocal most
        most = max(most, fair.parked_count(worker_settings, fair.REPLAY, "flood"))
        return len(projected_at(store, flood)) == len(flood)

    wait_for(lambda: projections.projected_version(neighbour), what="the neighbour's episode")
    at = projected_at(store, [neighbour])[neighbour]
    assert sum(1 for t in projected_at(store, flood).values() if t < at) < len(flood) // 2
    wait_for(done, timeout=400, what="the flood, past its parked cap")
    assert 0 < most <= 5, most
    wait_for(lambda: settled(worker_settings, "flood"), timeout=60,
             what="the places handed back")
    assert samples_per_episode(store, [*flood, neighbour]) == dict.fromkeys([*flood, neighbour],
                                                                           1)
    assert worker.proc.poll() is None


#: A template that loops for ever in practice, printing nothing (the renderer's budget ends it).
BUSY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.timeout(600)
def test_the_default_replay_slots_leave_a_neighbour_one_while_a_template_renders(
        worker_store: EventStore, worker_settings: Settings, start_worker: Any,
        qwen3: Any) -> None:
    """A replay worker with its default slots (``replay_project_running`` + 1) and one place
    per project: while a project's three episodes of a run whose template renders until
    ``RENDER_BUDGET_S`` (20 s here, two renders an episode) take one slot and wait parked,
    another project's episode is projected on the other slot, before the first of them."""
    store = worker_store
    hostile_run = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(hostile_run), [RunCreated(
        run_id=hostile_run, project="hostile", config=RunConfig(
            tokenizer="qwen3", chat_template=BUSY + qwen3.chat_template))], NO_STREAM)
    neighbour_run = project_run(store, "neighbour")
    worker = start_worker("--queues", "replay", TRAJSTORE_RENDER_BUDGET_S="20")
    worker.wait_ready()
    hostile = [record(store, episode(qwen3, hostile_run, i), f"h{i}") for i in range(3)]
    wait_for(lambda: fair.parked_count(worker_settings, fair.REPLAY, "hostile") == 2,
             what="the hostile project's place taken, two replays parked")
    neighbour = record(store, episode(qwen3, neighbour_run, 3000), "neighbour")
    projections = Projections(store)
    wait_for(lambda: projections.projected_version(neighbour), what="the neighbour's episode")
    assert not any(projections.projected_version(e) for e in hostile)
    assert fair.parked_count(worker_settings, fair.REPLAY, "hostile") == 2
