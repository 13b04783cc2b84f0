"""Projecting episodes in batches (the sweep's and a rebuild's way) writes the rows that
projecting them one at a time writes, idempotently, with sample lease state kept."""

from __future__ import annotations

import gc
import uuid

import pytest
from replay_episodes import SEARCH_TOOL, Script, tool_call
from test_replay_reuse import tool_episode

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeStarted, LLMCalled, RunConfig, RunCreated
from store.projections import Projections
from workers.replay.jobs.project import collector_paused, project_episode, project_episodes
from workers.replay.jobs.sweep import sweep_unprojected

TABLES = {
    "episodes": "SELECT episode_id, run_id, group_id, status, invalid_reason, reward,"
                " llm_calls, tool_calls, timelines, survivors, forks, drifted_messages,"
                " negatives, tokens, projected_version FROM episodes",
    "samples": "SELECT episode_id, kind, timeline_index, reward, prompt_length, num_tokens,"
               " num_trainable, num_drifted, token_ids, loss_mask, logprobs, error_types,"
               " error_messages, status FROM samples",
    "forks": "SELECT episode_id, agent, timeline, other, message_index, reason"
             " FROM timeline_forks",
    "tool_calls": "SELECT episode_id, agent, stream_version, tool_name, is_error,"
                  " policy_version FROM tool_calls",
    "failures": "SELECT episode_id, source, stream_version, tool_name, recovered, retried"
                " FROM failures",
}


def rows(store: EventStore, episodes: list[str]) -> dict[str, list[tuple]]:
    with store.db.connection() as conn:
        return {name: sorted(conn.execute(f"{sql} WHERE episode_id = ANY(%s)",
                                          (episodes,)).fetchall(), key=repr)
                for name, sql in TABLES.items()}


def renamed(got: dict[str, list[tuple]], ids: list[str]) -> dict[str, list[tuple]]:
    """``rows`` with each episode id replaced by its index in ``ids``, to compare the rows of
    two sets of episodes recorded alike."""
    names = {episode: str(i) for i, episode in enumerate(ids)}
    return {table: sorted(((names[r[0]], *r[1:]) for r in found), key=repr)
            for table, found in got.items()}


def rollback_episode(tok) -> list:
    """A search call that fails and is rolled back, its fix, and an answer: failures, a
    negative sample and a fork."""
    s = Script(tok, tools=[SEARCH_TOOL])
    user = {"role": "user", "content": "Who wrote Dune?"}
    bad = {"role": "assistant", "content": "",
           "tool_calls": [tool_call("search", {"q": "Dune author"})]}
    s.call([user], bad, call_id="call-bad")
    ck = s.checkpoint("turn_1")
    s.tool("search", "TypeError: unexpected argument 'q'", error_type="TypeError")
    s.failed(ck, "turn_1", retry_index=0, failed_call_id="call-bad",
             errors=["unexpected argument 'q'", "again"], error_types=["TypeError", "E2"])
    good = {"role": "assistant", "content": "",
            "tool_calls": [tool_call("search", {"query": "Dune author"})]}
    feedback = {"role": "user", "content": "The tool call failed: unexpected argument 'q'."}
    s.call([user, bad, feedback], good, call_id="call-fix")
    s.rolled_back(ck, ["call-bad"])
    s.checkpoint("turn_1", retry_count=1)
    s.tool("search", "Frank Herbert")
    s.call([user, good, {"role": "tool", "content": "Frank Herbert"}],
           {"role": "assistant", "content": "Frank Herbert."}, call_id="call-answer")
    return s.finish(1.0)


def record(store: EventStore, qwen3, run_id: str, count: int, *, prefix: str) -> list[str]:
    ids = []
    for i in range(count):
        events = (rollback_episode(qwen3) if i == 3 else
                  tool_episode(qwen3, turns=2 + i % 3, reasoning=i % 2 == 0, seed=i))
        started = events[0]
        assert isinstance(started, EpisodeStarted)
        events[0] = started.model_copy(update={"run_id": run_id, "group_id": f"g{i // 2}"})
        if i == 1:  # one invalid episode: prompt ids that are not a rendering
            k = next(j for j, e in enumerate(events) if isinstance(e, LLMCalled))
            events[k] = events[k].model_copy(update={"prompt_ids": [1, 2, 3] * 10})
        episode = f"{prefix}-{i}-{uuid.uuid4().hex[:6]}"
        store.append(episode, events, NO_STREAM)
        ids.append(episode)
    return ids


def new_run(store: EventStore) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig.model_validate({"tokenizer": "qwen3", "group_size": 2,
                                       "rollback": {"save_negative_samples": True}})
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)],
                 NO_STREAM)
    return run_id


def test_batch_writes_what_single_projections_write(store: EventStore, qwen3) -> None:
    run_id = new_run(store)
    batch = record(store, qwen3, run_id, 5, prefix="batch")
    single = record(store, qwen3, run_id, 5, prefix="single")
    unfinished = f"open-{uuid.uuid4().hex[:6]}"
    store.append(unfinished, tool_episode(qwen3, turns=1, reasoning=False)[:-2], NO_STREAM)
    missing = f"missing-{uuid.uuid4().hex[:6]}"
    outcomes = project_episodes(store, [*batch, unfinished, missing, batch[0]])
    assert [o.outcome for o in outcomes] == ["written"] * 5 + ["unfinished", "missing",
                                                               "written"]
    assert [o.status for o in outcomes[:5]] == ["completed", "invalid", "completed",
                                                "completed", "completed"]
    assert "not a rendering" in (outcomes[1].reason or "")
    for episode in single:
        assert project_episode(store, episode).outcome == "written"

    first = rows(store, batch)
    assert renamed(first, batch) == renamed(rows(store, single), single)
    assert {r[1] for r in first["samples"]} == {"positive", "negative"}
    assert ["TypeError", "E2"] in [r[11] for r in first["samples"]]
    assert first["tool_calls"] and first["forks"] and first["failures"]
    # Twice gives the same rows: everything is skipped.
    assert [o.outcome for o in project_episodes(store, batch)] == ["skipped"] * 5
    assert rows(store, batch) == first


def test_replaying_a_batch_again_keeps_lease_state(store: EventStore, qwen3) -> None:
    run_id = new_run(store)
    ids = record(store, qwen3, run_id, 4, prefix="again")
    project_episodes(store, ids)
    before = rows(store, ids)
    with store.db.transaction() as conn:
        conn.execute("UPDATE samples SET status = 'consumed', consumed_version = 3"
                     " WHERE episode_id = %s", (ids[0],))
        # As after a migration that asks for every episode to be projected again.
        conn.execute("UPDATE episodes SET projected_version = 0 WHERE episode_id = ANY(%s)",
                     (ids[:3],))
    assert sorted(Projections(store).projected_versions(ids).values())[:3] == [0, 0, 0]
    outcomes = project_episodes(store, ids)
    assert [o.outcome for o in outcomes] == ["written"] * 3 + ["skipped"]
    after = rows(store, ids)
    consumed = [r for r in after["samples"] if r[0] == ids[0]]
    assert consumed and all(r[-1] == "consumed" for r in consumed)
    assert [r[:-1] for r in after["samples"]] == [r[:-1] for r in before["samples"]]
    assert {k: v for k, v in after.items() if k != "samples"} == \
        {k: v for k, v in before.items() if k != "samples"}


def test_write_many_refuses_an_episode_twice(store: EventStore, qwen3) -> None:
    run_id = new_run(store)
    (episode,) = record(store, qwen3, run_id, 1, prefix="twice")
    project_episode(store, episode)
    projections = Projections(store)
    assert projections.write_many([]) == []
    from store.streams import read_run_events, read_streams
    from workers.replay.jobs.project import _build

    events = read_streams(store, [episode])[episode]
    projection = _build(events, read_run_events(store, {run_id})[run_id], lambda name: qwen3, {})
    with pytest.raises(ValueError, match="twice"):
        projections.write_many([projection, projection])
    assert projections.write_many([projection]) == [False]


def test_sweep_projects_in_batches(store: EventStore, qwen3, monkeypatch) -> None:
    import workers.replay.jobs.sweep as sweep

    run_id = new_run(store)
    ids = record(store, qwen3, run_id, 5, prefix="sweep")
    monkeypatch.setattr(sweep, "BATCH", 2)
    calls: list[int] = []
    original = sweep.project_episodes

    def counting(store_, batch):
        calls.append(len(batch))
        return original(store_, batch)

    monkeypatch.setattr(sweep, "project_episodes", counting)
    # Other tests' episodes share this database: sweep until ours are all projected.
    while set(ids) & set(Projections(store).finished_unprojected(1000)):
        sweep_unprojected(store, limit=1000)
    assert calls and max(calls) <= 2
    assert set(Projections(store).projected_versions(ids)) == set(ids)


def test_an_episode_the_database_cannot_hold_is_invalid_and_blocks_nothing(
        store: EventStore, qwen3) -> None:
    """An event stored before versions were bounded (or by a client that bypassed the store)
    whose policy version overflows the projections' integer column: its episode is projected
    as invalid with the reason, and the rest of the batch is written."""
    run_id = new_run(store)
    bad, _, good = record(store, qwen3, run_id, 3, prefix="overflow")  # the middle is invalid
    with store.db.transaction() as conn:
        conn.execute("ALTER TABLE events DISABLE TRIGGER USER")
        changed = conn.execute(
            "UPDATE events SET data = replace(data::text, '\"policy_version\":0,',"
            " '\"policy_version\":2147483648,')::json"
            " WHERE stream_id = %s AND type = 'llm_called'", (bad,)).rowcount
        conn.execute("ALTER TABLE events ENABLE TRIGGER USER")
    assert changed >= 1
    assert store.read_stream(bad)[1].event.policy_version == 2**31  # still readable
    outcomes = {o.episode_id: o for o in project_episodes(store, [bad, good])}
    assert outcomes[good].outcome == "written" and outcomes[good].status == "completed", outcomes
    assert outcomes[bad].outcome == "written" and outcomes[bad].status == "invalid"
    assert "cannot be stored" in (outcomes[bad].reason or "")
    assert "out of range" in (outcomes[bad].reason or "")
    with store.db.connection() as conn:
        status = conn.execute("SELECT status FROM episodes WHERE episode_id = %s",
                              (bad,)).fetchone()
    assert status == ("invalid",)


def test_an_episode_of_a_run_never_created_is_invalid_and_blocks_nothing(
        store: EventStore, qwen3) -> None:
    """An episode whose run has no run_created (its stream was never written) is projected
    as invalid with the reason, with its summary and failures, and the rest of the batch is
    written."""
    good = record(store, qwen3, new_run(store), 1, prefix="known")[0]
    orphan = record(store, qwen3, f"missing-{uuid.uuid4().hex[:8]}", 1, prefix="orphan")[0]
    outcomes = {o.episode_id: o for o in project_episodes(store, [orphan, good])}
    assert outcomes[good].outcome == "written" and outcomes[good].status == "completed"
    assert outcomes[orphan].outcome == "written" and outcomes[orphan].status == "invalid"
    assert "has no run_created" in (outcomes[orphan].reason or "")
    found = rows(store, [orphan])
    assert found["samples"] == [] and len(found["episodes"]) == 1
    assert found["episodes"][0][3] == "invalid" and len(found["tool_calls"]) == 2


def test_collector_paused_nests_restores_and_survives_errors() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_a_row_type_and_its_columns_must_agree() -> None:
    """A field added to a projection row type without its column is refused when the
    statement is built, instead of going unwritten."""
    from store.projections import ForkRow, _unnest_insert

    columns = {"episode_id": "text", "agent": "text", "timeline": "int", "other": "int",
               "message_index": "int"}
    with pytest.raises(ValueError, match="ForkRow fields .* differ from the columns"):
        _unnest_insert("timeline_forks", ForkRow, columns)
    assert _unnest_insert("timeline_forks", ForkRow, {**columns, "reason": "text"}) == (
        "INSERT INTO timeline_forks (episode_id, agent, timeline, other, message_index, reason)"
        " SELECT * FROM unnest(%b::text[], %b::text[], %b::int[], %b::int[], %b::int[],"
        " %b::text[])")
