"""Turning episodes' events into dataset rows under ``DatasetRules``: pure functions, no I/O.

``build_episode`` replays one episode with the replay core (``workers.replay.replay_episode``,
the run's configuration with the rules' merge and negative settings put over it) and returns
its candidate rows, or why the episode is left out. ``finish_rows`` takes every episode's
candidates, caps negatives per GRPO group (earliest failure first, across the whole group),
computes advantages when the rules ask, orders the rows and hashes each one;
``content_hash`` hashes the version. Nothing here calls a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from store import errors
from store.datasets import DatasetRow
from store.events import (
    AttemptFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    MergeConfig,
    NegativeConfig,
    RewardAssigned,
    RunConfig,
    ToolReturned,
    failure_order_key,
)
from store.projections import SampleRow
from workers.datasets.rules import DatasetRules
from workers.replay.episode import needs_tokenizer, replay_episode
from workers.replay.errors import ReplayError
from workers.replay.timeline import Timeline

__all__ = ["DatasetBuildError", "EmptySelectionError", "Episode", "EpisodeOutcome",
           "ProjectedEpisode", "apply_rules_to_config", "build_episode", "content_hash",
           "finish_rows", "grpo_advantages", "projection_applies", "replays_as_run",
           "row_hash"]


class DatasetBuildError(errors.ValidationError):
    """The dataset cannot be built (a reward function that raised or returned no number);
    the message names the episode. Nothing is written."""

    def __init__(self, message: str, *, field: str | None = "rules.reward.function") -> None:
        super().__init__(message, field=field)
        self.args = (message,)


class EmptySelectionError(errors.ValidationError):
    """The rules select no row from the runs; the message says how many episodes each rule
    left out. Nothing is written."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="rules")
        self.args = (message,)


@dataclass(frozen=True)
class Episode:
    """What a reward function is called with: the episode's ids, task, final status and
    reason, policy version (of its last LLM call), the latest recorded reward (None when
    none), the error types it met (tool results and failed attempts, in order) and every
    event of its stream (``store.events`` models, in stream order)."""

    episode_id: str
    run_id: str
    group_id: str
    task_id: str | None
    status: str | None
    reason: str | None
    policy_version: int
    recorded_reward: float | None
    error_types: list[str]
    events: list[Event]


@dataclass(frozen=True)
class EpisodeOutcome:
    """One episode's candidate rows (unhashed, advantages unset), or ``excluded``: why it
    gives none (``unfinished``, ``status``, ``task``, ``version``, ``error_types``,
    ``no_reward``, ``invalid``, ``nothing_trained``). Each negative candidate comes with
    its failure's order key (``store.events.failure_order_key``) for the per-group cap."""

    episode_id: str
    run_id: str
    group_id: str
    excluded: str | None = None
    detail: str | None = None
    positives: list[DatasetRow] = dataclasses.field(default_factory=list)
    negatives: list[tuple[tuple[Any, ...], DatasetRow]] = dataclasses.field(
        default_factory=list)


@dataclass(frozen=True)
class ProjectedEpisode:
    """What an episode's current projection holds of what replay would give (see
    ``projection_applies``): the policy version of its last LLM call and its samples
    (``store.projections.SampleRow``, token columns decoded; a negative one with its
    ``failure_version``, the stream version of its failed attempt)."""

    policy_version: int
    samples: list[SampleRow]


def replays_as_run(config: RunConfig, applied: RunConfig) -> bool:
    """Whether replaying under ``applied`` (``apply_rules_to_config(config, rules)``) gives
    every episode of the run the timelines, samples and failures that replaying under the
    run's own ``config`` gave its projection: the same merge, rollback and negative reward
    (the negative cap is applied over the whole group afterwards, projection or not)."""
    return (applied.merge == config.merge and applied.rollback == config.rollback
            and applied.negatives.negative_reward == config.negatives.negative_reward)


def projection_applies(rules: DatasetRules) -> bool:
    """Whether ``rules`` may take an episode's rows from its projection at all: every turn
    trained (training only the last turn needs the timeline's message boundaries, which the
    projection does not keep). A reward function still takes the samples from the
    projection: it is called with every event of the episode, LLM calls included, which are
    then read (and not replayed). The run's configuration must replay the same way too
    (``replays_as_run``)."""
    return rules.train.turns == "all"


def apply_rules_to_config(config: RunConfig, rules: DatasetRules) -> RunConfig:
    """The run's configuration with the rules' merge and negative settings over it."""
    merge = config.merge.model_dump()
    merge.update({k: v for k, v in rules.merge.model_dump().items() if v is not None})
    negatives = config.negatives.model_dump()
    if rules.negatives.reward is not None:
        negatives["negative_reward"] = rules.negatives.reward
    if rules.negatives.cap is not None:
        negatives["max_negative_samples_per_group"] = rules.negatives.cap
    rollback = config.rollback
    if rules.negatives.enabled is not None:
        rollback = rollback.model_copy(update={"save_negative_samples": rules.negatives.enabled})
    return config.model_copy(update={"merge": MergeConfig(**merge),
                                     "negatives": NegativeConfig(**negatives),
                                     "rollback": rollback})


def _episode(episode_id: str, events: list[Event], policy_version: int | None = None
             ) -> Episode:
    started = events[0]
    assert isinstance(started, EpisodeStarted)
    status = reason = None
    reward: float | None = None
    version = started.policy_version
    error_types: list[str] = []
    for e in events:
        if isinstance(e, EpisodeFinished):
            status, reason = e.status, e.reason
        elif isinstance(e, RewardAssigned):
            reward = float(e.value)
        elif isinstance(e, LLMCalled):
            version = e.policy_version
        elif isinstance(e, ToolReturned) and e.is_error and e.error_type:
            error_types.append(e.error_type)
        elif isinstance(e, AttemptFailed):
            error_types.extend(e.error_types)
    return Episode(episode_id=episode_id, run_id=started.run_id, group_id=started.group_id,
                   task_id=started.task_id, status=status, reason=reason,
                   policy_version=version if policy_version is None else policy_version,
                   recorded_reward=reward,
                   error_types=list(dict.fromkeys(error_types)), events=events)


def _recorded_reward(episode: Episode, source: str | None) -> float | None:
    if source is None:
        return episode.recorded_reward
    value = None
    for e in episode.events:
        if isinstance(e, RewardAssigned) and e.source == source:
            value = float(e.value)
    return value


def _filtered_out(episode: Episode, rules: DatasetRules) -> str | None:
    f = rules.filters
    if f.statuses is not None and episode.status not in f.statuses:
        return "status"
    if f.tasks is not None and episode.task_id not in f.tasks:
        return "task"
    if (f.min_version is not None and episode.policy_version < f.min_version) or \
            (f.max_version is not None and episode.policy_version > f.max_version):
        return "version"
    if f.error_types is not None and not set(f.error_types) & set(episode.error_types):
        return "error_types"
    return None


def _call_reward(function: Callable[[Episode], Any], spec: str, episode: Episode) -> float:
    try:
        value = function(episode)
    except (Exception, SystemExit) as exc:  # any error of the function fails the build
        raise DatasetBuildError(f"reward function {spec} raised on episode "
                                f"{episode.episode_id!r}: {type(exc).__name__}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
            or not math.isfinite(float(value)):
        raise DatasetBuildError(f"reward function {spec} returned {value!r:.80} for episode "
                                f"{episode.episode_id!r}, not a finite number")
    return float(value)


def _last_turn(timeline: Timeline) -> tuple[np.ndarray, int] | None:
    """The loss mask of ``timeline`` with only its last trainable LLM message kept, and
    that message's first token index; None when no message is trainable."""
    offsets = []
    at = 0
    for m in timeline.messages:
        offsets.append(at)
        at += len(m.token_ids)
    for i in range(len(timeline.messages) - 1, -1, -1):
        m = timeline.messages[i]
        sampled = m.sampled_mask()
        if m.is_llm and any(sampled):
            mask = np.zeros(at, dtype=np.uint8)
            mask[offsets[i]:offsets[i] + len(sampled)] = sampled
            return mask, offsets[i]
    return None


def _row(episode: Episode, *, agent: str, kind: str, timeline_index: int, token_ids: Any,
         loss_mask: Any, logprobs: Any, prompt_length: int, timeline: Timeline | None,
         rules: DatasetRules, reward: float, failure_type: str | None,
         error_types: list[str] | None) -> DatasetRow | None:
    ids = np.asarray(token_ids, dtype=np.int32)
    mask = np.frombuffer(bytes(loss_mask), dtype=np.uint8)
    lps = np.asarray(logprobs, dtype=np.float32)
    if rules.train.turns == "last":
        assert timeline is not None, "training the last turn needs the timeline"
        last = _last_turn(timeline)
        if last is None:
            return None
        mask, _ = last
        lps = np.where(mask == 1, lps, np.float32(0.0)).astype(np.float32)
        nonzero = np.flatnonzero(mask)
        prompt_length = int(nonzero[0]) if len(nonzero) else len(mask)
    if not mask.any():
        return None
    return DatasetRow(run_id=episode.run_id, group_id=episode.group_id,
                      episode_id=episode.episode_id, agent=agent, kind=kind,
                      timeline_index=timeline_index, prompt_length=prompt_length,
                      token_ids=ids, loss_mask=mask, logprobs=lps, reward=reward, row_hash="",
                      failure_type=failure_type, error_types=error_types)


def build_episode(episode_id: str, events: Sequence[Event], *, config: RunConfig,
                  tokenizer: Any, rules: DatasetRules,
                  reward_function: Callable[[Episode], Any] | None = None,
                  applied: RunConfig | None = None,
                  projected: ProjectedEpisode | None = None) -> EpisodeOutcome:
    """The candidate rows of one episode under ``rules`` (see ``EpisodeOutcome``).
    ``config`` is the run's configuration (the rules are put over it here, unless
    ``applied`` gives ``apply_rules_to_config(config, rules)`` already: a caller building
    many episodes of one run computes it once); ``tokenizer`` the run's tokenizer (None
    will do when no call carries token ids); ``reward_function`` the loaded
    ``rules.reward.function``. Raises DatasetBuildError naming the episode when
    the reward function raises or returns anything but a finite number; an episode that
    cannot be replayed is ``invalid``, not an error.

    ``projected``: the samples of the episode's current projection, taken instead of
    replaying (the caller checked ``projection_applies``, ``replays_as_run`` and that the
    projection is of the stream's latest version, written by this code version); then
    ``events`` may leave out the ``llm_called`` events, which only replay reads."""
    items = list(events)
    if not items or not isinstance(items[0], EpisodeStarted):
        return EpisodeOutcome(episode_id, "", "", excluded="invalid",
                              detail="the stream does not begin with episode_started")
    episode = _episode(episode_id, items,
                       None if projected is None else projected.policy_version)
    out: dict[str, Any] = dict(episode_id=episode_id, run_id=episode.run_id,
                               group_id=episode.group_id)
    if episode.status is None:
        return EpisodeOutcome(**out, excluded="unfinished")
    reason = _filtered_out(episode, rules)
    if reason is not None:
        return EpisodeOutcome(**out, excluded=reason)
    if reward_function is not None:
        assert rules.reward.function is not None
        reward = _call_reward(reward_function, rules.reward.function, episode)
    else:
        recorded = _recorded_reward(episode, rules.reward.source)
        if recorded is None:
            return EpisodeOutcome(**out, excluded="no_reward")
        reward = recorded
    if applied is None:
        applied = apply_rules_to_config(config, rules)
    agents = set(rules.train.agents) if rules.train.agents is not None else None
    first_error = episode.error_types[0] if episode.error_types else None
    # (sample, timeline): a replayed survivor's sample with its merged timeline, or a
    # projected sample alone (its rules train every turn: no timeline needed).
    trained: list[tuple[Any, Timeline | None]] = []
    failed: list[tuple[Any, int | None, list[str], Timeline | None]] = []
    if projected is not None:
        for s in projected.samples:
            if s.kind == "positive":
                trained.append((s, None))
            else:
                failed.append((s, None if s.failure_version is None else s.failure_version - 1,
                               list(s.error_types or ()), None))
    else:
        try:
            result = replay_episode(items, config=applied,
                                    tokenizer=tokenizer if needs_tokenizer(items) else None,
                                    episode_id=episode_id)
        except ReplayError as exc:
            return EpisodeOutcome(**out, excluded="invalid", detail=str(exc))
        trained = list(zip(result.samples, result.survivors, strict=True))
        failed = [(n.sample, n.failure_index, list(n.error_types),
                   result.timelines[n.sample.timeline_index]) for n in result.failures]
    positives = []
    if episode.status != "aborted":  # as the projection: an aborted episode trains nothing
        for sample, timeline in trained:
            if agents is not None and sample.agent not in agents:
                continue
            row = _row(episode, agent=sample.agent, kind="positive",
                       timeline_index=sample.timeline_index, token_ids=sample.token_ids,
                       loss_mask=sample.loss_mask, logprobs=sample.logprobs,
                       prompt_length=sample.prompt_length, timeline=timeline, rules=rules,
                       reward=reward, failure_type=first_error, error_types=None)
            if row is not None:
                positives.append(row)
    negatives = []
    keep_negatives = applied.rollback.save_negative_samples
    for s, failure_index, error_types, timeline in failed if keep_negatives else []:
        if agents is not None and s.agent not in agents:
            continue
        assert s.reward is not None
        row = _row(episode, agent=s.agent, kind="negative", timeline_index=s.timeline_index,
                   token_ids=s.token_ids, loss_mask=s.loss_mask, logprobs=s.logprobs,
                   prompt_length=s.prompt_length, timeline=timeline,
                   rules=rules, reward=s.reward,
                   failure_type=error_types[0] if error_types else None,
                   error_types=error_types)
        if row is not None:
            negatives.append((failure_order_key(episode_id, failure_index), row))
    if not positives and not negatives:
        return EpisodeOutcome(**out, excluded="nothing_trained")
    return EpisodeOutcome(**out, positives=positives, negatives=negatives)


def grpo_advantages(scores: Sequence[float], *, norm_by_std: bool = True
                    ) -> tuple[float, float]:
    """``(mean, scale)`` of one group's episode rewards as GRPO normalises them (verl's
    ``compute_grpo_outcome_advantage``): the advantage of a reward r is
    ``(r - mean) / scale``, ``scale = std + 1e-6`` with the unbiased std (1 without
    ``norm_by_std``); a singleton group has mean 0 and std 1."""
    values = [float(v) for v in scores]
    if len(values) <= 1:
        mean, std = 0.0, 1.0
    else:
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, (std + 1e-6) if norm_by_std else 1.0


def finish_rows(outcomes: Sequence[EpisodeOutcome], rules: DatasetRules, config_caps:
                dict[str, int]) -> list[DatasetRow]:
    """Every kept row of ``outcomes``, ordered by (run, group, episode, kind, timeline
    index), hashed, with advantages when the rules ask. Negatives are capped per group at
    ``rules.negatives.cap`` (else the run's own cap, ``config_caps`` by run id), earliest
    failure first across the group's episodes."""
    positives: list[DatasetRow] = []
    candidates: dict[tuple[str, str], list[tuple[tuple[Any, ...], DatasetRow]]] = {}
    for o in outcomes:
        positives.extend(o.positives)
        for key, row in o.negatives:
            candidates.setdefault((row.run_id, row.group_id), []).append((key, row))
    rows = list(positives)
    for (run_id, _), items in candidates.items():
        cap = rules.negatives.cap if rules.negatives.cap is not None else config_caps[run_id]
        rows.extend(row for _, row in sorted(items, key=lambda kr: kr[0])[:cap])
    if rules.advantage is not None:
        # Rollout-level units, as the trainer takes them (workers.trainer.loop.unit_ids):
        # an episode counts once, every kept negative sample is a unit of its own.
        units: dict[tuple[str, str], dict[tuple[str, str, int], float]] = {}
        for r in rows:
            unit = (r.episode_id, "", 0) if r.kind == "positive" else r.key
            units.setdefault((r.run_id, r.group_id), {})[unit] = r.reward
        stats = {g: grpo_advantages(list(v.values()), norm_by_std=rules.advantage.norm_by_std)
                 for g, v in units.items()}
        rows = [dataclasses.replace(r, advantage=(r.reward - m) / s)
                for r in rows for m, s in [stats[(r.run_id, r.group_id)]]]
    rows.sort(key=lambda r: (r.run_id, r.group_id, r.episode_id, r.kind, r.timeline_index))
    return [dataclasses.replace(r, row_hash=row_hash(r)) for r in rows]


def row_hash(row: DatasetRow) -> str:
    """sha256 (hex) of everything a row holds but its hash."""
    head = json.dumps([row.run_id, row.group_id, row.episode_id, row.agent, row.kind,
                       row.timeline_index, row.prompt_length, repr(float(row.reward)),
                       None if row.advantage is None else repr(float(row.advantage)),
                       row.failure_type, row.error_types], separators=(",", ":"))
    h = hashlib.sha256(head.encode())
    for part in (np.asarray(row.token_ids, dtype="<i4"), np.asarray(row.loss_mask, np.uint8),
                 np.asarray(row.logprobs, dtype="<f4")):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part.tobytes())
    return h.hexdigest()


def content_hash(rows: Sequence[DatasetRow], rules_json: str, code_version: str) -> str:
    """sha256 (hex) of a version: its rows' hashes in order, its canonical rules and the
    code version that built it."""
    h = hashlib.sha256()
    h.update(b"trajstore-dataset-v1\n")
    h.update(rules_json.encode() + b"\n")
    h.update(code_version.encode() + b"\n")
    for r in rows:
        h.update(r.row_hash.encode() + b"\n")
    return h.hexdigest()
