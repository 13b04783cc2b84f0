"""Replay triggered by the log: every finished episode is queued once, whichever process
appended it, across restarts of the follower, with one leading copy."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import RewardAssigned, RunConfig, RunCreated
from store.followers import ReplayDue, due_replays, leadership, load_cursor, save_cursor
from store.projections import Projections
from store.rows import LogPosition
from tests.workers.conftest import wait_for
from tests.workers.test_replay_pipeline import new_run, rollback_episode
from workers.replay.jobs.dispatch import dispatch_finished
from workers.replay.jobs.project import project_episode


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from tests.replay.replay_tokenizers import qwen3_tokenizer

    return qwen3_tokenizer()


def _follow_until(store: EventStore, want: int, name: str) -> list[str]:
    """Run the dispatcher in a thread until it has sent ``want`` episodes (or 60 s)."""
    sent: list[str] = []
    stop = threading.Event()

    def send(due: ReplayDue) -> None:
        sent.append(due.episode_id)
        if len(sent) >= want:
            stop.set()

    thread = threading.Thread(target=dispatch_finished, args=(store,),
                              kwargs={"send": send, "stop": stop, "poll_interval": 0.2,
                                      "name": name})
    thread.start()
    thread.join(timeout=60 if want else 2)
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return sent


def test_each_finish_is_sent_once_across_restarts(worker_store: EventStore, qwen3: Any) -> None:
    store = worker_store
    name = f"test-{uuid.uuid4().hex[:8]}"
    run_id = new_run(store)
    first = [f"ep-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for episode in first:
        store.append(episode, rollback_episode(qwen3, run_id, "g1"))
    # An episode still running is not sent.
    open_episode = f"ep-open-{uuid.uuid4().hex[:8]}"
    store.append(open_episode, rollback_episode(qwen3, run_id, "g1")[:-1])
    assert _follow_until(store, 3, name) == first
    saved = load_cursor(store, name)
    assert saved is not None
    # A restart sends nothing again; the next finishes are sent, in commit order.
    assert _follow_until(store, 0, name) == []
    later = [f"ep-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for episode in later:
        store.append(episode, rollback_episode(qwen3, run_id, "g2"))
    assert _follow_until(store, 2, name) == later
    after = load_cursor(store, name)
    assert after is not None and (after.tx_id, after.position) > (saved.tx_id, saved.position)
    # A cursor never goes back.
    save_cursor(store, name, LogPosition(0, 0))
    assert load_cursor(store, name) == after


def test_projected_episodes_are_not_sent_again(worker_store: EventStore, qwen3: Any) -> None:
    store = worker_store
    run_id = new_run(store)
    done, todo = f"ep-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:8]}"
    store.append(done, rollback_episode(qwen3, run_id, "g1"))
    store.append(todo, rollback_episode(qwen3, run_id, "g1"))
    assert project_episode(store, done).outcome == "written"
    # A follower with no saved position reads the log from its start: it sends only what
    # was never projected.
    assert _follow_until(store, 1, f"fresh-{uuid.uuid4().hex[:8]}") == [todo]


def test_one_copy_leads(worker_store: EventStore) -> None:
    name = f"lead-{uuid.uuid4().hex[:8]}"
    with leadership(worker_store, name) as first:
        assert first
        with leadership(worker_store, name) as second:
            assert not second
        # The standby returns at once without acting.
        assert dispatch_finished(worker_store, send=lambda e: None, stop=threading.Event(),
                                 name=name) == 0
    with leadership(worker_store, name) as again:
        assert again
    with pytest.raises(ValueError, match="1 to 200"):
        load_cursor(worker_store, "")


@pytest.mark.timeout(300)
def test_a_replay_worker_projects_episodes_appended_anywhere(
        worker_store: EventStore, start_worker: Any, qwen3: Any) -> None:
    """Episodes appended by a process that queues nothing (as the REST API, the gateway and
    remote rollout append) are projected by a replay worker without the periodic sweep,
    including those finished while no worker ran."""
    store = worker_store
    run_id = new_run(store)
    projections = Projections(store)
    before = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(before, rollback_episode(qwen3, run_id, "g1"))
    worker = start_worker("--queues", "replay")  # no --beat: no sweep
    worker.wait_ready()
    wait_for(lambda: projections.projected_version(before), what="the earlier episode")
    live = [f"ep-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for episode in live:
        store.append(episode, rollback_episode(qwen3, run_id, "g2"))
    wait_for(lambda: all(projections.projected_version(e) for e in live),
             what="the live episodes")
    # Stopped, then started again: what finished meanwhile is projected.
    worker.stop()
    while_down = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(while_down, rollback_episode(qwen3, run_id, "g3"))
    again = start_worker("--queues", "replay")
    again.wait_ready()
    wait_for(lambda: projections.projected_version(while_down), what="the episode finished "
             "while no worker ran")
    with store.db.connection() as conn:
        per_episode = dict(conn.execute(
            "SELECT episode_id, count(*) FROM samples GROUP BY episode_id").fetchall())
    assert set(per_episode) == {before, *live, while_down}
    assert set(per_episode.values()) == {3}


def test_a_late_reward_is_sent_once_and_a_running_episodes_reward_is_not(
        worker_store: EventStore, qwen3: Any) -> None:
    store = worker_store
    run_id = new_run(store)
    name = f"late-{uuid.uuid4().hex[:6]}"
    events = rollback_episode(qwen3, run_id, "g1")
    finished = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(finished, [e for e in events if e.type != "reward_assigned"])
    running = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(running, [e for e in events if e.type != "episode_finished"])
    assert _follow_until(store, 1, name) == [finished]
    assert project_episode(store, finished).outcome == "written"
    store.append(finished, [RewardAssigned(value=0.5)])
    assert _follow_until(store, 1, name) == [finished]  # the late reward, once
    assert project_episode(store, finished).outcome == "written"
    assert _follow_until(store, 0, name) == []


@pytest.mark.timeout(300)
def test_a_replay_worker_projects_a_late_reward_into_ready_samples(
        worker_store: EventStore, start_worker: Any, qwen3: Any) -> None:
    """No sweep: the worker's follower of the log sends the episode again when its late
    reward commits, and the worker process replays it."""
    store = worker_store
    run_id = new_run(store)
    projections = Projections(store)
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(episode, [e for e in rollback_episode(qwen3, run_id, "g1")
                           if e.type != "reward_assigned"])
    finished_at = store.stream_version(episode)
    wait_for(lambda: projections.projected_version(episode) == finished_at,
             what="the projection")

    def statuses() -> list[tuple[str, str, float | None]]:
        with store.db.connection() as conn:
            return conn.execute("SELECT kind, status, reward FROM samples WHERE episode_id = %s"
                                " ORDER BY kind, timeline_index", (episode,)).fetchall()

    assert statuses() == [("negative", "no_reward", -1.0), ("positive", "no_reward", None),
                          ("positive", "no_reward", None)]
    store.append(episode, [RewardAssigned(value=0.5)])
    wait_for(lambda: projections.projected_version(episode) == finished_at + 1,
             what="the late reward's projection")
    assert statuses() == [("negative", "ready", -1.0), ("positive", "ready", 0.5),
                          ("positive", "ready", 0.5)]


def project_run(store: EventStore, project: str) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project=project,
                                                    config=RunConfig(tokenizer="qwen3"))],
                 NO_STREAM)
    return run_id


def test_the_batch_query_gives_each_due_episodes_project_and_last_version(
        worker_store: EventStore, qwen3: Any) -> None:
    """The dispatcher learns each episode's project from the query that finds the due
    ones (no query per episode): its run's project, ``default`` when the run names none or
    has no ``run_created``."""
    store = worker_store
    mine, theirs, unnamed = project_run(store, "mine"), project_run(store, "theirs"), \
        new_run(store)
    episodes = {}
    for name, run_id in (("a", mine), ("b", theirs), ("c", unnamed), ("d", "no-such-run")):
        episodes[name] = f"ep-{name}-{uuid.uuid4().hex[:6]}"
        store.append(episodes[name], [e for e in rollback_episode(qwen3, run_id, "g1")
                                      if e.type != "reward_assigned"])
    finished = {n: store.stream_version(e) for n, e in episodes.items()}
    store.append(episodes["a"], [RewardAssigned(value=1.0)])  # a late reward, same batch
    appended = [(episodes[n], finished[n]) for n in "abcd"] + [(episodes["a"],
                                                                finished["a"] + 1)]
    assert due_replays(store, appended) == [
        ReplayDue(episodes["a"], finished["a"] + 1, "mine"),
        ReplayDue(episodes["b"], finished["b"], "theirs"),
        ReplayDue(episodes["c"], finished["c"], "default"),
        ReplayDue(episodes["d"], finished["d"], "default")]
    # a projected episode is not due; nor is the reward of one still running
    assert project_episode(store, episodes["b"]).outcome == "written"
    assert [d.episode_id for d in due_replays(store, appended)] == [
        episodes["a"], episodes["c"], episodes["d"]]
    assert due_replays(store, []) == []
