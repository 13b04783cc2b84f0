"""Per-project budgets on the shared queues (``workers.fair``) against a real Redis and the
real Celery queues it brokers: places taken or parked, parked messages handed on oldest first
at the queue's tail, a parked ticket held once, a hand-on whose sender died done again after
its grace, places whose tasks never ended handed on by the sweep, and a bad setting refused
naming it. Expiries are reached by passing a later ``now``, not by sleeping."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from store.settings import Settings
from workers import broker, fair

REPLAY = "trajstore.replay_episode"


@pytest.fixture
def settings(tmp_path: Path, broker_url: str) -> Settings:
    return Settings(redis_url=broker_url, data_dir=tmp_path, replay_project_running=2,
                    visibility_timeout_s=5)


def queued(settings: Settings, queue: str = "replay") -> list[tuple[list[Any], dict[str, Any]]]:
    """The messages waiting on ``queue``, oldest first: each task's args and kwargs (Celery's
    message protocol 2: a JSON envelope around a base64 JSON body)."""
    client = broker.redis_client(settings)
    raw = client.lrange(f"{settings.redis_key_prefix}{queue}", 0, -1)
    out = []
    for item in reversed(raw):  # kombu pushes on the left and takes from the right
        body = json.loads(base64.b64decode(json.loads(item)["body"]))
        out.append((body[0], body[1]))
    return out


def send(settings: Settings, project: str, episode: str) -> bool:
    return fair.send(settings, fair.REPLAY, REPLAY, [episode], {}, project=project,
                     ticket=f"{episode}@1")


def budget(project: str, episode: str) -> dict[str, str]:
    return {"project": project, "ticket": f"{episode}@1"}


def test_a_project_over_its_places_is_parked_and_handed_on_oldest_first(
        settings: Settings) -> None:
    sent = [send(settings, "flood", f"a{i}") for i in range(5)]
    assert sent == [True, True, False, False, False]
    assert fair.places_held(settings, fair.REPLAY, "flood") == 2
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 3
    # Another project has places of its own: queued behind only the flood's two.
    assert send(settings, "neighbour", "b0")
    assert [args for args, _ in queued(settings)] == [["a0"], ["a1"], ["b0"]]
    assert queued(settings)[2][1] == {"budget": budget("neighbour", "b0")}

    # a0 ends: its place goes to the oldest parked replay, queued at the tail.
    assert fair.finish(settings, fair.REPLAY, budget("flood", "a0")) == 1
    assert [args for args, _ in queued(settings)] == [["a0"], ["a1"], ["b0"], ["a2"]]
    assert queued(settings)[3][1] == {"budget": budget("flood", "a2")}
    assert fair.places_held(settings, fair.REPLAY, "flood") == 2
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 2
    # the handed-on replay runs on the place it was given (2: held already)
    assert fair.take(settings, fair.REPLAY, REPLAY, ["a2"], {}, budget("flood", "a2")) == 2

    # Each end hands one more on; the last ends leave nothing held or parked.
    for episode in ("a1", "a2", "a3", "a4"):
        fair.finish(settings, fair.REPLAY, budget("flood", episode))
    assert [args for args, _ in queued(settings)][4:] == [["a3"], ["a4"]]
    assert fair.places_held(settings, fair.REPLAY, "flood") == 0
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 0
    assert fair.places_held(settings, fair.REPLAY, "neighbour") == 1


def test_a_parked_ticket_is_parked_once_and_a_placed_one_runs_again(settings: Settings) -> None:
    """A message delivered again after its worker died (acks_late), or a batch the dispatcher
    sends again after dying before it saved its position, finds its ticket where it left
    it."""
    for episode in ("a0", "a1", "a2"):
        send(settings, "flood", episode)
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 1
    # the parked one again: still parked, once
    assert fair.take(settings, fair.REPLAY, REPLAY, ["a2"], {}, budget("flood", "a2")) == 0
    assert not send(settings, "flood", "a2")
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 1
    # a placed one again: it holds its place (sent again, run again), nothing more is taken
    assert fair.take(settings, fair.REPLAY, REPLAY, ["a0"], {}, budget("flood", "a0")) == 2
    assert send(settings, "flood", "a0")
    assert fair.places_held(settings, fair.REPLAY, "flood") == 2
    assert fair.in_hand(settings, fair.REPLAY, [("flood", "a0@1"), ("flood", "a2@1"),
                                                 ("flood", "a9@1"), ("other", "a0@1")]) \
        == {"a0@1", "a2@1"}


def test_a_task_without_a_budget_runs_and_a_parked_one_returns_none(settings: Settings) -> None:
    ran: list[str] = []

    def play(name: str) -> str:
        ran.append(name)
        return "done"

    assert fair.within(settings, fair.REPLAY, REPLAY, ["x"], {}, None,
                       lambda: play("x")) == "done"
    for episode in ("a0", "a1"):
        send(settings, "flood", episode)
    # a third replay reaching a worker with no place (its own expired meanwhile) is parked
    # there and not played; one that holds its place is played and hands it on when done
    assert fair.within(settings, fair.REPLAY, REPLAY, ["a2"], {}, budget("flood", "a2"),
                       lambda: play("a2")) is None
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 1

    def fails() -> None:
        ran.append("a0")
        raise RuntimeError("replay failed")

    with pytest.raises(RuntimeError, match="replay failed"):
        fair.within(settings, fair.REPLAY, REPLAY, ["a0"], {}, budget("flood", "a0"), fails)
    assert ran == ["x", "a0"]
    # the failed replay's place went to the parked one all the same
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 0
    assert queued(settings)[-1] == (["a2"], {"budget": budget("flood", "a2")})


def test_a_hand_on_whose_sender_died_is_done_again_after_its_grace(settings: Settings) -> None:
    for episode in ("a0", "a1", "a2", "a3"):
        send(settings, "flood", episode)
    k = fair.keys(settings, fair.REPLAY, "flood")
    now = time.time()
    # The first half of a hand-on (the script that gives a0's place to a2 and marks a2
    # releasing), and then the process dies: a2 was never queued.
    client = broker.redis_client(settings)
    freed = client.eval(fair._RELEASE, 5, k.running, k.parked, k.parked_tickets, k.releasing,
                        k.admitted, now, 2, now + fair.ticket_s(settings), "a0@1",
                        now + fair.RELEASE_GRACE_S)
    assert [json.loads(m)["args"] for m in freed] == [["a2"]]
    before = len(queued(settings))
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 2  # still on the list
    # a1 ends within the grace: its place goes to a3, and a2 is not queued twice meanwhile
    assert fair.finish(settings, fair.REPLAY, budget("flood", "a1"), now=now + 1) == 1
    assert [a for a, _ in queued(settings)[before:]] == [["a3"]]
    # past the grace, the next hand-on queues a2 on the place it still holds
    assert fair.finish(settings, fair.REPLAY, budget("flood", "a3"),
                       now=now + fair.RELEASE_GRACE_S + 1) == 1
    assert [a for a, _ in queued(settings)[before:]] == [["a3"], ["a2"]]
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 0


def test_places_whose_tasks_never_ended_are_handed_on_by_the_sweep(settings: Settings) -> None:
    for episode in ("a0", "a1", "a2"):
        send(settings, "flood", episode)
    # the same project's rollouts have places of their own (rollout_project_running)
    assert fair.take(settings, fair.ROLLOUT, "trajstore.rollout_group", ["run", "t"], {},
                     {"project": "flood", "ticket": "r0"}) == 1
    assert fair.release_stranded(settings) == 0  # every place is still held
    # a0 and a1's workers died and their messages were lost (no end, no redelivery): once
    # their places expire, the sweep hands them to the parked replay
    later = time.time() + fair.ticket_s(settings) + 1
    assert fair.in_hand(settings, fair.REPLAY, [("flood", "a0@1")], now=later) == set()
    assert fair.release_stranded(settings, now=later) == 1
    assert queued(settings)[-1] == (["a2"], {"budget": budget("flood", "a2")})
    assert fair.parked_count(settings, fair.REPLAY, "flood") == 0


def test_the_places_setting_is_checked() -> None:
    bad: Any
    for bad in (0, -1, 100_001, "many", 1.5):
        with pytest.raises(ValidationError, match="replay_project_running"):
            Settings(replay_project_running=bad)
    assert Settings().replay_project_running == 1
    assert fair.REPLAY.places(Settings(replay_project_running=7)) == 7


def test_the_parked_cap_setting_is_checked_and_only_replays_have_one() -> None:
    bad: Any
    for bad in (0, -1, 10_000_001, "many", 1.5):
        with pytest.raises(ValidationError, match="replay_project_parked"):
            Settings(replay_project_parked=bad)
    assert Settings().replay_project_parked == 1000
    assert fair.REPLAY.parked_cap(Settings(replay_project_parked=7)) == 7
    assert fair.ROLLOUT.parked_cap(Settings()) == 0  # bounded by rollout_project_queued


def test_a_replay_only_worker_runs_one_slot_more_than_a_projects_places() -> None:
    from trajstore.cli import default_concurrency

    assert default_concurrency(Settings(), ["replay"]) == 2
    assert default_concurrency(Settings(replay_project_running=3), ["replay"]) == 4
    # A budget turned off starts no hundred thousand processes.
    assert default_concurrency(Settings(replay_project_running=100_000), ["replay"]) == 32
    assert default_concurrency(Settings(rollout_groups=5), ["replay", "rollout"]) == 5
    assert default_concurrency(Settings(), ["train"]) == 1
    assert default_concurrency(Settings(), ["replay", "train"]) == 1
