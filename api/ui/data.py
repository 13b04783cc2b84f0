"""What the pages show, assembled from the store: plain dicts and lists for the templates.

The numbers come from the same places as the REST routes (a run's summary is the runs
route's ``run_out``; the analytics views; the episode listing) and an episode's timeline is
the same replay the workers run, so the page, ``/v1/...`` and ``trajstore analytics`` never
disagree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from api.errors import ApiError
from api.timelines import replay_stored
from store import analytics, queries, search
from store.analytics import Filters
from store.eventlog import EventStore
from store.events import AttemptFailed, LLMCalled, RolledBack, ToolReturned
from store.training_steps import exclusions, training_steps
from workers.engines.tokenizers import load_tokenizer
from workers.replay import ReplayResult, has_token_ids

__all__ = [
    "call_rows",
    "dashboard",
    "episode_page",
    "group_page",
    "search_page",
    "token_pieces",
]


def _series(rows: Iterable[Any], versions: Sequence[int], key: Callable[[Any], str | None],
            value: Callable[[Any], float]) -> list[dict[str, Any]]:
    """``[{"label", "data": [per version]}]`` summing ``value`` by ``key`` and version."""
    sums: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        if r.policy_version is not None:
            sums[key(r) or "(none)"][r.policy_version] += value(r)
    ranked = sorted(sums, key=lambda label: (-sum(sums[label].values()), label))
    return [{"label": label, "data": [sums[label].get(v, 0) for v in versions]}
            for label in ranked]


def dashboard(store: EventStore, run_id: str) -> dict[str, Any]:
    """The run's failure dashboard: chart data by policy version (failures by error type and
    by tool, mean reward, rollback recovery rate, tool error rate) and the tables beside it
    (failure patterns, error signatures, tool error rates), from the analytics views, and the
    newest 50 training steps (staleness and off-policy correction, ``training_steps``)."""
    only = Filters(run_id=run_id)
    failures = analytics.failure_patterns(store.db, only)
    rollbacks = analytics.rollback_outcomes(store.db, only)
    outcomes = analytics.episode_outcomes(store.db, only)
    tools = analytics.tool_error_rates(store.db, only)
    signatures = analytics.error_signatures(store.db, only, limit=20)
    versions = sorted({v for rows in (failures, rollbacks, outcomes, tools) for r in rows
                       if (v := r.policy_version) is not None})

    rewarded: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for o in outcomes:
        if o.policy_version is not None and o.mean_reward is not None:
            rewarded[o.policy_version][0] += o.mean_reward * o.episodes
            rewarded[o.policy_version][1] += o.episodes
    reward = [rewarded[v][0] / rewarded[v][1] if rewarded[v][1] else None for v in versions]
    recovery = {r.policy_version: r.recovery_rate for r in rollbacks}
    calls: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for t in tools:
        if t.policy_version is not None:
            calls[t.policy_version][0] += t.errors
            calls[t.policy_version][1] += t.calls
    charts = {
        "versions": versions,
        "failures_by_error_type": _series(failures, versions, lambda r: r.error_type,
                                          lambda r: r.failures),
        "failures_by_tool": _series(failures, versions, lambda r: r.tool_name,
                                    lambda r: r.failures),
        "reward": reward,
        "recovery_rate": [recovery.get(v) for v in versions],
        "tool_error_rate": [calls[v][0] / calls[v][1] if calls[v][1] else None
                            for v in versions],
    }
    return {
        "charts": charts,
        "failures": [analytics.row_as_dict(r) for r in failures],
        "rollbacks": [analytics.row_as_dict(r) for r in rollbacks],
        "tools": [analytics.row_as_dict(r) for r in tools],
        "signatures": [analytics.row_as_dict(r) for r in signatures],
        "total_failures": sum(r.failures for r in failures),
        "training_steps": [analytics.row_as_dict(r)
                           for r in training_steps(store.db, run_id, limit=50)],
    }


def group_page(store: EventStore, run_id: str, group_id: str, *, limit: int = 500
               ) -> list[dict[str, Any]]:
    """The episodes of one group in start order (the episode listing's rows)."""
    return queries.list_episodes(store, queries.EpisodeFilters(run_ids=[run_id],
                                                               group_id=group_id),
                                 limit=limit)


def token_pieces(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (a token that is part of a multi-byte character shows as the
    replacement character, as decoding it alone gives)."""
    if not token_ids:
        return []
    return list(tokenizer.batch_decode([[int(t)] for t in token_ids],
                                       skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))


def _tokens(pieces: Sequence[str], ids: Sequence[int], mask: Sequence[int],
            logprobs: Sequence[float], start: int, end: int) -> list[dict[str, Any]]:
    return [{"i": i, "id": int(ids[i]), "text": pieces[i], "mask": int(mask[i]),
             "logprob": float(logprobs[i])} for i in range(start, end)]


def _event_rows(records: Sequence[Any]) -> list[dict[str, Any]]:
    """The episode's events as rows of the page's event log, with what each one means."""
    rows = []
    for r in records:
        e = r.event
        summary = ""
        flag = ""
        if r.type == "llm_called" and not has_token_ids(e):
            content = e.response.get("content")
            text = content if isinstance(content, str) else ""
            summary = (f"{e.agent} · call {e.call_id} · no token ids · "
                       f"{text[:160] or 'policy v' + str(e.policy_version)}")
        elif r.type == "llm_called":
            summary = (f"{e.agent} · call {e.call_id} · {len(e.prompt_ids)} prompt + "
                       f"{len(e.response_ids)} generated tokens · policy v{e.policy_version}")
        if r.type == "llm_called":
            if e.latency_ms is not None:
                summary += f" · {e.latency_ms:.0f} ms"
            error = e.response.get("error")
            if error is not None or e.finish_reason == "error":
                flag = "error"
                summary += " · failed: " + (
                    f"{error.get('type') or 'error'}: {error.get('message') or ''}".rstrip(": ")
                    if isinstance(error, dict) else str(error or "error"))
        elif isinstance(e, ToolReturned):
            if e.is_error or e.error_type:
                flag = "error"
                summary = f"{e.name}: {e.error_type or 'error'}: {e.error_message or e.output}"
            else:
                summary = f"{e.name} → {e.output[:160]}"
        elif r.type == "checkpoint_created":
            summary = f"{e.position_key} (checkpoint {e.checkpoint_id}, retry {e.retry_count})"
        elif isinstance(e, AttemptFailed):
            flag = "rollback"
            summary = (f"{e.position_key} retry {e.retry_index}: "
                       f"{'; '.join(e.error_messages) or ', '.join(e.error_types)}")
        elif isinstance(e, RolledBack):
            flag = "rollback"
            summary = (f"back to {e.checkpoint_id}, discarding "
                       f"{', '.join(e.discarded_call_ids) or 'nothing'}")
        elif r.type == "reward_assigned":
            summary = f"{e.value:g}" + (f" {e.components}" if e.components else "")
        elif r.type == "episode_finished":
            summary = e.status + (f" ({e.reason})" if e.reason else "")
        elif r.type == "episode_started":
            summary = f"group {e.group_id}, policy v{e.policy_version}"
        rows.append({"version": r.stream_version, "type": r.type, "summary": summary,
                     "flag": flag, "at": r.recorded_at})
    return rows


def call_rows(records: Sequence[Any]) -> list[dict[str, Any]]:
    """One row per LLM call of the episode, in recording order: agent, call id, policy
    version, latency, tokens in and out (the usage the caller reported, else the token ids
    recorded), finish reason, and its state: ``failed`` (the request failed: its error),
    ``rolled back`` (its attempt failed and was discarded), ``abandoned`` (the client threw
    the answer away), ``truncated`` (cut off at the length limit), or ``ok``."""
    failed_attempts: dict[str, str] = {}
    discarded: set[str] = set()
    for r in records:
        e = r.event
        if isinstance(e, AttemptFailed) and e.failed_call_id:
            failed_attempts[e.failed_call_id] = ", ".join(e.error_types) or "error"
        elif isinstance(e, RolledBack):
            discarded.update(e.discarded_call_ids)
    rows = []
    for r in records:
        e = r.event
        if not isinstance(e, LLMCalled):
            continue
        usage = e.usage or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if prompt is None and has_token_ids(e):
            prompt = len(e.prompt_ids)
        if completion is None and has_token_ids(e):
            completion = len(e.response_ids)
        error = e.response.get("error") if isinstance(e.response, dict) else None
        kind = failed_attempts.get(e.call_id)
        if error is not None or e.finish_reason == "error":
            state = "failed"
            detail = (f"{error.get('type') or 'error'}: {error.get('message') or ''}"
                      if isinstance(error, dict) else str(error or "error"))
        elif kind == "Abandoned":
            state, detail = "abandoned", "the client threw this answer away"
        elif e.call_id in discarded or kind is not None:
            state, detail = "rolled back", kind or ""
        elif e.finish_reason == "length":
            state, detail = "truncated", "cut off at the length limit"
        else:
            state, detail = "ok", ""
        rows.append({"version": r.stream_version, "agent": e.agent, "call_id": e.call_id,
                     "policy_version": e.policy_version, "latency_ms": e.latency_ms,
                     "prompt_tokens": prompt, "completion_tokens": completion,
                     "finish_reason": e.finish_reason, "state": state,
                     "detail": detail.strip(" :")})
    return rows


def _timeline_view(result: ReplayResult, pieces: Callable[[Sequence[int]], list[str]],
                   errors: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    views = []
    for index, merged, sample in zip(result.survivor_indices, result.survivors,
                                     result.samples, strict=True):
        text = pieces(sample.token_ids)
        discarded = set(result.discarded_context.get(index, ()))
        messages = []
        start = 0
        for k, m in enumerate(merged.messages):
            end = start + len(m.token_ids)
            error = errors.get(m.text) if m.role == "tool" else None
            messages.append({
                "role": m.role, "author": m.author, "text": m.text,
                "tool_calls": m.tool_calls or [], "truncated": m.truncated, "error": error,
                # a rolled-back or abandoned call's output, here as context: not trained
                "discarded": k in discarded,
                "trainable": sum(sample.loss_mask[start:end]),
                "tokens": _tokens(text, sample.token_ids, sample.loss_mask, sample.logprobs,
                                  start, end),
            })
            start = end
        views.append({
            "agent": merged.agent, "index": index,
            "absorbed": [i for i, a in enumerate(result.absorber) if a == index],
            "num_tokens": sample.num_tokens, "num_trainable": sample.num_trainable_tokens,
            "prompt_length": sample.prompt_length, "drifted": sample.num_drifted_messages,
            "messages": messages,
        })
    return views


def episode_page(store: EventStore, episode_id: str, *,
                 tokenizer_loader: Callable[[str | None], Any] = load_tokenizer
                 ) -> dict[str, Any]:
    """Everything the episode page shows: the listing row, the merged timelines token by
    token (text, id, loss mask, logprob; a discarded call's output flagged where a timeline
    holds it as context), the calls discarded (rolled back or abandoned: trained only as
    negative samples), the failed attempts as negative samples (kept or over the cap),
    forks, each LLM call's latency, tokens and state (``call_rows``), the event log with tool
    errors, failed calls and rollbacks flagged, and why the episode or its samples did not
    reach training (``exclusions``, ``no_reward`` among them; ``untokenized`` says why LLM
    calls recorded without token ids gave no samples). An episode replay refuses, or cannot
    replay without a missing tokenizer, is shown without timelines, with the reason in
    ``refused``. Raises ApiError 404 for an unknown episode or run."""
    try:
        replayed = replay_stored(store, episode_id, tokenizer_loader=tokenizer_loader)
    except ApiError as exc:
        if exc.code not in ("not_replayable", "tokenizer_not_found"):
            raise
        return _unreplayed_page(store, episode_id, exc.message)
    result, records = replayed.result, replayed.records

    def pieces(ids: Sequence[int]) -> list[str]:
        return token_pieces(replayed.tokenizer, ids)

    errors = {}
    for r in records:
        e = r.event
        if isinstance(e, ToolReturned) and (e.is_error or e.error_type):
            errors[e.output] = {"tool": e.name, "type": e.error_type or "error",
                                "message": e.error_message or e.output}
    kept = {id(n) for n in result.negatives}
    negatives = []
    for n in result.failures:
        s = n.sample
        text = pieces(s.token_ids)
        negatives.append({
            "call_id": n.call_id, "position_key": n.position_key,
            "retry_index": n.retry_index, "error_types": n.error_types,
            "error_messages": n.error_messages, "tool_calls": n.tool_calls,
            "reward": s.reward, "kept": id(n) in kept, "num_tokens": s.num_tokens,
            "prompt_length": s.prompt_length,
            # The context up to the checkpoint is long and already shown above: the page
            # shows the failed generation and a little context before it.
            "tokens": _tokens(text, s.token_ids, s.loss_mask, s.logprobs,
                              max(0, s.prompt_length - 24), s.num_tokens),
        })
    return {
        "episode_id": episode_id,
        "row": queries.episode_row(store, episode_id) or {},
        "run_id": result.run_id, "group_id": result.group_id, "status": result.status,
        "reward": result.reward,
        "timelines": _timeline_view(result, pieces, errors),
        "negatives": negatives,
        "discarded_calls": [result.call_ids[i] for i in result.discarded_indices],
        "forks": [{"agent": f.agent, "timeline": f.timeline_index, "other": f.parent_index,
                   "message_index": f.message_index, "reason": str(f.reason)}
                  for f in result.forks],
        "events": _event_rows(records),
        "exclusions": [analytics.row_as_dict(x)
                       for x in exclusions(store.db, episode_id=episode_id)],
        "untokenized": result.untokenized_reason,
        "calls": call_rows(records),
        "refused": None,
    }


def _unreplayed_page(store: EventStore, episode_id: str, reason: str) -> dict[str, Any]:
    """The episode page of an episode replay refuses (``invalid``) or cannot replay here
    (its run's tokenizer is missing): no timelines, the reason, and everything the log
    holds: its LLM calls, its events, why it was not trained."""
    records = store.read_stream(episode_id)
    started = records[0].event
    row = queries.episode_row(store, episode_id) or {}
    return {
        "episode_id": episode_id, "row": row,
        "run_id": started.run_id, "group_id": started.group_id,  # type: ignore[attr-defined]
        "status": row.get("status"), "reward": row.get("reward"),
        "timelines": [], "negatives": [], "forks": [],
        "events": _event_rows(records),
        "exclusions": [analytics.row_as_dict(x)
                       for x in exclusions(store.db, episode_id=episode_id)],
        "untokenized": None,
        "calls": call_rows(records),
        "refused": row.get("invalid_reason") or reason,
    }


def search_page(store: EventStore, project: str, text: str, *, limit: int = 50
                ) -> list[dict[str, Any]]:
    """The episodes of ``project``'s runs where ``text`` occurs (``store.search``), each
    with its listing row and what matched. Raises ValueError for blank text."""
    runs = queries.run_ids_of(store, project)
    found = []
    for match in search.search_episodes(store, run_ids=runs, text=text, limit=limit):
        row = queries.episode_row(store, match.episode_id)
        if row is not None:
            found.append({**row, "matched": match.what, "detail": match.detail})
    return found
