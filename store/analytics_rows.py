"""Rows of the analytics views: one frozen dataclass per view, fields in the view's column
order and named as its columns (``store.analytics`` selects the fields by name).

Counts are ints; rates, means and ratios are floats, None where their denominator is zero or
there is nothing to average; times are timezone-aware datetimes.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

__all__ = [
    "FailurePattern",
    "RollbackOutcome",
    "ToolErrorRate",
    "EpisodeOutcome",
    "TimelineStat",
    "NegativeSampleStat",
    "ErrorSignatureCount",
]


@dataclass(frozen=True)
class FailurePattern:
    """Tool errors of one run, policy version, tool, error type and position.

    ``tool_calls``: calls of the tool in the run at that version (any position or outcome);
    ``share_of_calls`` = failures / tool_calls. ``recovered_by_retry``: failures whose attempt
    was rolled back and whose position the agent then passed (a checkpoint at another
    position, or the episode completed); ``mean_retries_to_recover``: retries that took,
    counted from each such failure. ``terminated_episodes``: affected episodes that ended
    ``terminated``.
    """

    run_id: str
    policy_version: int | None
    tool_name: str | None
    error_type: str | None
    position_key: str | None
    failures: int
    episodes_affected: int
    tool_calls: int
    share_of_calls: float | None
    recovered_by_retry: int
    recovered_by_retry_rate: float
    mean_retries_to_recover: float | None
    terminated_episodes: int


@dataclass(frozen=True)
class RollbackOutcome:
    """Rollback and its effect, per run and episode policy version.

    ``rolled_back_positions``: positions (agent, ``turn_N``) rolled back at least once;
    ``successful_retries``: those the agent then passed; ``recovery_rate`` their ratio.
    ``terminated_at_retry_limit``: terminated episodes whose last failure came at the run's
    ``max_tool_retries`` and was not retried. Rewards are means over episodes with and without
    any rollback.
    """

    run_id: str
    policy_version: int | None
    episodes: int
    episodes_with_rollback: int
    rollbacks: int
    failed_attempts: int
    rolled_back_positions: int
    successful_retries: int
    recovery_rate: float | None
    terminated_at_retry_limit: int
    mean_reward_with_rollback: float | None
    mean_reward_without_rollback: float | None


@dataclass(frozen=True)
class ToolErrorRate:
    """Calls and errors of one tool, per run and policy version. ``recovered_errors``: errors
    followed later in the episode by a successful call of the same tool by the same agent."""

    run_id: str
    policy_version: int | None
    tool_name: str
    calls: int
    errors: int
    error_rate: float
    episodes: int
    episodes_with_errors: int
    error_types: int
    recovered_errors: int
    mean_duration_ms: float | None


@dataclass(frozen=True)
class EpisodeOutcome:
    """Episodes of one run, policy version, group and final status: reward and length
    (LLM calls, tool calls, generated tokens)."""

    run_id: str
    policy_version: int | None
    group_id: str
    status: str
    episodes: int
    mean_reward: float | None
    min_reward: float | None
    max_reward: float | None
    mean_llm_calls: float
    mean_tool_calls: float
    mean_tokens: float
    max_tokens: int


@dataclass(frozen=True)
class TimelineStat:
    """Timeline merging per run and policy version (invalid episodes left out):
    ``merge_ratio`` = timelines before merging / after; forks by reason; messages whose
    sampled tokens differed from their re-tokenization (drift repaired by merging)."""

    run_id: str
    policy_version: int | None
    episodes: int
    timelines_before: int
    timelines_after: int
    merge_ratio: float | None
    forks: int
    forks_content: int
    forks_tool_calls: int
    forks_tools: int
    forks_token_drift: int
    drifted_messages: int
    episodes_with_drift: int


@dataclass(frozen=True)
class NegativeSampleStat:
    """Negative samples (failed attempts kept for training) against positives, per run and
    policy version, with the lease state of the negatives (``skipped``: beyond a group's
    cap)."""

    run_id: str
    policy_version: int | None
    positives: int
    negatives: int
    negative_share: float
    episodes_with_negatives: int
    groups_with_negatives: int
    ready: int
    leased: int
    consumed: int
    skipped: int
    stale: int
    mean_negative_tokens: float | None
    mean_negative_trainable: float | None
    mean_negative_reward: float | None


@dataclass(frozen=True)
class ErrorSignatureCount:
    """Tool errors of one run, tool, error type and message signature
    (``store.error_signature``), with the policy versions and times they span and the
    first raw message in code point order as an example."""

    run_id: str
    tool_name: str | None
    error_type: str | None
    error_signature: str | None
    failures: int
    episodes_affected: int
    first_version: int | None
    last_version: int | None
    first_seen: dt.datetime | None
    last_seen: dt.datetime | None
    example_message: str | None
