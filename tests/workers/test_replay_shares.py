"""A project over its share of a replay process's CPU replays at a lower priority
(``workers.replay.jobs.shares``, on a ``workers.engines.niced.NicedThread``): the share rule
with explicit clocks, the niced thread in this process, and a real ``trajstore worker
--queues replay`` whose flooding project's replays ran on its thread at nice 10 while a
neighbour's did not, with the same samples either way."""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from store.eventlog import EventStore
from store.settings import Settings
from store.shares import Shares
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.conftest import wait_for
from tests.workers.test_replay_budget import episode, record, samples_per_episode
from tests.workers.test_replay_dispatch import project_run
from workers.engines.niced import NicedThread
from workers.replay.jobs import shares as shares_module
from workers.replay.jobs.shares import replay_at_priority, start_over_share_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a thread's own nice value is Linux's")


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return qwen3_tokenizer()


def test_a_project_alone_is_never_over_its_share() -> None:
    s = Shares(window_s=10, margin=1.25)
    for t in range(20):
        s.add("flood", 0.5, now=float(t) / 10)
    assert not s.over("flood", now=2.0)
    assert not s.over("never-seen", now=2.0)


def test_the_heavier_of_two_projects_is_over_its_share_and_the_lighter_not() -> None:
    s = Shares(window_s=10, margin=1.25)
    s.add("neighbour", 0.02, now=0.0)
    for t in range(20):
        s.add("flood", 0.05, now=t / 10)
        if t % 5 == 0:
            s.add("neighbour", 0.02, now=t / 10)
    assert s.over("flood", now=2.0)
    assert not s.over("neighbour", now=2.0)


def test_what_a_project_used_alone_is_not_held_against_it() -> None:
    """The neighbour replayed alone for two seconds; the flood's first replays find it
    within its share, and the flood, once it has taken more, over its own."""
    s = Shares(window_s=10, margin=1.25)
    for t in range(20):
        s.add("neighbour", 0.05, now=t / 10)
    s.add("flood", 0.05, now=2.0)
    s.add("neighbour", 0.05, now=2.05)
    assert not s.over("neighbour", now=2.1)
    for t in range(21, 30):
        s.add("flood", 0.05, now=t / 10)
    s.add("neighbour", 0.05, now=3.0)
    assert s.over("flood", now=3.0) and not s.over("neighbour", now=3.0)
    # Two projects that take about as much are both within their share.
    even = Shares(window_s=10, margin=1.25)
    for t in range(10):
        even.add("a", 0.05, now=t / 10)
        even.add("b", 0.055, now=t / 10)
    assert not even.over("a", now=1.0) and not even.over("b", now=1.0)


def test_a_project_idle_past_the_window_is_forgotten() -> None:
    s = Shares(window_s=10, margin=1.25)
    s.add("neighbour", 0.01, now=0.0)
    s.add("flood", 5.0, now=0.0)
    assert s.over("flood", now=1.0)
    # The neighbour replayed nothing for longer than the window: the flood is alone again.
    s.add("flood", 0.01, now=20.0)
    assert not s.over("flood", now=20.0)


def test_a_replay_is_charged_at_least_a_millisecond_and_bad_windows_are_refused() -> None:
    s = Shares(window_s=10, margin=1.25)
    s.add("b", -1.0, now=0.0)  # a clock that went back charges the minimum
    s.add("a", 0.0, now=0.0)
    s.add("a", 0.0, now=0.0)
    # 2 ms against none (b was alone when it replayed: not charged)
    assert s.over("a", now=0.0) and not s.over("b", now=0.0)
    for bad in ({"window_s": 0}, {"window_s": -1}, {"margin": 0.5}):
        with pytest.raises(ValueError, match="window_s must be > 0 and margin >= 1"):
            Shares(**{"window_s": 10, "margin": 1.25, **bad})  # type: ignore[arg-type]


def test_a_niced_thread_runs_calls_at_its_priority_and_hands_back_errors() -> None:
    thread = NicedThread(7, "test-niced")
    assert thread.niced and thread.usable()
    assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == 7
    assert thread.run(threading.get_native_id) == thread.native_id
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(
        os.PRIO_PROCESS, 0)  # the caller's priority is left alone
    with pytest.raises(KeyError, match="boom"):
        thread.run(lambda: {}["boom"])
    assert thread.run(lambda: 41 + 1) == 42  # the thread goes on after an error
    for bad in (0, 20, -1, True, 1.5, "10"):
        with pytest.raises(ValueError, match="nice must be an integer from 1 to 19"):
            NicedThread(bad, "bad")  # type: ignore[arg-type]


def _run_in_child(thread: NicedThread, answers: Any) -> None:
    try:
        thread.run(lambda: 1)
        answers.put("ran")
    except RuntimeError as exc:
        answers.put(str(exc))


def test_a_forked_child_does_not_use_its_parents_niced_thread() -> None:
    thread = NicedThread(5, "test-fork")
    ctx = multiprocessing.get_context("fork")
    answers = ctx.Queue()
    child = ctx.Process(target=_run_in_child, args=(thread, answers))
    child.start()
    child.join(60)
    assert answers.get(timeout=10) == "the niced thread 'test-fork' does not run in this process"


@pytest.fixture
def over_share_thread() -> Iterator[NicedThread]:
    thread = start_over_share_thread(Settings(replay_over_share_nice=10))
    assert thread is not None
    saved = shares_module.shares
    shares_module.shares = Shares(10, 1.25)
    yield thread
    shares_module.shares = saved


def test_a_replay_over_its_share_runs_on_the_niced_thread_and_charges_its_cpu(
        over_share_thread: NicedThread) -> None:
    settings = Settings(replay_over_share_nice=10)
    where = lambda: (threading.get_native_id(),  # noqa: E731
                     os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    mine = where()
    # The first replays: one project alone, on the caller's thread.
    assert replay_at_priority(settings, {"project": "flood"}, where) == mine
    assert replay_at_priority(settings, {"project": "neighbour"}, where) == mine
    shares_module.shares.add("flood", 1.0)
    # Now two projects replayed, and the flood took far more: it goes to the niced thread.
    before = shares_module.over_share_replays()
    assert replay_at_priority(settings, {"project": "flood"}, where) == (
        over_share_thread.native_id, 10)
    assert shares_module.over_share_replays() == before + 1
    assert replay_at_priority(settings, {"project": "neighbour"}, where) == mine
    # An exception comes back as it was raised, from either thread.
    with pytest.raises(ZeroDivisionError):
        replay_at_priority(settings, {"project": "flood"}, lambda: 1 / 0)
    # A replay without a project (no budget) runs here, uncharged.
    assert replay_at_priority(settings, None, where) == mine
    assert replay_at_priority(settings, {"project": 3}, where) == mine


def test_zero_turns_the_over_share_thread_off() -> None:
    try:
        assert start_over_share_thread(Settings(replay_over_share_nice=0)) is None
        assert shares_module.over_share_thread() is None
    finally:
        start_over_share_thread(Settings(replay_over_share_nice=10))


def test_a_replay_worker_runs_a_flooding_projects_replays_on_its_niced_thread(
        worker_store: EventStore, start_worker: Any, qwen3: Any) -> None:
    """A real ``trajstore worker --queues replay`` with one process: a project's episodes
    replayed alone run at the worker's priority; once a neighbour replays too, now and then,
    the flooding project is over its share and its later replays run on the process's thread at
    ``REPLAY_OVER_SHARE_NICE`` (which has used CPU), and every episode is projected with one
    sample, the neighbour's as well."""
    store = worker_store
    flood_run = project_run(store, f"flood-{uuid.uuid4().hex[:6]}")
    neighbour_run = project_run(store, f"neighbour-{uuid.uuid4().hex[:6]}")
    worker = start_worker("--queues", "replay", "--concurrency", "1")
    worker.wait_ready()
    log = worker.log_path
    wait_for(lambda: b"over their share of the replay CPU run at nice 10" in log.read_bytes(),
             what="the pool process's over-share thread")
    # What the pool inherited (torch, transformers) is out of the full collections.
    frozen = re.search(rb"(\d+) long-lived objects kept out of the garbage", log.read_bytes())
    assert frozen is not None and int(frozen.group(1)) > 100_000
    first = [record(store, episode(qwen3, flood_run, i), f"flood{i}") for i in range(6)]
    wait_for(lambda: all(samples_per_episode(store, first).get(e) for e in first),
             timeout=120, what="the flood's first episodes")
    neighbour = record(store, episode(qwen3, neighbour_run, 100), "neighbour")
    wait_for(lambda: samples_per_episode(store, [neighbour]).get(neighbour), timeout=120,
             what="the neighbour's episode")
    # The neighbour goes on replaying now and then (a project is over its share only while
    # another replayed within the last second).
    later = [record(store, episode(qwen3, neighbour_run if i % 5 == 0 else flood_run, i),
                    f"later{i}") for i in range(6, 36)]
    wait_for(lambda: all(samples_per_episode(store, later).get(e) for e in later),
             timeout=300, what="the later episodes")
    counts = samples_per_episode(store, [*first, neighbour, *later])
    assert set(counts.values()) == {1}, counts
    found = re.search(r"run at nice 10 on thread (\d+)", log.read_text())
    assert found is not None
    thread = int(found.group(1))
    assert os.getpriority(os.PRIO_PROCESS, thread) == 10
    fields = open(f"/proc/{thread}/stat").read().rsplit(")", 1)[1].split()
    assert int(fields[11]) + int(fields[12]) > 0  # utime + stime: it replayed
    assert worker.proc.poll() is None
