"""Plain-loop references of the analytics views, and random projection rows to run them on.

Each reference walks rows as dicts (one per projection table row) with ``for`` loops and
dictionaries, applying :class:`store.analytics.Filters` the way the SQL functions document
them: versions of the row the view groups by (None never passes a version filter), time
windows on the episode's ``finished_at`` (since inclusive, until exclusive).
"""

from __future__ import annotations

import datetime as dt
import random
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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

__all__ = ["REFERENCES", "Tables", "generate", "insert"]

Row = dict[str, Any]


@dataclass
class Tables:
    runs: list[Row] = field(default_factory=list)
    episodes: list[Row] = field(default_factory=list)
    failures: list[Row] = field(default_factory=list)
    tool_calls: list[Row] = field(default_factory=list)
    forks: list[Row] = field(default_factory=list)
    samples: list[Row] = field(default_factory=list)


def _mean(values: Iterable[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _version_ok(version: int | None, f: Filters) -> bool:
    if f.min_version is not None and (version is None or version < f.min_version):
        return False
    return not (f.max_version is not None and (version is None or version > f.max_version))


def _window_ok(episode: Row, f: Filters) -> bool:
    finished = episode["finished_at"]
    if f.since is not None and (finished is None or finished < f.since):
        return False
    return not (f.until is not None and (finished is None or finished >= f.until))


def _keep(row: Row, episode: Row, f: Filters, *, version: int | None) -> bool:
    return ((f.run_id is None or row["run_id"] == f.run_id) and _version_ok(version, f)
            and _window_ok(episode, f))


def _tool_ok(row: Row, f: Filters) -> bool:
    return ((f.tool is None or row["tool_name"] == f.tool)
            and (f.error_type is None or row["error_type"] == f.error_type))


def failure_patterns(t: Tables, f: Filters) -> list[FailurePattern]:
    episodes = {e["episode_id"]: e for e in t.episodes}
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for r in t.failures:
        if (r["source"] == "tool" and _tool_ok(r, f)
                and _keep(r, episodes[r["episode_id"]], f, version=r["policy_version"])):
            groups[(r["run_id"], r["policy_version"], r["tool_name"], r["error_type"],
                    r["position_key"])].append(r)
    calls: dict[tuple[Any, ...], int] = defaultdict(int)
    for c in t.tool_calls:
        if ((f.tool is None or c["tool_name"] == f.tool)
                and _keep(c, episodes[c["episode_id"]], f, version=c["policy_version"])):
            calls[(c["run_id"], c["policy_version"], c["tool_name"])] += 1
    out = []
    for (run, version, tool, error, position), rows in groups.items():
        n = len(rows)
        recovered = [r["retries_to_recover"] for r in rows if r["retries_to_recover"] is not None]
        c = calls.get((run, version, tool), 0)
        out.append(FailurePattern(
            run, version, tool, error, position, failures=n,
            episodes_affected=len({r["episode_id"] for r in rows}), tool_calls=c,
            share_of_calls=n / c if c else None, recovered_by_retry=len(recovered),
            recovered_by_retry_rate=len(recovered) / n, mean_retries_to_recover=_mean(recovered),
            terminated_episodes=len({r["episode_id"] for r in rows
                                     if episodes[r["episode_id"]]["status"] == "terminated"})))
    return out


def rollback_outcomes(t: Tables, f: Filters) -> list[RollbackOutcome]:
    limits = {r["run_id"]: r["config"]["rollback"]["max_tool_retries"] for r in t.runs}
    by_episode: dict[str, list[Row]] = defaultdict(list)
    for r in t.failures:
        if r["source"] == "tool":
            by_episode[r["episode_id"]].append(r)
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for e in t.episodes:
        if _keep(e, e, f, version=e["policy_version"]):
            groups[(e["run_id"], e["policy_version"])].append(e)
    out = []
    for (run, version), eps in groups.items():
        retried = recovered = at_limit = 0
        for e in eps:
            rows = by_episode.get(e["episode_id"], [])
            retried += len({(r["agent"], r["position_key"]) for r in rows if r["retried"]})
            recovered += len({(r["agent"], r["position_key"]) for r in rows
                              if r["retries_to_recover"] is not None})
            unretried = [r["retry_index"] for r in rows
                         if not r["retried"] and r["retry_index"] is not None]
            if (e["status"] == "terminated" and unretried
                    and max(unretried) >= limits[run]):
                at_limit += 1
        out.append(RollbackOutcome(
            run, version, episodes=len(eps),
            episodes_with_rollback=sum(1 for e in eps if e["rollbacks"] > 0),
            rollbacks=sum(e["rollbacks"] for e in eps),
            failed_attempts=sum(e["attempts_failed"] for e in eps),
            rolled_back_positions=retried, successful_retries=recovered,
            recovery_rate=recovered / retried if retried else None,
            terminated_at_retry_limit=at_limit,
            mean_reward_with_rollback=_mean(e["reward"] for e in eps if e["rollbacks"] > 0),
            mean_reward_without_rollback=_mean(e["reward"] for e in eps
                                               if e["rollbacks"] == 0)))
    return out


def tool_error_rates(t: Tables, f: Filters) -> list[ToolErrorRate]:
    episodes = {e["episode_id"]: e for e in t.episodes}
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for c in t.tool_calls:
        if ((f.tool is None or c["tool_name"] == f.tool)
                and _keep(c, episodes[c["episode_id"]], f, version=c["policy_version"])):
            groups[(c["run_id"], c["policy_version"], c["tool_name"])].append(c)
    recovered: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in t.failures:
        if (r["source"] == "tool" and (f.tool is None or r["tool_name"] == f.tool)
                and _keep(r, episodes[r["episode_id"]], f, version=r["policy_version"])):
            recovered[(r["run_id"], r["policy_version"], r["tool_name"])] += r["recovered"]
    out = []
    for (run, version, tool), calls in groups.items():
        errors = [c for c in calls if c["is_error"]]
        out.append(ToolErrorRate(
            run, version, tool, calls=len(calls), errors=len(errors),
            error_rate=len(errors) / len(calls),
            episodes=len({c["episode_id"] for c in calls}),
            episodes_with_errors=len({c["episode_id"] for c in errors}),
            error_types=len({c["error_type"] for c in errors if c["error_type"] is not None}),
            recovered_errors=recovered.get((run, version, tool), 0),
            mean_duration_ms=_mean(c["duration_ms"] for c in calls)))
    return out


def episode_outcomes(t: Tables, f: Filters) -> list[EpisodeOutcome]:
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for e in t.episodes:
        if _keep(e, e, f, version=e["policy_version"]):
            groups[(e["run_id"], e["policy_version"], e["group_id"], e["status"])].append(e)
    out = []
    for (run, version, group, status), eps in groups.items():
        rewards = [e["reward"] for e in eps if e["reward"] is not None]
        out.append(EpisodeOutcome(
            run, version, group, status, episodes=len(eps), mean_reward=_mean(rewards),
            min_reward=min(rewards) if rewards else None,
            max_reward=max(rewards) if rewards else None,
            mean_llm_calls=_mean(e["llm_calls"] for e in eps) or 0.0,
            mean_tool_calls=_mean(e["tool_calls"] for e in eps) or 0.0,
            mean_tokens=_mean(e["tokens"] for e in eps) or 0.0,
            max_tokens=max(e["tokens"] for e in eps)))
    return out


def timeline_stats(t: Tables, f: Filters) -> list[TimelineStat]:
    reasons: dict[str, list[str]] = defaultdict(list)
    for k in t.forks:
        reasons[k["episode_id"]].append(k["reason"])
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for e in t.episodes:
        if e["status"] != "invalid" and _keep(e, e, f, version=e["policy_version"]):
            groups[(e["run_id"], e["policy_version"])].append(e)
    out = []
    for (run, version), eps in groups.items():
        forks = [reason for e in eps for reason in reasons.get(e["episode_id"], [])]
        before = sum(e["timelines"] for e in eps)
        after = sum(e["survivors"] for e in eps)
        out.append(TimelineStat(
            run, version, episodes=len(eps), timelines_before=before, timelines_after=after,
            merge_ratio=before / after if after else None, forks=len(forks),
            forks_content=forks.count("content"), forks_tool_calls=forks.count("tool_calls"),
            forks_tools=forks.count("tools"), forks_token_drift=forks.count("token_drift"),
            drifted_messages=sum(e["drifted_messages"] for e in eps),
            episodes_with_drift=sum(1 for e in eps if e["drifted_messages"] > 0)))
    return out


def negative_sample_stats(t: Tables, f: Filters) -> list[NegativeSampleStat]:
    episodes = {e["episode_id"]: e for e in t.episodes}
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for s in t.samples:
        if _keep(s, episodes[s["episode_id"]], f, version=s["policy_version"]):
            groups[(s["run_id"], s["policy_version"])].append(s)
    out = []
    for (run, version), samples in groups.items():
        neg = [s for s in samples if s["kind"] == "negative"]
        status = [s["status"] for s in neg]
        out.append(NegativeSampleStat(
            run, version, positives=len(samples) - len(neg), negatives=len(neg),
            negative_share=len(neg) / len(samples),
            episodes_with_negatives=len({s["episode_id"] for s in neg}),
            groups_with_negatives=len({s["group_id"] for s in neg}),
            ready=status.count("ready"), leased=status.count("leased"),
            consumed=status.count("consumed"), skipped=status.count("skipped"),
            stale=status.count("stale"),
            mean_negative_tokens=_mean(s["num_tokens"] for s in neg),
            mean_negative_trainable=_mean(s["num_trainable"] for s in neg),
            mean_negative_reward=_mean(s["reward"] for s in neg)))
    return out


def error_signatures(t: Tables, f: Filters) -> list[ErrorSignatureCount]:
    episodes = {e["episode_id"]: e for e in t.episodes}
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for r in t.failures:
        if (r["source"] == "tool" and _tool_ok(r, f)
                and _keep(r, episodes[r["episode_id"]], f, version=r["policy_version"])):
            groups[(r["run_id"], r["tool_name"], r["error_type"],
                    error_signature(r["error_message"]))].append(r)
    out = []
    for (run, tool, error, signature), rows in groups.items():
        versions = [r["policy_version"] for r in rows if r["policy_version"] is not None]
        times = [r["occurred_at"] for r in rows if r["occurred_at"] is not None]
        messages = [r["error_message"] for r in rows if r["error_message"] is not None]
        out.append(ErrorSignatureCount(
            run, tool, error, signature, failures=len(rows),
            episodes_affected=len({r["episode_id"] for r in rows}),
            first_version=min(versions) if versions else None,
            last_version=max(versions) if versions else None,
            first_seen=min(times) if times else None, last_seen=max(times) if times else None,
            example_message=min(messages) if messages else None))
    return out


#: Reference of each view, by the short names of ``store.analytics.VIEWS``.
REFERENCES: dict[str, Callable[[Tables, Filters], list[Any]]] = {
    "failures": failure_patterns,
    "rollbacks": rollback_outcomes,
    "tool-errors": tool_error_rates,
    "outcomes": episode_outcomes,
    "timelines": timeline_stats,
    "negatives": negative_sample_stats,
    "signatures": error_signatures,
}

BASE_TIME = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
MESSAGES = ["TypeError: unexpected argument '{w}' at /srv/{w}.py:{n}",
            "NameError: name '{w}' is not defined", "timeout after {n}.5s",
            "KeyError: {n}", "ValueError: bad value \"{w}\" in row {n}"]


def generate(rng: random.Random, *, episodes: int = 120) -> Tables:
    """Random projection rows of three runs, shaped as the replay writes them (a retried
    failure has a position; only retried failures can have recovered), with NULLs where the
    schema allows them."""
    t = Tables()
    runs = ["run-a", "run-b", "run-c"]
    for i, run in enumerate(runs):
        t.runs.append({"run_id": run, "config": {"rollback": {"max_tool_retries": i + 1}}})

    def maybe(value: Any, p: float = 0.1) -> Any:
        return None if rng.random() < p else value

    for i in range(episodes):
        run = rng.choice(runs)
        status = rng.choice(["completed", "completed", "terminated", "truncated", "invalid"])
        version = maybe(rng.randint(0, 3), 0.05)
        timelines = rng.randint(1, 6)
        episode = f"ep-{i:04d}"
        t.episodes.append({
            "episode_id": episode, "run_id": run, "group_id": f"g{rng.randint(0, 4)}",
            "status": status,
            "reward": None if status == "invalid" else maybe(rng.choice([0.0, 0.5, 1.0])),
            "policy_version": version, "llm_calls": rng.randint(1, 9),
            "tool_calls": rng.randint(0, 9), "tokens": rng.randint(10, 900),
            "rollbacks": rng.choice([0, 0, 1, 2, 3]), "attempts_failed": rng.randint(0, 4),
            "timelines": timelines, "survivors": rng.randint(0, timelines),
            "forks": 0, "drifted_messages": rng.choice([0, 0, 1, 2]),
            "finished_at": BASE_TIME + dt.timedelta(minutes=rng.randint(0, 600)),
            "projected_version": 10,
        })
        for v in range(rng.randint(0, 6)):
            error = rng.random() < 0.4
            t.tool_calls.append({
                "episode_id": episode, "stream_version": 100 + v, "run_id": run,
                "group_id": "g", "agent": "main",
                "policy_version": version if rng.random() < 0.9 else maybe(rng.randint(0, 3)),
                "tool_name": rng.choice(["search", "calc", "shell"]), "is_error": error,
                "error_type": maybe(rng.choice(["TypeError", "NameError"]), 0.2) if error else None,
                "position_key": maybe(f"turn_{rng.randint(1, 3)}"),
                "duration_ms": maybe(round(rng.uniform(1, 50), 3), 0.3),
                "occurred_at": BASE_TIME,
            })
        for v in range(rng.randint(0, 5)):
            position = maybe(f"turn_{rng.randint(1, 3)}", 0.15)
            retried = position is not None and rng.random() < 0.5
            source = rng.choice(["tool", "tool", "attempt"])
            t.failures.append({
                "episode_id": episode, "stream_version": 200 + v, "run_id": run,
                "group_id": "g", "agent": rng.choice(["main", "helper"]),
                "policy_version": version if rng.random() < 0.9 else maybe(rng.randint(0, 3)),
                "source": source,
                "tool_name": rng.choice(["search", "calc"]) if source == "tool"
                else maybe(rng.choice(["search", "calc"])),
                "error_type": maybe(rng.choice(["TypeError", "NameError", "KeyError"])),
                "error_message": maybe(rng.choice(MESSAGES).format(
                    w=rng.choice(["q", "Q2", "zz", "a_b"]), n=rng.randint(0, 99))),
                "position_key": position, "retry_index": maybe(rng.randint(0, 4), 0.1),
                "recovered": rng.random() < 0.5, "retried": retried,
                "retries_to_recover": rng.randint(1, 3) if retried and rng.random() < 0.6
                else None,
                "occurred_at": maybe(BASE_TIME + dt.timedelta(seconds=rng.randint(0, 10**5))),
            })
        for k in range(rng.randint(0, 3)):
            t.forks.append({"episode_id": episode, "agent": "main", "timeline": k + 1,
                            "other": 0, "message_index": 1,
                            "reason": rng.choice(["content", "tool_calls", "tools",
                                                  "token_drift"])})
        for k in range(rng.randint(0, 4)):
            kind = rng.choice(["positive", "negative"])
            t.samples.append({
                "run_id": run, "group_id": f"g{rng.randint(0, 4)}", "episode_id": episode,
                "agent": "main", "kind": kind, "timeline_index": k,
                "reward": maybe(-1.0 if kind == "negative" else rng.choice([0.0, 1.0])),
                "policy_version": version if rng.random() < 0.9 else maybe(rng.randint(0, 3)),
                "prompt_length": 1, "num_tokens": rng.randint(2, 500),
                "num_trainable": rng.randint(0, 100), "token_ids": b"", "loss_mask": b"",
                "logprobs": b"",
                "status": rng.choice(["ready", "leased", "consumed", "skipped", "stale"]),
            })
    return t


def _insert(conn: Any, table: str, rows: list[Row]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    with conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES"
            f" ({', '.join(['%s'] * len(columns))})",
            [[row[c] for c in columns] for row in rows])


def insert(conn: Any, t: Tables) -> None:
    """Write ``t`` into the projection tables of ``conn``'s database."""
    from psycopg.types.json import Jsonb

    _insert(conn, "runs", [{"run_id": r["run_id"], "project": "p", "group_size": 4,
                            "max_negatives_per_group": 1, "save_negative_samples": True,
                            "config": Jsonb(r["config"]), "created_at": BASE_TIME}
                           for r in t.runs])
    _insert(conn, "episodes", t.episodes)
    _insert(conn, "tool_calls", t.tool_calls)
    _insert(conn, "failures", t.failures)
    _insert(conn, "timeline_forks", t.forks)
    _insert(conn, "samples", t.samples)
