"""Datasets derived from a real run in PostgreSQL by the real replay: one hash for the same
rules, exactly the rows a changed rule should change, nothing written on bad input."""

from __future__ import annotations

import gc
import math
import uuid

import dataset_rewards
import numpy as np
import pytest
from episodes import RecordedRun, record_run
from test_replay_reuse import tool_episode

from store import errors
from store.datasets import read_rows, record_trained_by
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import LLMCalled, RewardAssigned, RunConfig, RunCreated
from workers.datasets import (
    DatasetBuildError,
    DerivePool,
    EmptySelectionError,
    delete_version,
    derive_dataset,
    diff_datasets,
    get_version,
    list_versions,
)
from workers.engines import render
from workers.replay import segment
from workers.replay.jobs.project import project_episodes


@pytest.fixture
def run(store: EventStore, qwen3) -> RecordedRun:
    return record_run(store, qwen3)


def name() -> str:
    return f"ds-{uuid.uuid4().hex[:8]}"


def keys(rows, **where) -> set[tuple]:
    return {r.key for r in rows if all(getattr(r, k) == v for k, v in where.items())}


def as_keys(named: list[dict]) -> set[tuple]:
    return {(k["episode_id"], k["kind"], k["timeline_index"]) for k in named}


def stored_count(store: EventStore, dataset: str) -> tuple[int, int]:
    with store.db.connection() as conn:
        return conn.execute(
            "SELECT count(DISTINCT d.dataset_id), count(r.row_index) FROM datasets d"
            " LEFT JOIN dataset_rows r USING (dataset_id) WHERE d.name = %s",
            (dataset,)).fetchone()


def test_deriving_twice_gives_one_version_with_one_hash(store: EventStore, run) -> None:
    ds = name()
    first = derive_dataset(store, ds, [run.run_id])
    again = derive_dataset(store, ds, [run.run_id])
    assert first.created and not again.created
    assert again.version.content_hash == first.version.content_hash
    assert len(first.version.content_hash) == 64
    assert [v.version for v in list_versions(store.db, "default", ds)] == [1]
    assert first.excluded == {"unfinished": 1, "no_reward": 1}
    rows = read_rows(store.db, first.version.dataset_id)
    e = run.episodes
    assert {r.episode_id for r in rows} == {e["a0"], e["a1"], e["fail"], e["err"]}
    negatives = [r for r in rows if r.kind == "negative"]
    assert len(negatives) == 1 and negatives[0].episode_id == e["fail"]
    assert negatives[0].reward == -1.0 and negatives[0].error_types == ["TypeError", "E2"]
    assert negatives[0].failure_type == "TypeError"
    assert all(r.advantage is None for r in rows)
    assert first.version.code_version.startswith("trajstore ")
    # The rows are the samples the run's own projection holds: the same replay.
    project_episodes(store, list(e.values()))
    with store.db.connection() as conn:
        projected = {(ep, kind, ti): (bytes(t), bytes(m), bytes(lp), reward)
                     for ep, kind, ti, t, m, lp, reward in conn.execute(
                         "SELECT episode_id, kind, timeline_index, token_ids, loss_mask,"
                         " logprobs, reward FROM samples WHERE run_id = %s",
                         (run.run_id,)).fetchall()}
    derived = {r.key: (r.token_ids.tobytes(), r.loss_mask.tobytes(), r.logprobs.tobytes(),
                       r.reward) for r in rows}
    assert derived == {k: v for k, v in projected.items() if k[0] != e["bare"]}


def test_a_status_filter_removes_exactly_the_rows_of_the_episodes_it_leaves_out(
        store: EventStore, run) -> None:
    ds = name()
    base = derive_dataset(store, ds, [run.run_id])
    completed = derive_dataset(store, ds, [run.run_id],
                               {"filters": {"statuses": ["completed"]}})
    assert completed.created and completed.version.version == 2
    assert completed.version.content_hash != base.version.content_hash
    assert completed.excluded["status"] == 1
    diff = diff_datasets(store.db, "default", f"{ds}@1", f"{ds}@2")
    before = read_rows(store.db, base.version.dataset_id)
    assert as_keys(diff.removed) == keys(before, episode_id=run.episodes["err"])
    assert diff.added == [] and diff.changed == []
    assert diff.unchanged == len(before) - len(diff.removed)
    # err had reward 0: the mean reward rises by what leaving its rows out gives.
    after = read_rows(store.db, completed.version.dataset_id)
    assert diff.reward.shift == pytest.approx(np.mean([r.reward for r in after])
                                              - np.mean([r.reward for r in before]))
    assert diff.reward.shift > 0


def test_a_negative_reward_changes_exactly_the_negative_rows(store: EventStore, run) -> None:
    ds = name()
    base = derive_dataset(store, ds, [run.run_id])
    derive_dataset(store, ds, [run.run_id], {"negatives": {"reward": -0.5}})
    diff = diff_datasets(store.db, "default", (ds, 1), (ds, 2))
    before = read_rows(store.db, base.version.dataset_id)
    assert as_keys(diff.changed) == keys(before, kind="negative")
    assert not diff.added and not diff.removed
    typed = diff.by_failure_type["TypeError"]["reward"]
    assert typed is not None
    assert typed.shift == pytest.approx(0.5 / typed.rows_a)
    untouched = diff.by_failure_type["none"]["reward"]
    assert untouched is not None and untouched.shift == 0.0
    assert diff.advantage is None


def test_a_reward_function_changes_exactly_the_rows_of_the_episodes_it_rescores(
        store: EventStore, run) -> None:
    ds = name()
    base = derive_dataset(store, ds, [run.run_id])
    dataset_rewards.TABLE.clear()
    dataset_rewards.TABLE[run.episodes["a1"]] = 0.75
    scored = derive_dataset(store, ds, [run.run_id],
                            {"reward": {"function": "dataset_rewards:table"}})
    # A reward function gives the episode without a recorded reward one too.
    assert "no_reward" not in scored.excluded
    diff = diff_datasets(store.db, "default", f"{ds}@1", f"{ds}@2")
    before = read_rows(store.db, base.version.dataset_id)
    assert as_keys(diff.changed) == keys(before, episode_id=run.episodes["a1"])
    assert {k["episode_id"] for k in diff.added} == {run.episodes["bare"]}
    rows = read_rows(store.db, scored.version.dataset_id)
    assert {r.reward for r in rows if r.episode_id == run.episodes["a1"]} == {0.75}


def test_advantages_are_the_trainer_s_rollout_level_grpo(store: EventStore, run) -> None:
    import torch

    from workers.trainer.egpo import grpo_scalar_advantages
    from workers.trainer.loop import unit_ids

    derived = derive_dataset(store, name(), [run.run_id], {"advantage": {"kind": "grpo"}})
    rows = read_rows(store.db, derived.version.dataset_id)
    by_episode = {r.episode_id: r for r in rows if r.kind == "positive"}
    std = math.sqrt(0.5)  # g0: rewards 1 and 0, unbiased
    e = run.episodes
    assert by_episode[e["a0"]].advantage == pytest.approx(0.5 / (std + 1e-6))
    assert by_episode[e["a1"]].advantage == pytest.approx(-0.5 / (std + 1e-6))
    # g1: the two episodes (1, 0) and the negative (-1) are three units: mean 0, std 1.
    negative = next(r for r in rows if r.kind == "negative")
    assert negative.advantage == pytest.approx(-1.0 / (1.0 + 1e-6))
    # The trainer's function over the same samples and units gives the same advantages.
    expected = grpo_scalar_advantages(
        torch.tensor([[r.reward] for r in rows], dtype=torch.float64),
        [r.group_id for r in rows],
        units=unit_ids(episode_ids=[r.episode_id for r in rows],
                       sample_ids=list(range(len(rows))),
                       is_negative=[r.kind == "negative" for r in rows]))
    assert [r.advantage for r in rows] == pytest.approx(expected.tolist())


def test_training_only_the_last_turn_keeps_only_its_tokens(store: EventStore, run) -> None:
    ds = name()
    base = derive_dataset(store, ds, [run.run_id])
    last = derive_dataset(store, ds, [run.run_id], {"train": {"turns": "last"}})
    before = {r.key: r for r in read_rows(store.db, base.version.dataset_id)}
    after = {r.key: r for r in read_rows(store.db, last.version.dataset_id)}
    assert before.keys() == after.keys()
    changed = set()
    for key, old in before.items():
        new = after[key]
        assert np.array_equal(new.token_ids, old.token_ids)
        assert np.all(new.loss_mask <= old.loss_mask)
        assert np.flatnonzero(new.loss_mask)[-1] == np.flatnonzero(old.loss_mask)[-1]
        assert np.all(new.logprobs[new.loss_mask == 0] == 0)
        if new.loss_mask.sum() < old.loss_mask.sum():
            changed.add(key)
    # Exactly the samples with several trainable turns (runs of 1s in the mask) change.
    several = {k for k, r in before.items() if np.count_nonzero(np.diff(r.loss_mask) == 1)
               + int(r.loss_mask[0]) > 1}
    assert changed == several and len(several) == 3
    diff = diff_datasets(store.db, "default", f"{ds}@1", f"{ds}@2")
    assert as_keys(diff.changed) == several


def test_two_processes_derive_the_same_version(store: EventStore, run) -> None:
    ds = name()
    one = derive_dataset(store, ds, [run.run_id])
    two = derive_dataset(store, ds, [run.run_id], jobs=2, batch=2)
    assert two.version.content_hash == one.version.content_hash and not two.created


def test_a_batch_replays_with_the_collector_paused_and_leaves_it_as_it_was(
        store: EventStore, run) -> None:
    """The reward function runs where the batch's episodes are replayed: the collector is
    off there, and on again after the derivation (after a failed one too)."""
    assert gc.isenabled()
    dataset_rewards.COLLECTOR.clear()
    derive_dataset(store, name(), [run.run_id],
                   {"reward": {"function": "dataset_rewards:collector_state"}})
    assert dataset_rewards.COLLECTOR == [False] * 5  # every finished episode, none on
    assert gc.isenabled()
    dataset_rewards.FAIL_ON[:] = [run.episodes["err"]]
    with pytest.raises(DatasetBuildError):
        derive_dataset(store, name(), [run.run_id],
                       {"reward": {"function": "dataset_rewards:raise_on"}})
    assert gc.isenabled()
    gc.disable()
    try:
        derive_dataset(store, name(), [run.run_id])
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()


def _forget_replay_caches(monkeypatch) -> None:
    """Empty the process's caches of replay: first calls' segmentations, accepted
    generation prompts, compiled templates (with their memoized tojson) and the renders
    compared with apply_chat_template."""
    monkeypatch.setattr(segment, "_FIRST_CALLS", segment.weakref.WeakKeyDictionary())
    monkeypatch.setattr(segment, "_ACCEPTED", {})
    monkeypatch.setattr(render, "_compiled", {})
    monkeypatch.setattr(render, "_verified", {})


def one_call_run(store: EventStore, tok, chat_template: str | None = None) -> str:
    """A run (with ``chat_template`` as its own template) of one episode of a single LLM
    call (a final answer; reward 1), whose prompt the tokenizer's template rendered; the
    same events in every such run."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig.model_validate({"tokenizer": "qwen3", "chat_template": chat_template})
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    events = tool_episode(tok, turns=0, reasoning=False)
    assert sum(isinstance(e, LLMCalled) for e in events) == 1
    started = events[0].model_copy(update={"run_id": run_id, "group_id": "g"})
    store.append(f"one-{uuid.uuid4().hex[:8]}", [started, *events[1:]], NO_STREAM)
    return run_id


def test_the_replay_caches_of_the_process_never_change_a_version(
        store: EventStore, qwen3, run, monkeypatch) -> None:
    """Caches kept between derivations (an episode's first call segmented once per
    template and tools, a template's accepted generation prompts, compiled templates) give
    the version a process with none of them gives; and a run whose own template renders
    its prompts otherwise (here: a prefix the recorded prompts lack) does not take the
    segmentation of the same first call under the tokenizer's template, which would give it
    rows (its only call is the first: no later call renders with its template)."""
    warm = derive_dataset(store, name(), [run.run_id])
    again = derive_dataset(store, name(), [run.run_id])  # every first call from the cache
    _forget_replay_caches(monkeypatch)
    cold = derive_dataset(store, name(), [run.run_id])
    assert warm.version.content_hash == again.version.content_hash == \
        cold.version.content_hash
    assert warm.excluded == cold.excluded == {"unfinished": 1, "no_reward": 1}
    plain = one_call_run(store, qwen3)
    assert derive_dataset(store, name(), [plain]).version.num_rows == 1  # now cached
    other = one_call_run(store, qwen3, chat_template="Prefix " + qwen3.chat_template)
    for _ in range(2):  # the cache as it is, then none
        with pytest.raises(EmptySelectionError, match=r"0 gave rows.*invalid 1"):
            derive_dataset(store, name(), [other])
        _forget_replay_caches(monkeypatch)


def test_a_reward_function_that_raises_writes_nothing(store: EventStore, run) -> None:
    ds = name()
    dataset_rewards.FAIL_ON[:] = [run.episodes["err"]]
    with pytest.raises(DatasetBuildError) as info:
        derive_dataset(store, ds, [run.run_id],
                       {"reward": {"function": "dataset_rewards:raise_on"}})
    message = str(info.value)
    assert run.episodes["err"] in message and "RuntimeError: grader unavailable" in message
    assert info.value.field == "rules.reward.function"
    assert stored_count(store, ds) == (0, 0)
    with pytest.raises(DatasetBuildError, match="'high'.*not a finite number"):
        derive_dataset(store, ds, [run.run_id],
                       {"reward": {"function": "dataset_rewards:not_a_number"}})
    assert stored_count(store, ds) == (0, 0)


def test_rules_that_select_nothing_are_an_error_saying_so(store: EventStore, run) -> None:
    ds = name()
    with pytest.raises(EmptySelectionError,
                       match=r"select nothing.*of 6 episode\(s\), 0 gave rows.*task 5, unfin"):
        derive_dataset(store, ds, [run.run_id], {"filters": {"tasks": ["no-such-task"]}})
    with pytest.raises(EmptySelectionError, match="no_reward 1, nothing_trained 4, unfinished 1"):
        derive_dataset(store, ds, [run.run_id], {"train": {"agents": ["critic"]}})
    assert stored_count(store, ds) == (0, 0)


def test_bad_input_is_refused_naming_what_is_wrong(store: EventStore, run) -> None:
    with pytest.raises(errors.NotFoundError, match="no run 'nope'"):
        derive_dataset(store, name(), [run.run_id, "nope"])
    with pytest.raises(errors.ValidationError) as info:
        derive_dataset(store, name(), [run.run_id],
                       {"reward": {"function": "no_such_module_here:f"}})
    assert info.value.field == "rules.reward.function"
    with pytest.raises(errors.ValidationError) as info:
        derive_dataset(store, name(), [run.run_id], {"negatives": {"cap": -1}})
    assert info.value.field == "rules.negatives.cap"
    with pytest.raises(errors.ValidationError) as info:
        derive_dataset(store, name(), [run.run_id], {"filters": {"colour": "red"}})
    assert info.value.field == "rules.filters.colour"
    with pytest.raises(errors.ValidationError) as info:
        derive_dataset(store, "diff", [run.run_id])
    assert info.value.field == "name"
    with pytest.raises(errors.NotFoundError, match="in project 'other'"):
        derive_dataset(store, name(), [run.run_id], project="other")


def test_a_version_cannot_be_changed_and_is_deleted_only_untrained(
        store: EventStore, run) -> None:
    ds = name()
    version = derive_dataset(store, ds, [run.run_id]).version
    with pytest.raises(errors.RefusedError, match="immutable"):
        with store.db.transaction() as conn:
            conn.execute("UPDATE dataset_rows SET reward = 5 WHERE dataset_id = %s",
                         (version.dataset_id,))
    with pytest.raises(errors.RefusedError, match="immutable"):
        with store.db.transaction() as conn:
            conn.execute("DELETE FROM dataset_rows WHERE dataset_id = %s",
                         (version.dataset_id,))
    with pytest.raises(errors.RefusedError, match="immutable"):
        with store.db.transaction() as conn:
            conn.execute("UPDATE datasets SET name = 'x' WHERE dataset_id = %s",
                         (version.dataset_id,))
    record_trained_by(store.db, version.dataset_id, run_id=run.run_id, step=3)
    with pytest.raises(errors.RefusedError, match="step 3"):
        delete_version(store.db, "default", ds, 1)
    found = get_version(store.db, "default", ds, 1)
    assert found is not None and found.trained_by[0]["step"] == 3
    assert stored_count(store, ds)[1] == version.num_rows

    other = name()
    derive_dataset(store, other, [run.run_id])
    delete_version(store.db, "default", other, 1)
    assert stored_count(store, other) == (0, 0)
    with pytest.raises(errors.NotFoundError):
        delete_version(store.db, "default", other, 1)


def test_a_dataset_of_two_runs_holds_the_rows_of_both(store: EventStore, qwen3, run) -> None:
    second = record_run(store, qwen3)
    derived = derive_dataset(store, name(), [run.run_id, second.run_id])
    rows = read_rows(store.db, derived.version.dataset_id)
    assert {r.run_id for r in rows} == {run.run_id, second.run_id}
    alone = [derive_dataset(store, name(), [r.run_id]).version.num_rows
             for r in (run, second)]
    assert derived.version.num_rows == sum(alone)
    assert derived.version.run_ids == [run.run_id, second.run_id]
    elsewhere = record_run(store, qwen3, project=f"p-{uuid.uuid4().hex[:6]}")
    with pytest.raises(errors.ValidationError, match="several projects"):
        derive_dataset(store, name(), [run.run_id, elsewhere.run_id])


def _rows_of(store: EventStore, derived) -> list[tuple]:
    return [(r.key, r.agent, r.prompt_length, r.reward, r.advantage, r.failure_type,
             r.error_types, r.token_ids.tobytes(), r.loss_mask.tobytes(), r.logprobs.tobytes(),
             r.row_hash) for r in read_rows(store.db, derived.version.dataset_id)]


def test_the_projection_path_gives_the_replay_s_rows_and_falls_back_where_it_must(
        store: EventStore, run) -> None:
    e = run.episodes
    # Nothing projected yet: every episode replays.
    before = derive_dataset(store, name(), [run.run_id], {"advantage": {"kind": "grpo"}})
    assert before.from_projection == 0 and before.replayed == 6
    project_episodes(store, list(e.values()))
    # A late reward projected again (current), one not projected yet (stale: replayed),
    # and one projection written by other code (replayed).
    store.append(e["a1"], [RewardAssigned(value=0.25)])
    project_episodes(store, [e["a1"]])
    store.append(e["err"], [RewardAssigned(value=0.75)])
    with store.db.transaction() as conn:
        conn.execute("UPDATE episodes SET projected_by = 'trajstore 0.0.0' WHERE episode_id = %s",
                     (e["a0"],))
    pool = DerivePool(store.db.url, jobs=2)
    for rules in ({"advantage": {"kind": "grpo"}},
                  {"negatives": {"cap": 0}, "filters": {"statuses": ["completed", "error"]}},
                  {"train": {"agents": ["main"]}, "reward": {"source": None}},
                  {"negatives": {"reward": -0.5}},  # a rule that replays otherwise
                  # Re-scored from the projection's samples, the reward function given every
                  # event of the episode (its LLM calls counted).
                  {"reward": {"function": "dataset_rewards:llm_calls"},
                   "advantage": {"kind": "grpo"}},
                  {"train": {"turns": "last"}}):
        fast = derive_dataset(store, name(), [run.run_id], rules)
        slow = derive_dataset(store, name(), [run.run_id], rules, from_projection=False)
        pooled = derive_dataset(store, name(), [run.run_id], rules, pool=pool, batch=2)
        assert slow.from_projection == 0 and slow.replayed == 6
        assert fast.version.content_hash == slow.version.content_hash, rules
        assert pooled.version.content_hash == slow.version.content_hash, rules
        assert _rows_of(store, fast) == _rows_of(store, slow)
        assert fast.excluded == slow.excluded and fast.episodes == slow.episodes
        if "turns" in rules.get("train", {}) or "reward" in rules.get("negatives", {}):
            assert fast.from_projection == 0, rules
        else:
            # fail, a1 (projected again after its late reward) and bare; not err (stale),
            # a0 (other code) nor open (never projected: unfinished).
            assert fast.from_projection == 3 and fast.replayed == 3, rules
            assert pooled.from_projection == 3, rules
        rows = read_rows(store.db, fast.version.dataset_id)
        if rules == {"advantage": {"kind": "grpo"}}:
            # The late rewards: err's 0.75 replayed, a1's 0.25 from the projection.
            assert {r.reward for r in rows if r.episode_id == e["a1"]} == {0.25}
            assert {r.reward for r in rows if r.episode_id == e["err"]} == {0.75}
            assert any(r.kind == "negative" for r in rows)
        if "function" in rules.get("reward", {}):
            calls = {ep: sum(r.event.type == "llm_called" for r in store.read_stream(ep))
                     for ep in e.values()}
            assert {(r.episode_id, r.reward) for r in rows if r.kind == "positive"} == \
                {(r.episode_id, float(calls[r.episode_id])) for r in rows
                 if r.kind == "positive"}
            assert max(calls.values()) > 1
        if rules == {"negatives": {"reward": -0.5}}:
            negatives = [r for r in rows if r.kind == "negative"]
            assert negatives and all(r.reward == -0.5 for r in negatives)
    pool.close()


def test_a_projection_with_a_conflict_is_replayed(store: EventStore, run) -> None:
    e = run.episodes
    project_episodes(store, list(e.values()))
    with store.db.transaction() as conn:
        # A sample a trainer held when its episode was projected again: what it holds may
        # differ from the replay's, so the episode replays.
        conn.execute(
            "INSERT INTO projection_conflicts (episode_id, run_id, kind, timeline_index,"
            " sample_id, sample_status, action, columns, projected_version)"
            " SELECT episode_id, run_id, kind, timeline_index, sample_id, 'leased', 'change',"
            " '{reward}', 1 FROM samples WHERE episode_id = %s AND kind = 'positive' LIMIT 1",
            (e["a0"],))
        conn.execute("UPDATE samples SET logprobs = '' WHERE episode_id = %s", (e["a0"],))
    fast = derive_dataset(store, name(), [run.run_id])
    slow = derive_dataset(store, name(), [run.run_id], from_projection=False)
    assert fast.version.content_hash == slow.version.content_hash
    assert fast.from_projection == 4  # a1, fail, err and bare; a0 replayed
