"""An episode's merged timelines, replayed on request with the run's tokenizer.

The same pure replay the workers run (``workers.replay.replay_episode``), so what the API
shows is what training gets: one timeline per surviving (merged) LLM call history, with the
per-token loss mask (1 exactly on sampled tokens) and rollout logprobs, plus the failed
attempts that become negative samples and where timelines fork.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from api.errors import ApiError
from api.tokens import Encoding, encode_array
from store.codec import ID_DTYPE, LOGPROB_DTYPE
from store.eventlog import EventStore, RecordedEvent
from store.events import RunCreated
from workers.engines.render import RenderBudgetExceeded
from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer
from workers.replay import (
    ReplayError,
    ReplayResult,
    Timeline,
    needs_tokenizer,
    replay_episode,
)

__all__ = [
    "StoredReplay",
    "episode_timelines",
    "replay_stored",
    "replay_stored_episode",
    "timeline_messages",
]


@dataclass(frozen=True)
class StoredReplay:
    """A stored episode replayed: its recorded events, the run's tokenizer (None when no
    call carries token ids, so none was needed) and the result."""

    records: list[RecordedEvent]
    tokenizer: Any
    result: ReplayResult


def replay_stored(store: EventStore, episode_id: str, *,
                  tokenizer_loader: Callable[[str | None], Any] = load_tokenizer
                  ) -> StoredReplay:
    """Replay the stored events of ``episode_id`` (finished or not), keeping the events and
    the tokenizer it read for callers that show them. Raises ApiError 404 for an unknown
    episode or run and 409 when the episode cannot be replayed (its reason in the message)
    or the run's tokenizer is not on this machine."""
    events = store.read_stream(episode_id)
    if not events or events[0].type != "episode_started":
        raise ApiError(404, "not_found", f"no episode {episode_id!r}")
    run_id = events[0].event.run_id  # type: ignore[attr-defined]
    run = store.read_stream(f"run-{run_id}", to_version=1)
    if not run or not isinstance(run[0].event, RunCreated):
        raise ApiError(404, "not_found", f"episode {episode_id!r} names run {run_id!r}, "
                                         "which has no run_created")
    config = run[0].event.config
    plain = [r.event for r in events]
    try:
        tokenizer = (tokenizer_loader(config.tokenizer_name)
                     if needs_tokenizer(plain) else None)
        result = replay_episode(plain, config=config,
                                tokenizer=tokenizer, episode_id=episode_id)
    except TokenizerNotFound as exc:
        raise ApiError(409, "tokenizer_not_found", str(exc)) from None
    except ReplayError as exc:
        if isinstance(exc.__cause__, RenderBudgetExceeded):
            raise ApiError(422, "render_budget", f"episode {episode_id!r} cannot be replayed: "
                                                 f"{exc}") from None
        raise ApiError(409, "not_replayable", f"episode {episode_id!r} cannot be replayed: "
                                              f"{exc}") from None
    return StoredReplay(records=events, tokenizer=tokenizer, result=result)


def replay_stored_episode(store: EventStore, episode_id: str, *,
                          tokenizer_loader: Callable[[str | None], Any] = load_tokenizer
                          ) -> ReplayResult:
    """The replay of ``episode_id`` alone (see :func:`replay_stored` for the errors)."""
    return replay_stored(store, episode_id, tokenizer_loader=tokenizer_loader).result


def timeline_messages(timeline: Timeline, *, discarded: Collection[int] = ()
                      ) -> list[dict[str, Any]]:
    """Each message of ``timeline`` with its token span ``[start, end)``, the number of its
    tokens under the loss mask, and whether it is a discarded call's output held as context
    (its position in ``discarded``)."""
    out = []
    start = 0
    for k, m in enumerate(timeline.messages):
        end = start + len(m.token_ids)
        out.append({"role": m.role, "author": m.author, "text": m.text, "start": start,
                    "end": end, "trainable": sum(m.sampled_mask()),
                    "tool_calls": m.tool_calls, "truncated": m.truncated,
                    "discarded": k in discarded})
        start = end
    return out


def episode_timelines(store: EventStore, episode_id: str, *, encoding: Encoding,
                      tokenizer_loader: Callable[[str | None], Any] = load_tokenizer
                      ) -> dict[str, Any]:
    """The ``EpisodeTimelines`` answer for ``episode_id`` (see ``replay_stored_episode`` for
    the errors)."""
    result = replay_stored_episode(store, episode_id, tokenizer_loader=tokenizer_loader)
    timelines = []
    for index, merged, sample in zip(result.survivor_indices, result.survivors,
                                     result.samples, strict=True):
        timelines.append({
            "agent": merged.agent,
            "timeline_index": index,
            "absorbed": [i for i, a in enumerate(result.absorber) if a == index],
            "prompt_length": sample.prompt_length,
            "num_tokens": sample.num_tokens,
            "num_trainable": sample.num_trainable_tokens,
            "drifted_messages": sample.num_drifted_messages,
            "token_ids": encode_array(sample.token_ids, dtype=ID_DTYPE, encoding=encoding),
            "loss_mask": encode_array(sample.loss_mask, dtype="u1", encoding=encoding),
            "logprobs": encode_array(sample.logprobs, dtype=LOGPROB_DTYPE, encoding=encoding),
            "messages": timeline_messages(
                merged, discarded=set(result.discarded_context.get(index, ()))),
        })
    kept = {id(n) for n in result.negatives}
    negatives = [{
        "agent": n.sample.agent,
        "timeline_index": n.sample.timeline_index,
        "call_id": n.call_id,
        "position_key": n.position_key,
        "retry_index": n.retry_index,
        "error_types": list(n.error_types),
        "error_messages": list(n.error_messages),
        "reward": n.sample.reward,  # the run's negative_reward: always set
        "prompt_length": n.sample.prompt_length,
        "token_ids": encode_array(n.sample.token_ids, dtype=ID_DTYPE, encoding=encoding),
        "loss_mask": encode_array(n.sample.loss_mask, dtype="u1", encoding=encoding),
        "logprobs": encode_array(n.sample.logprobs, dtype=LOGPROB_DTYPE, encoding=encoding),
        "kept": id(n) in kept,
    } for n in result.failures]
    forks = [{"agent": f.agent, "timeline": f.timeline_index, "other": f.parent_index,
              "message_index": f.message_index, "reason": str(f.reason)}
             for f in result.forks]
    return {
        "episode_id": episode_id, "run_id": result.run_id, "group_id": result.group_id,
        "status": result.status, "reward": result.reward, "timelines": timelines,
        "negatives": negatives, "forks": forks, "drifted_messages": result.drifted_messages,
        "discarded_calls": [result.call_ids[i] for i in result.discarded_indices],
    }
