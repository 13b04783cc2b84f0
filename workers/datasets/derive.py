"""Deriving a dataset version from the log: select the runs' episodes, replay them under the
rules (``workers.datasets.build``), hash the rows and store the version (``store.datasets``).

``derive_dataset`` reads the events of the runs' episodes in batches, on ``jobs`` processes
when asked (started with ``spawn``, each with its own connection and tokenizers), and writes
the version in one transaction at the end: a build that fails (a reward function that
raises, rules that select nothing) writes nothing. No model is called.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from store import datasets as tables
from store import errors
from store.db import Database
from store.eventlog import EventStore, RecordedEvent
from store.events import RunConfig, RunCreated
from store.projections import Projections
from store.streams import read_run_events, read_streams
from workers.datasets.build import (
    EmptySelectionError,
    EpisodeOutcome,
    ProjectedEpisode,
    apply_rules_to_config,
    build_episode,
    content_hash,
    finish_rows,
    projection_applies,
    replays_as_run,
)
from workers.datasets.rules import DatasetRules, canonical, check_name, load_reward_function
from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer
from workers.replay import code_version

__all__ = ["BATCH", "DerivePool", "DerivedDataset", "code_version", "derive_dataset", "parse_rules"]

#: Episodes read and replayed together.
BATCH = 50


@dataclass(frozen=True)
class DerivedDataset:
    """What ``derive_dataset`` did: the version (new, or the one of the same hash that the
    name already held: ``created`` False) and, of the runs' episodes, how many gave rows and
    how many each reason left out; how many took their samples from their current
    projection (``from_projection``) and how many were read from their events whole
    (``replayed``: replayed unless left out before replay): either way the same rows."""

    version: tables.DatasetVersion
    created: bool
    episodes: int
    excluded: dict[str, int]
    from_projection: int = 0
    replayed: int = 0


def parse_rules(rules: DatasetRules | dict[str, Any] | None) -> DatasetRules:
    """``rules`` as ``DatasetRules`` (None: every default). Raises ValidationError naming the
    field (``rules.<path>``) for a rule that is not valid."""
    if rules is None:
        return DatasetRules()
    if isinstance(rules, DatasetRules):
        return rules
    try:
        return DatasetRules.model_validate(rules)
    except PydanticValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise errors.ValidationError(problem["msg"].removeprefix("Value error, "),
                                     field=f"rules.{where}" if where else "rules") from None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    # A batch allocates many containers (decoded events, messages, timelines, token lists)
    # that die by reference count once it is built; automatic collections would walk them,
    # and the whole process, for nothing (see workers.replay.jobs.project.collector_paused).
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Builder:
    """Builds the outcomes of batches of episodes of one store, keeping tokenizers and
    run configurations between batches."""

    def __init__(self, store: EventStore, rules: DatasetRules,
                 tokenizer_loader: Callable[[str | None], Any],
                 runs: dict[str, RecordedEvent] | None = None, *,
                 from_projection: bool = True) -> None:
        self.store = store
        self.rules = rules
        self.loader = tokenizer_loader
        self.tokenizers: dict[str | None, Any] = {}
        self.configs: dict[str, RunConfig | None] = {}
        #: Each run's configuration with the rules over it (``apply_rules_to_config``).
        self.applied: dict[str, RunConfig] = {}
        #: Whether episodes whose projection is current take their samples from it.
        self.from_projection = from_projection and projection_applies(rules)
        #: How many episodes took their samples from the projection, and how many replayed.
        self.counts = {"projection": 0, "replay": 0}
        known = runs or {}  # run_created events the caller read already
        for run_id in known:
            self._config(known, run_id)
        spec = rules.reward.function
        self.reward = load_reward_function(spec) if spec is not None else None

    def _config(self, runs: dict[str, RecordedEvent], run_id: str) -> RunConfig | None:
        if run_id not in self.configs:
            event = runs.get(run_id)
            self.configs[run_id] = (event.event.config if event is not None
                                    and isinstance(event.event, RunCreated) else None)
        return self.configs[run_id]

    def _applied(self, run_id: str, config: RunConfig) -> RunConfig:
        applied = self.applied.get(run_id)
        if applied is None:
            applied = self.applied[run_id] = apply_rules_to_config(config, self.rules)
        return applied

    def build(self, episode_ids: Sequence[str]) -> list[EpisodeOutcome]:
        # The whole batch, read and replay, with the collector paused (the replay allocates
        # most of it); the batch's events are dropped when ``_build`` returns, so only the
        # outcomes are left of it when the collector resumes.
        with _collector_paused():
            return self._build(episode_ids)

    def _build(self, episode_ids: Sequence[str]) -> list[EpisodeOutcome]:
        projected: dict[str, ProjectedEpisode] = {}
        with self.store.db.connection() as conn:
            if self.from_projection:
                current = Projections(self.store).current_samples(
                    episode_ids, code_version(), conn=conn)
                unknown = {owner for owner, _, _ in current.values()} - set(self.configs)
                if unknown:
                    known = read_run_events(self.store, unknown, conn=conn)
                    for owner in unknown:
                        self._config(known, owner)
                for episode_id, (owner, policy, samples) in current.items():
                    run_config = self.configs.get(owner)
                    # A run whose replay the rules change replays (so does an unknown run,
                    # which replay reports as invalid).
                    if run_config is not None and policy is not None and replays_as_run(
                            run_config, self._applied(owner, run_config)):
                        projected[episode_id] = ProjectedEpisode(policy, samples)
            # Their events but the LLM calls (the samples stand for those; a reward function
            # is called with every event, so it gets them); the others' whole.
            streams = read_streams(self.store, list(projected), conn=conn,
                                   llm_calls=self.reward is not None) if projected else {}
            rest = [e for e in episode_ids if e not in projected]
            if rest:
                streams.update(read_streams(self.store, rest, conn=conn))
            run_ids = {s[0].event.run_id for s in streams.values()  # type: ignore[attr-defined]
                       if hasattr(s[0].event, "run_id")} - set(self.configs)
            runs = read_run_events(self.store, run_ids, conn=conn) if run_ids else {}
        self.counts["projection"] += len(projected)
        self.counts["replay"] += len(episode_ids) - len(projected)
        out = []
        for episode_id in episode_ids:
            recorded = streams.get(episode_id, [])
            events = [r.event for r in recorded]
            run_id = getattr(events[0], "run_id", None) if events else None
            config = self._config(runs, run_id) if run_id else None
            if config is None:
                out.append(EpisodeOutcome(episode_id, run_id or "", "", excluded="invalid",
                                          detail="no run_created for its run"))
                continue
            from_projection = projected.get(episode_id)
            tokenizer = None
            if from_projection is None:
                try:
                    tokenizer = self._tokenizer(config)
                except TokenizerNotFound as exc:
                    out.append(EpisodeOutcome(episode_id, run_id or "", "",
                                              excluded="invalid", detail=str(exc)))
                    continue
            assert run_id is not None  # a config was found for it
            out.append(build_episode(episode_id, events, config=config, tokenizer=tokenizer,
                                     rules=self.rules, reward_function=self.reward,
                                     applied=self._applied(run_id, config),
                                     projected=from_projection))
        return out

    def _tokenizer(self, config: RunConfig) -> Any:
        name = config.tokenizer_name
        if name is None:
            return None
        if name not in self.tokenizers:
            self.tokenizers[name] = self.loader(name)
        return self.tokenizers[name]


#: The worker process's store (opened once by ``_start``) and its builders, by rules.
_store: EventStore | None = None
_builders: dict[str, _Builder] = {}


def _start(database_url: str) -> None:
    global _store
    _store = EventStore(Database(database_url, min_size=1, max_size=2))


def _build(rules_json: str, from_projection: bool, episode_ids: list[str]
           ) -> tuple[list[EpisodeOutcome], dict[str, int]]:
    assert _store is not None, "the worker process was not started by a DerivePool"
    key = f"{from_projection}:{rules_json}"
    builder = _builders.get(key)
    if builder is None:
        builder = _builders[key] = _Builder(
            _store, DatasetRules.model_validate_json(rules_json), load_tokenizer,
            from_projection=from_projection)
    before = dict(builder.counts)
    built = builder.build(episode_ids)
    return built, {k: v - before[k] for k, v in builder.counts.items()}


class DerivePool:
    """``jobs`` processes (started with ``spawn``) that read and replay batches of episodes
    for ``derive_dataset`` on the database at ``database_url``; each keeps its connection
    and tokenizers between derivations. Use it as a context manager, or call ``close``.
    Raises ValueError when ``jobs`` is not a positive whole number."""

    def __init__(self, database_url: str, *, jobs: int) -> None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs must be a positive whole number, got {jobs!r}")
        self.jobs = jobs
        self._executor = ProcessPoolExecutor(
            max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start, initargs=(database_url,))

    def build(self, rules: DatasetRules, batches: list[list[str]], *,
              from_projection: bool = True, counts: dict[str, int] | None = None
              ) -> list[EpisodeOutcome]:
        """The outcomes of ``batches`` under ``rules``, in order (``from_projection``: as
        ``derive_dataset`` takes it); ``counts`` (when given) gains how many episodes took
        their samples from the projection and how many replayed. An error in a process (a
        reward function that raised, a database error) propagates."""
        rules_json = rules.model_dump_json()
        out: list[EpisodeOutcome] = []
        for built, done in self._executor.map(_build, [rules_json] * len(batches),
                                              [from_projection] * len(batches), batches):
            out.extend(built)
            if counts is not None:
                for k, v in done.items():
                    counts[k] = counts.get(k, 0) + v
        return out

    def close(self) -> None:
        """Stop the processes."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> DerivePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def derive_dataset(
    store: EventStore,
    name: str,
    run_ids: Sequence[str],
    rules: DatasetRules | dict[str, Any] | None = None,
    *,
    project: str | None = None,
    jobs: int = 1,
    batch: int = BATCH,
    pool: DerivePool | None = None,
    tokenizer_loader: Callable[[str | None], Any] = load_tokenizer,
    from_projection: bool = True,
) -> DerivedDataset:
    """Derive a version of dataset ``name`` from the episodes of ``run_ids`` under
    ``rules`` and store it, unless the name already holds a version of the same content
    hash (then that version is returned, ``created`` False, and nothing is written).

    ``project``: the project the runs must belong to (default: theirs, which must be one).
    ``jobs`` > 1 replays on that many new processes, ``pool`` on the processes of a
    ``DerivePool`` (``batch`` episodes per read; at most as many as give every process
    work).
    ``from_projection``: an episode whose projection is current (replayed at its stream's
    latest version by this code version, no conflict recorded) takes its samples from it
    instead of being replayed, when the rules replay as the run does (the same merge,
    rollback and negative reward; no reward function; every turn trained): the rows and the
    hash are those of the replay. False replays every episode.
    Raises ValidationError (``field`` naming the rule) for a bad name, rule or reward
    function; NotFoundError for an unknown run; ``DatasetBuildError`` naming the episode
    when the reward function raises or returns no finite number; ``EmptySelectionError``
    when the rules select no row (saying how many episodes each rule left out). In every
    one of these cases nothing is written."""
    try:
        check_name(name)
    except ValueError as exc:
        raise errors.ValidationError(str(exc), field="name") from None
    parsed = parse_rules(rules)
    if isinstance(run_ids, str) or not run_ids or not all(
            isinstance(r, str) and r for r in run_ids):
        raise errors.ValidationError("runs must be a non-empty list of run ids", field="runs")
    for label, value in (("jobs", jobs), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise errors.ValidationError(f"{label} must be a positive whole number, got "
                                         f"{value!r}", field=label)
    runs = list(dict.fromkeys(run_ids))
    # The reads a derivation starts from on one pooled connection (each checkout costs round
    # trips of its own: the pool's check of the connection and the commit).
    with store.db.connection() as conn:
        projects = tables.run_projects(store, runs, conn=conn)
        episode_ids = tables.run_episode_ids(store, runs, conn=conn)
        configs = read_run_events(store, set(runs), conn=conn)
    for run_id in runs:
        if run_id not in projects:
            raise errors.NotFoundError(f"no run {run_id!r}")
    owners = set(projects.values())
    if project is not None and owners - {project}:
        other = next(r for r in runs if projects[r] != project)
        raise errors.NotFoundError(f"no run {other!r} in project {project!r}")
    if len(owners) > 1:
        raise errors.ValidationError(f"the runs belong to several projects "
                                     f"({', '.join(sorted(owners))}); a dataset has one",
                                     field="runs")
    owner = project or owners.pop()
    if parsed.reward.function is not None:
        try:
            load_reward_function(parsed.reward.function)
        except ValueError as exc:
            raise errors.ValidationError(str(exc), field="rules.reward.function") from None

    processes = pool.jobs if pool is not None else jobs
    size = max(1, min(batch, -(-len(episode_ids) // processes)))
    batches = [episode_ids[i:i + size] for i in range(0, len(episode_ids), size)]
    outcomes: list[EpisodeOutcome] = []
    counts: dict[str, int] = {}
    if pool is not None:
        outcomes = pool.build(parsed, batches, from_projection=from_projection, counts=counts)
    elif jobs == 1 or len(batches) <= 1:
        builder = _Builder(store, parsed, tokenizer_loader, configs,
                           from_projection=from_projection)
        for ids in batches:
            outcomes.extend(builder.build(ids))
        counts = builder.counts
    else:
        with DerivePool(store.db.url, jobs=jobs) as own:
            outcomes = own.build(parsed, batches, from_projection=from_projection,
                                 counts=counts)

    excluded: dict[str, int] = {}
    for o in outcomes:
        if o.excluded is not None:
            excluded[o.excluded] = excluded.get(o.excluded, 0) + 1
    caps = {r: e.event.config.negatives.max_negative_samples_per_group
            for r, e in configs.items() if isinstance(e.event, RunCreated)}
    rows = finish_rows(outcomes, parsed, caps)
    if not rows:
        why = ", ".join(f"{k} {v}" for k, v in sorted(excluded.items())) or "none left out"
        raise EmptySelectionError(
            f"the rules select nothing from run(s) {', '.join(runs)}: of "
            f"{len(episode_ids)} episode(s), {len(episode_ids) - sum(excluded.values())} gave "
            f"rows and these were left out: {why}")
    rules_json = canonical(parsed)
    version_of_code = code_version()
    digest = content_hash(rows, rules_json, version_of_code)
    kept = len({r.episode_id for r in rows})
    version, created = tables.write_version(
        store.db, project=owner, name=name, content_hash=digest,
        rules=parsed.model_dump(mode="json"), run_ids=runs, code_version=version_of_code,
        rows=rows, num_episodes=kept, excluded=excluded)
    return DerivedDataset(version=version, created=created, episodes=kept, excluded=excluded,
                          from_projection=counts.get("projection", 0),
                          replayed=counts.get("replay", 0))
