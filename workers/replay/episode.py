"""Replaying one episode's events into timelines, samples and negative samples.

``replay_episode`` is the pure core of the replay worker: it takes the events of one episode
stream in order, the run's configuration and the tokenizer, and returns everything the
projections store. It raises ``ReplayError`` (with a reason) for an episode that cannot be
replayed; the worker records such episodes as ``invalid``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store.events import (
    ABANDONED_ERROR_TYPE,
    AttemptFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RolledBack,
    RunConfig,
)
from workers.engines.render import RenderBudgetExceeded
from workers.replay.errors import ReplayError
from workers.replay.forks import ForkPoint, merge_and_detect_forks
from workers.replay.initial import build_initial_timeline
from workers.replay.negatives import NegativeSample, build_negative, select_negatives
from workers.replay.samples import Sample, build_sample
from workers.replay.segment import Segmenter
from workers.replay.timeline import MergePolicy, Timeline

__all__ = ["ReplayResult", "code_version", "discarded_calls", "has_token_ids", "merge_policy_of",
           "needs_tokenizer", "replay_episode", "untokenized_reason"]

#: Event types that belong to a run's own stream, never to an episode's.
_RUN_STREAM_TYPES = ("run_created", "policy_updated", "policy_served")


@functools.cache
def code_version() -> str:
    """The version of the code that replays (and so of what a projection or a dataset
    version holds): the installed ``trajstore`` distribution's (``unknown`` from a checkout
    that was not installed), read once per process."""
    try:
        return f"trajstore {importlib.metadata.version('trajstore')}"
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return "trajstore unknown"


@dataclass(frozen=True)
class ReplayResult:
    """What one episode replays into.

    ``timelines``: the initial timelines, one per ``llm_called`` in stream order, with
    ``call_ids`` beside them. ``discarded_indices``: the timelines of discarded calls
    (``discarded_calls``: rolled back or abandoned), left out of merging: never absorbed,
    never absorbing, never a survivor, so none of their generated tokens is trained in a
    positive sample; ``discarded_context[i]`` lists the positions where survivor ``i`` holds
    a discarded call's output as context (loss mask 0). ``absorber[i]``: index of the
    timeline that absorbed timeline ``i`` (``None`` for a survivor or a discarded call).
    ``survivors``: the merged surviving timelines in recording order, ``survivor_indices``
    their indices. ``samples``: one per survivor, with the episode's reward (the latest
    ``reward_assigned``; None when it has none).
    ``untokenized_calls``: the call ids of LLM calls recorded without token ids, which give
    no timeline (nor sample) and are not among ``call_ids``. ``failures``: every failed
    attempt as a negative sample;
    ``negatives``: those kept under the run's cap for this episode (the cap holds per group,
    so callers combining episodes of one group apply ``select_negatives`` to their
    ``failures`` again). ``drifted_messages``: messages over all survivors whose text matched
    an absorbed timeline's but whose token ids did not.
    """

    episode_id: str | None
    run_id: str
    group_id: str
    status: str | None
    reward: float | None
    call_ids: list[str]
    timelines: list[Timeline]
    absorber: list[int | None]
    survivor_indices: list[int]
    survivors: list[Timeline]
    forks: list[ForkPoint]
    samples: list[Sample]
    failures: list[NegativeSample]
    negatives: list[NegativeSample]
    drifted_messages: int
    untokenized_calls: list[str] = dataclasses.field(default_factory=list)
    discarded_indices: list[int] = dataclasses.field(default_factory=list)
    discarded_context: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def untokenized_reason(self) -> str | None:
        """Why some LLM calls gave no timeline (see ``untokenized_reason``), or None."""
        return untokenized_reason(len(self.untokenized_calls), len(self.call_ids))


def has_token_ids(event: LLMCalled) -> bool:
    """Whether the call carries the engine's token ids. A call recorded without them (from
    OpenTelemetry spans, ``api.otlp``) is kept for analysis but cannot become a timeline."""
    return len(event.prompt_ids) > 0 or len(event.response_ids) > 0


def needs_tokenizer(events: Sequence[Event]) -> bool:
    """Whether replaying ``events`` needs the run's tokenizer: some LLM call carries token
    ids. An episode recorded without any can be replayed (into no samples) with none."""
    return any(isinstance(e, LLMCalled) and has_token_ids(e) for e in events)


def untokenized_reason(untokenized: int, tokenized: int) -> str | None:
    """The sentence saying why ``untokenized`` LLM calls (beside ``tokenized`` others) gave
    no training sample, or None when there are none."""
    if not untokenized:
        return None
    total = untokenized + tokenized
    which = "the episode's" if not tokenized else f"{untokenized} of the {total}"
    return (f"{which} LLM calls carry no token ids (captured from OTLP spans without token "
            "ids): they are stored and analysed but give no training samples")


def merge_policy_of(config: RunConfig) -> MergePolicy:
    """The merge policy a run configures. Raises TypeError when ``config`` is not a
    ``RunConfig``."""
    if not isinstance(config, RunConfig):
        raise TypeError(f"config must be a store.events.RunConfig, got {type(config).__name__}")
    return MergePolicy(compare_level=config.merge.compare_level,
                       ignore_tools=config.merge.ignore_tools)


def _check_stream(events: Sequence[Event]) -> tuple[list[Event], EpisodeStarted]:
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise TypeError(f"events must be a list of store.events.Event, got "
                        f"{type(events).__name__}")
    items = list(events)
    for i, e in enumerate(items):
        if not isinstance(e, Event):
            raise TypeError(f"events[{i}] must be a store.events.Event, got {type(e).__name__}")
    if not items or not isinstance(items[0], EpisodeStarted):
        first = items[0].type if items else "nothing"
        raise ReplayError(f"an episode stream must begin with episode_started, got {first}")
    finished_at = None
    for i, e in enumerate(items):
        if i > 0 and isinstance(e, EpisodeStarted):
            raise ReplayError(f"episode_started appears again at event {i}")
        if e.type in _RUN_STREAM_TYPES:
            raise ReplayError(f"event {i} is a {e.type}, which belongs to a run stream")
        if finished_at is not None and not isinstance(e, RewardAssigned):
            # A late reward is the one event a finished episode takes (store.eventlog).
            raise ReplayError(f"event {i} ({e.type}) comes after episode_finished at event "
                              f"{finished_at}")
        if isinstance(e, EpisodeFinished):
            finished_at = i
    return items, items[0]


def replay_episode(events: Sequence[Event], *, config: RunConfig, tokenizer: Any,
                   episode_id: str | None = None, owner: str | None = None) -> ReplayResult:
    """Replay one episode: initial timelines, merge, forks, samples, negative samples.

    ``events``: the episode stream's events in stream order (``store.events`` models);
    ``config``: the run's ``RunConfig`` (merge policy, negative samples, chat template
    override); ``tokenizer``: a fast Hugging Face tokenizer for the run's model (None will
    do when no call carries token ids, ``needs_tokenizer``). LLM calls without token ids
    are skipped: they give no timeline (nor negative sample) and are listed in
    ``untokenized_calls``. Discarded calls (``discarded_calls``) are never trained in a
    positive sample (see ``ReplayResult``). The latest ``reward_assigned`` is the episode's
    reward, late ones (after ``episode_finished``) included. ``owner``: the run's project,
    whose chat template renders past the budget mark it struck (``render.ChatRenderer``).
    Raises TypeError for arguments of the wrong type and ReplayError when the events cannot
    be replayed: a stream that does not begin with ``episode_started`` or has events other
    than ``reward_assigned`` after ``episode_finished``, a repeated call id, prompt ids that
    are not a rendering of their messages, an ``attempt_failed`` whose failed call is
    unknown.
    """
    policy = merge_policy_of(config)
    items, started = _check_stream(events)
    if not needs_tokenizer(items):
        # Nothing to segment: no Segmenter (which needs a tokenizer with a template).
        return _replay(items, started, config, policy, None, episode_id)
    try:
        segmenter = Segmenter(tokenizer, chat_template=config.chat_template, owner=owner)
        result = _replay(items, started, config, policy, segmenter, episode_id)
        if segmenter.verify():
            return result
    except ReplayError as exc:
        if isinstance(exc.__cause__, RenderBudgetExceeded):
            raise  # the full path renders the same template: its budget would go again
    # A prompt rendering taken over from an earlier call did not hold, or something could
    # not be replayed: segment every call in full, which gives the full path's result or
    # raises its error (a render past its budget is that error at once).
    return _replay(items, started, config, policy,
                   Segmenter(tokenizer, chat_template=config.chat_template, reuse=False,
                             owner=owner),
                   episode_id)


def discarded_calls(events: Sequence[Event]) -> list[str]:
    """The call ids of the LLM calls among ``events`` whose output was discarded, in the
    order they were recorded. Every door's record of a discarded call counts:

    - listed by a ``rolled_back`` (the agent loop's rollback, the gateway's
      ``X-Trajstore-Abandoned``, or a client's own events over REST);
    - named by an ``attempt_failed`` of type ``Abandoned`` (a client that says it threw the
      answer away, with or without the ``rolled_back``);
    - recorded with an ``error`` in its response (a call whose client got an error instead
      of the answer: an OpenTelemetry LLM span that ended in error).

    A call that failed and was never rolled back (the last attempt of an episode whose
    retries ran out) is not discarded: it stays in the context the episode ended with.
    Raises TypeError when ``events`` is not a sequence of events."""
    items = list(events)
    named: set[str] = set()
    for e in items:
        if isinstance(e, RolledBack):
            named.update(e.discarded_call_ids)
        elif isinstance(e, AttemptFailed) and e.failed_call_id is not None \
                and ABANDONED_ERROR_TYPE in e.error_types:
            named.add(e.failed_call_id)
        elif not isinstance(e, Event):
            raise TypeError(f"events must be store.events.Event, got {type(e).__name__}")
    out = []
    for e in items:
        if isinstance(e, LLMCalled) and (e.call_id in named or e.response.get("error")):
            out.append(e.call_id)
    return list(dict.fromkeys(out))


def _replay(items: list[Event], started: EpisodeStarted, config: RunConfig,
            policy: MergePolicy, segmenter: Segmenter | None, episode_id: str | None
            ) -> ReplayResult:
    timelines: list[Timeline] = []
    call_ids: list[str] = []
    untokenized: list[str] = []
    call_index: dict[str, int] = {}
    attempts: list[tuple[int, AttemptFailed, int]] = []
    reward: float | None = None
    status: str | None = None
    for position, event in enumerate(items):
        if isinstance(event, LLMCalled) and not has_token_ids(event):
            untokenized.append(event.call_id)
        elif isinstance(event, LLMCalled):
            assert segmenter is not None  # needs_tokenizer(items) held
            if event.call_id in call_index:
                raise ReplayError(f"call id {event.call_id!r} is recorded twice",
                                  call_id=event.call_id)
            timelines.append(build_initial_timeline(
                agent=event.agent, messages=event.messages, tools=event.tools,
                prompt_ids=event.prompt_ids, response_ids=event.response_ids,
                logprobs=event.logprobs, response=event.response,
                finish_reason=event.finish_reason, segmenter=segmenter,
                call_id=event.call_id))
            call_index[event.call_id] = len(timelines) - 1
            call_ids.append(event.call_id)
        elif isinstance(event, AttemptFailed):
            if event.failed_call_id is not None and event.failed_call_id in untokenized:
                continue  # a call without token ids is no sample, negative or not
            attempts.append((position, event, _failed_call(event, call_index, call_ids,
                                                          timelines, position)))
        elif isinstance(event, RewardAssigned):
            reward = float(event.value)  # the latest reward is the episode's
        elif isinstance(event, EpisodeFinished):
            status = event.status

    # The calls whose output was discarded (rolled back, abandoned) are left out of merging:
    # their tokens are trained only in their negative samples, are context wherever they
    # appear in a surviving timeline, and a timeline of their own is no positive sample.
    discarded = set(discarded_calls(items))
    outcome, forks = merge_and_detect_forks(
        timelines, policy, discarded=[i for i, c in enumerate(call_ids) if c in discarded])
    survivors = outcome.survivors
    samples = [
        build_sample(outcome.merged[i], timeline_index=i,
                     drifted_messages=len(outcome.drifted.get(i, ())), reward=reward)
        for i in survivors
    ]
    negative_reward = config.negatives.negative_reward
    failures = [
        build_negative(
            timelines[index], call_id=call_ids[index], checkpoint_id=attempt.checkpoint_id,
            position_key=attempt.position_key, retry_index=attempt.retry_index,
            error_messages=attempt.error_messages, error_types=attempt.error_types,
            tool_calls=attempt.failed_tool_calls or timelines[index].messages[-1].tool_calls
            or [],
            reward=negative_reward, timeline_index=index, group_id=started.group_id,
            episode_id=episode_id, occurred_at=attempt.occurred_at, failure_index=position)
        for position, attempt, index in attempts
    ]
    negatives = select_negatives(
        failures, max_per_group=config.negatives.max_negative_samples_per_group,
        enabled=config.rollback.save_negative_samples)
    return ReplayResult(
        episode_id=episode_id, run_id=started.run_id, group_id=started.group_id,
        status=status, reward=reward, call_ids=call_ids, timelines=timelines,
        absorber=outcome.absorber, survivor_indices=survivors,
        survivors=[outcome.merged[i] for i in survivors], forks=forks,
        samples=samples, failures=failures, negatives=negatives,
        drifted_messages=sum(len(v) for i, v in outcome.drifted.items() if i in survivors),
        untokenized_calls=untokenized, discarded_indices=outcome.discarded,
        discarded_context=outcome.discarded_context)


def _failed_call(attempt: AttemptFailed, call_index: dict[str, int], call_ids: list[str],
                 timelines: list[Timeline], position: int) -> int:
    """Index of the timeline of the call whose output failed: the one ``failed_call_id``
    names, or, when it names none, the agent's latest call before the attempt."""
    if attempt.failed_call_id is not None:
        index = call_index.get(attempt.failed_call_id)
        if index is None:
            raise ReplayError(f"attempt_failed at event {position} names failed call "
                              f"{attempt.failed_call_id!r}, which no earlier llm_called "
                              f"recorded", call_id=attempt.failed_call_id)
    else:
        index = next((i for i in range(len(timelines) - 1, -1, -1)
                      if timelines[i].agent == attempt.agent), None)
        if index is None:
            raise ReplayError(f"attempt_failed at event {position} names no failed call and "
                              f"agent {attempt.agent!r} made no call before it")
    if timelines[index].agent != attempt.agent:
        raise ReplayError(f"attempt_failed at event {position} is for agent "
                          f"{attempt.agent!r} but its failed call {call_ids[index]!r} was "
                          f"made by agent {timelines[index].agent!r}",
                          call_id=call_ids[index])
    return index
