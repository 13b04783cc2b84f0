"""Every analytics view on the seeded store (tests/analytics/conftest.py), number by number,
with each filter; the projection columns the views read; bad input."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from store import analytics
from store.analytics import (
    EpisodeOutcome,
    ErrorSignatureCount,
    FailurePattern,
    Filters,
    NegativeSampleStat,
    RollbackOutcome,
    TimelineStat,
    ToolErrorRate,
)
from store.error_signature import error_signature
from store.events import LLMCalled, RunConfig
from tests.analytics.conftest import OTHER, RUN, Seeded
from tests.analytics.rows import assert_rows
from workers.engines.tokenizers import load_tokenizer
from workers.replay.episode import replay_episode

V0 = ("e1", "e2", "e3", "e4")
V1 = ("e5", "e6")


def tokens(seeded: Seeded, *names: str) -> list[int]:
    """Generated tokens of each named episode (the length ``episode_outcomes`` averages)."""
    return [sum(len(e.response_ids) for e in seeded.events[n] if isinstance(e, LLMCalled))
            for n in names]


def mean(values: list[int] | list[float]) -> float:
    return sum(values) / len(values)


def failure_rows(run: str = RUN) -> list[FailurePattern]:
    return [
        FailurePattern(RUN, 0, "calc", "NameError", "turn_1", failures=4, episodes_affected=1,
                       tool_calls=5, share_of_calls=0.8, recovered_by_retry=0,
                       recovered_by_retry_rate=0.0, mean_retries_to_recover=None,
                       terminated_episodes=1),
        # e1 recovered after 1 retry; e2's first failure after 2, its second after 1.
        FailurePattern(RUN, 0, "search", "TypeError", "turn_1", failures=3,
                       episodes_affected=2, tool_calls=6, share_of_calls=0.5,
                       recovered_by_retry=3, recovered_by_retry_rate=1.0,
                       mean_retries_to_recover=4 / 3, terminated_episodes=0),
        FailurePattern(RUN, 0, "calc", "ZeroDivisionError", "turn_2", failures=1,
                       episodes_affected=1, tool_calls=5, share_of_calls=0.2,
                       recovered_by_retry=0, recovered_by_retry_rate=0.0,
                       mean_retries_to_recover=None, terminated_episodes=0),
        FailurePattern(RUN, 1, "search", "TypeError", "turn_1", failures=1, episodes_affected=1,
                       tool_calls=2, share_of_calls=0.5, recovered_by_retry=1,
                       recovered_by_retry_rate=1.0, mean_retries_to_recover=1.0,
                       terminated_episodes=0),
    ]


def test_failure_patterns(seeded: Seeded) -> None:
    assert_rows(analytics.failure_patterns(seeded.db, Filters(run_id=RUN)), failure_rows())
    other = analytics.failure_patterns(seeded.db, Filters(run_id=OTHER))
    # The invalid episode's failures count: they come from its events, not from the merge.
    assert [(r.tool_name, r.failures, r.tool_calls, r.recovered_by_retry) for r in other] == [
        ("search", 1, 2, 1)]


def test_failure_pattern_filters(seeded: Seeded) -> None:
    rows = failure_rows()
    db = seeded.db
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN, tool="calc")),
                [r for r in rows if r.tool_name == "calc"])
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN, error_type="TypeError")),
                [r for r in rows if r.error_type == "TypeError"])
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN, min_version=1)), rows[3:])
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN, max_version=0)), rows[:3])
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN, since=seeded.boundary)),
                rows[3:])
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN, until=seeded.boundary)),
                rows[:3])
    assert analytics.failure_patterns(db, Filters(run_id=RUN, min_version=2)) == []
    assert analytics.failure_patterns(db, Filters(run_id="no-such-run")) == []
    assert_rows(analytics.failure_patterns(db, Filters(run_id=RUN), limit=2), rows[:2])
    both = analytics.failure_patterns(db)
    assert [r.run_id for r in both] == [RUN] * 4 + [OTHER]


def test_rollback_outcomes(seeded: Seeded) -> None:
    expected = [
        # e1, e2, e3 rolled back (1 + 2 + 3); e3 exhausted its 3 retries and was terminated.
        RollbackOutcome(RUN, 0, episodes=4, episodes_with_rollback=3, rollbacks=6,
                        failed_attempts=7, rolled_back_positions=3, successful_retries=2,
                        recovery_rate=2 / 3, terminated_at_retry_limit=1,
                        mean_reward_with_rollback=1 / 3, mean_reward_without_rollback=1.0),
        RollbackOutcome(RUN, 1, episodes=2, episodes_with_rollback=1, rollbacks=1,
                        failed_attempts=1, rolled_back_positions=1, successful_retries=1,
                        recovery_rate=1.0, terminated_at_retry_limit=0,
                        mean_reward_with_rollback=1.0, mean_reward_without_rollback=0.5),
    ]
    assert_rows(analytics.rollback_outcomes(seeded.db, Filters(run_id=RUN)), expected)
    assert_rows(analytics.rollback_outcomes(seeded.db, Filters(run_id=RUN,
                                                               since=seeded.boundary)),
                expected[1:])
    assert_rows(analytics.rollback_outcomes(seeded.db, Filters(run_id=RUN, max_version=0)),
                expected[:1])
    # The invalid episode has a rollback but no reward.
    (other,) = analytics.rollback_outcomes(seeded.db, Filters(run_id=OTHER))
    assert (other.episodes, other.rollbacks, other.mean_reward_with_rollback,
            other.mean_reward_without_rollback) == (2, 1, None, 0.5)


def test_tool_error_rates(seeded: Seeded) -> None:
    expected = [
        ToolErrorRate(RUN, 0, "calc", calls=5, errors=5, error_rate=1.0, episodes=2,
                      episodes_with_errors=2, error_types=2, recovered_errors=0,
                      mean_duration_ms=5.0),
        ToolErrorRate(RUN, 0, "search", calls=6, errors=3, error_rate=0.5, episodes=3,
                      episodes_with_errors=2, error_types=1, recovered_errors=3,
                      mean_duration_ms=20.0),
        ToolErrorRate(RUN, 1, "calc", calls=1, errors=0, error_rate=0.0, episodes=1,
                      episodes_with_errors=0, error_types=0, recovered_errors=0,
                      mean_duration_ms=5.0),
        ToolErrorRate(RUN, 1, "search", calls=2, errors=1, error_rate=0.5, episodes=1,
                      episodes_with_errors=1, error_types=1, recovered_errors=1,
                      mean_duration_ms=20.0),
    ]
    assert_rows(analytics.tool_error_rates(seeded.db, Filters(run_id=RUN)), expected)
    assert_rows(analytics.tool_error_rates(seeded.db, Filters(run_id=RUN, tool="search")),
                [expected[1], expected[3]])
    assert_rows(analytics.tool_error_rates(seeded.db, Filters(run_id=RUN, min_version=1,
                                                              max_version=1)), expected[2:])


def test_episode_outcomes(seeded: Seeded) -> None:
    g1, g2_done, g2_term, g3 = (tokens(seeded, *names) for names in
                                (("e1", "e2"), ("e4",), ("e3",), ("e5", "e6")))
    expected = [
        EpisodeOutcome(RUN, 0, "g1", "completed", episodes=2, mean_reward=0.5, min_reward=0.0,
                       max_reward=1.0, mean_llm_calls=3.5, mean_tool_calls=2.5,
                       mean_tokens=mean(g1), max_tokens=max(g1)),
        EpisodeOutcome(RUN, 0, "g2", "completed", episodes=1, mean_reward=1.0, min_reward=1.0,
                       max_reward=1.0, mean_llm_calls=3.0, mean_tool_calls=2.0,
                       mean_tokens=mean(g2_done), max_tokens=max(g2_done)),
        EpisodeOutcome(RUN, 0, "g2", "terminated", episodes=1, mean_reward=0.0,
                       min_reward=0.0, max_reward=0.0, mean_llm_calls=4.0,
                       mean_tool_calls=4.0, mean_tokens=mean(g2_term),
                       max_tokens=max(g2_term)),
        EpisodeOutcome(RUN, 1, "g3", "completed", episodes=2, mean_reward=0.75,
                       min_reward=0.5, max_reward=1.0, mean_llm_calls=2.5,
                       mean_tool_calls=1.5, mean_tokens=mean(g3), max_tokens=max(g3)),
    ]
    assert_rows(analytics.episode_outcomes(seeded.db, Filters(run_id=RUN)), expected)
    assert_rows(analytics.episode_outcomes(seeded.db, Filters(run_id=RUN,
                                                              until=seeded.boundary)),
                expected[:3])
    other = analytics.episode_outcomes(seeded.db, Filters(run_id=OTHER))
    assert [(r.status, r.episodes, r.mean_reward) for r in other] == [
        ("completed", 1, 0.5), ("invalid", 1, None)]


def _replayed(seeded: Seeded, names: tuple[str, ...]) -> list[Any]:
    """The named episodes replayed by the pure replay function, as projection does."""
    return [replay_episode(seeded.events[n], config=RunConfig(tokenizer="qwen3"),
                           tokenizer=load_tokenizer("qwen3"), episode_id=seeded.ids[n])
            for n in names]


def timeline_reference(seeded: Seeded, version: int, names: tuple[str, ...]) -> TimelineStat:
    """``timeline_stats`` of the named episodes, summed in a loop over their replays."""
    results = _replayed(seeded, names)
    before = sum(len(r.timelines) for r in results)
    after = sum(len(r.survivors) for r in results)
    reasons = [f.reason for r in results for f in r.forks]
    return TimelineStat(
        RUN, version, episodes=len(results), timelines_before=before, timelines_after=after,
        merge_ratio=before / after, forks=len(reasons),
        forks_content=reasons.count("content"), forks_tool_calls=reasons.count("tool_calls"),
        forks_tools=reasons.count("tools"), forks_token_drift=reasons.count("token_drift"),
        drifted_messages=sum(r.drifted_messages for r in results),
        episodes_with_drift=sum(1 for r in results if r.drifted_messages))


def test_timeline_stats(seeded: Seeded) -> None:
    rows = analytics.timeline_stats(seeded.db, Filters(run_id=RUN))
    assert_rows(rows, [timeline_reference(seeded, 0, V0), timeline_reference(seeded, 1, V1)])
    # By hand: each rollback retry starts a timeline that forks from the failed one at the
    # regenerated tool call (e1 1, e2 2, e3 2, e5 1); the other calls extend their
    # predecessor. Rolled-back calls take no part in merging, and a retry that was rolled
    # back in turn is a timeline of discarded calls only: survivors are e1's fix and answer,
    # e2's last retry and answer, e3's last attempt (never rolled back: it terminated the
    # episode) and e4's one timeline. Qwen3 renders an earlier assistant turn without its
    # empty <think> block, so every absorbed generation drifted: only e4 absorbs any (2).
    v0, v1 = rows
    assert (v0.timelines_before, v0.timelines_after, v0.forks, v0.forks_tool_calls,
            v0.drifted_messages, v0.episodes_with_drift) == (14, 6, 5, 5, 2, 1)
    assert (v1.timelines_before, v1.timelines_after, v1.forks, v1.drifted_messages) == (
        5, 3, 1, 1)
    # The invalid episode was never merged: only e7 counts.
    (other,) = analytics.timeline_stats(seeded.db, Filters(run_id=OTHER))
    assert (other.episodes, other.timelines_before, other.timelines_after) == (1, 2, 1)


def test_negative_sample_stats(seeded: Seeded) -> None:
    expected = []
    for version, names in ((0, V0), (1, V1)):
        results = _replayed(seeded, names)
        negatives = [n.sample for r in results for n in r.failures]
        positives = sum(len(r.samples) for r in results)
        expected.append(NegativeSampleStat(
            RUN, version, positives=positives, negatives=len(negatives),
            negative_share=len(negatives) / (positives + len(negatives)),
            episodes_with_negatives=sum(1 for r in results if r.failures),
            groups_with_negatives=len({r.group_id for r in results if r.failures}),
            ready=len(negatives), leased=0, consumed=0, skipped=0, stale=0,
            mean_negative_tokens=mean([len(s.token_ids) for s in negatives]),
            mean_negative_trainable=mean([sum(s.loss_mask) for s in negatives]),
            mean_negative_reward=-1.0))
    rows = analytics.negative_sample_stats(seeded.db, Filters(run_id=RUN))
    assert_rows(rows, expected)
    # One negative per failed attempt: e1 1, e2 2, e3 4; e5 1.
    assert [(r.negatives, r.episodes_with_negatives, r.groups_with_negatives) for r in rows] \
        == [(7, 3, 2), (1, 1, 1)]
    (other,) = analytics.negative_sample_stats(seeded.db, Filters(run_id=OTHER))
    assert (other.positives, other.negatives, other.mean_negative_reward) == (1, 0, None)


def test_error_signatures(seeded: Seeded) -> None:
    rows = analytics.error_signatures(seeded.db, Filters(run_id=RUN))
    plain = [(r.tool_name, r.error_type, r.error_signature, r.failures, r.episodes_affected,
              r.first_version, r.last_version, r.example_message) for r in rows]
    assert plain == [
        # sqrt, math, sqrt, cmath: one signature
        ("calc", "NameError", "NameError: name '<str>' is not defined", 4, 1, 0, 0,
         "NameError: name 'cmath' is not defined"),
        # four messages with other names and line numbers, over both versions
        ("search", "TypeError", "TypeError: unexpected argument '<str>' at <path>:<n>", 4, 3,
         0, 1, "TypeError: unexpected argument 'q' at /srv/tools/search.py:42"),
        ("calc", "ZeroDivisionError", "ZeroDivisionError: division by zero", 1, 1, 0, 0,
         "ZeroDivisionError: division by zero"),
    ]
    for r in rows:
        assert r.first_seen is not None and r.last_seen is not None
        assert r.first_seen <= r.last_seen
    late = analytics.error_signatures(seeded.db, Filters(run_id=RUN, since=seeded.boundary))
    assert [(r.error_type, r.failures, r.example_message) for r in late] == [
        ("TypeError", 1, "TypeError: unexpected argument 'q' at /srv/tools/search.py:7")]
    named = analytics.error_signatures(seeded.db, Filters(run_id=RUN, error_type="NameError",
                                                          tool="calc"))
    assert isinstance(named[0], ErrorSignatureCount) and len(named) == 1


def test_the_views_are_the_functions_without_filters(seeded: Seeded) -> None:
    for spec in analytics.VIEWS.values():
        with seeded.db.connection() as conn:
            columns = ", ".join(spec.columns)
            by_view = conn.execute(f"SELECT {columns} FROM {spec.view} WHERE run_id = %s",
                                   (RUN,)).fetchall()
        by_query = analytics.query(seeded.db, spec, Filters(run_id=RUN))
        assert sorted(map(repr, (spec.row(*r) for r in by_view))) == sorted(
            map(repr, by_query)), spec.view
        assert by_query, f"{spec.view} has no rows for the seeded run"


def test_projection_rows_the_views_read(seeded: Seeded) -> None:
    with seeded.db.connection() as conn:
        failures = conn.execute(
            "SELECT f.episode_id, f.source, f.retry_index, f.retried, f.retries_to_recover,"
            " f.error_message, f.error_signature FROM failures f WHERE f.run_id = %s"
            " ORDER BY f.episode_id, f.stream_version", (RUN,)).fetchall()
        calls = dict(conn.execute(
            "SELECT episode_id, count(*) FROM tool_calls WHERE run_id = %s GROUP BY 1",
            (RUN,)).fetchall())
    by_episode: dict[str, list[tuple[str, int, bool, int | None]]] = {}
    for episode, source, retry, retried, retries, message, signature in failures:
        assert signature == error_signature(message)
        by_episode.setdefault(episode, []).append((source, retry, retried, retries))
    ids = seeded.ids
    assert by_episode[ids["e2"]] == [
        ("tool", 0, True, 2), ("attempt", 0, True, 2),
        ("tool", 1, True, 1), ("attempt", 1, True, 1)]
    assert by_episode[ids["e3"]] == [
        (source, retry, retry < 3, None) for retry in range(4) for source in ("tool", "attempt")]
    assert by_episode[ids["e4"]] == [("tool", 0, False, None)]
    assert calls == {ids["e1"]: 2, ids["e2"]: 3, ids["e3"]: 4, ids["e4"]: 2, ids["e5"]: 2,
                     ids["e6"]: 1}


def test_bad_filters_and_views(seeded: Seeded) -> None:
    with pytest.raises(ValueError, match="view 'rollbacks' does not take the filter.*tool"):
        analytics.rollback_outcomes(seeded.db, Filters(tool="search"))
    with pytest.raises(ValueError, match="does not take the filter.*error_type"):
        analytics.tool_error_rates(seeded.db, Filters(error_type="TypeError"))
    with pytest.raises(ValueError, match="unknown analytics view 'nope'"):
        analytics.query(seeded.db, "nope")
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        analytics.failure_patterns(seeded.db, limit=0)
    with pytest.raises(TypeError, match="limit must be an int, got str"):
        analytics.failure_patterns(seeded.db, limit="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="filters must be a Filters, got dict"):
        analytics.query(seeded.db, "failures", {"run_id": RUN})  # type: ignore[arg-type]
    assert analytics.view_named("failure_patterns") is analytics.VIEWS["failures"]


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"run_id": ""}, ValueError, "run_id must not be empty"),
    ({"tool": 3}, TypeError, "tool must be a str, got int"),
    ({"min_version": -1}, ValueError, "min_version must be >= 0, got -1"),
    ({"max_version": True}, TypeError, "max_version must be an int, got bool"),
    ({"min_version": 3, "max_version": 2}, ValueError, r"min_version \(3\) must not exceed"),
    ({"since": dt.datetime(2026, 1, 1)}, ValueError, "since must be timezone-aware"),
    ({"until": "2026-01-01"}, TypeError, "until must be a datetime, got str"),
    ({"since": dt.datetime(2026, 1, 2, tzinfo=dt.UTC),
      "until": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}, ValueError, "since .* must be before"),
])
def test_filters_refuse_bad_values(kwargs: dict[str, Any], error: type[Exception],
                                   message: str) -> None:
    with pytest.raises(error, match=message):
        Filters(**kwargs)


def test_row_as_dict() -> None:
    row = analytics.row_as_dict(failure_rows()[0])
    assert list(row) == list(analytics.VIEWS["failures"].columns)
    assert row["failures"] == 4
    with pytest.raises(TypeError, match="expected an analytics row, got int"):
        analytics.row_as_dict(3)
