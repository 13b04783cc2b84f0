"""Where a branch starts: the prefix of a stored episode that new episodes take as recorded.

A branch starts ``n`` new episodes from a recorded turn of a stored episode (the parent):
each keeps the parent's first ``turn`` LLM calls (``llm_called``, in stream order, rolled
back ones included) and the tool results recorded after them, without generating or running
them again, and generates what follows (:mod:`workers.rollout.branch` plays them). This
module is the light half, which the API imports too: finding the prefix in the parent's
events, the branch's deterministic ids, and queueing a branch on the rollout queue.

- ``turn`` counts LLM calls: 0 keeps none (the task's prompt only), k keeps calls 1..k and
  the tool results recorded before call k + 1 (all of them when k is the last call). A turn
  above the number of recorded calls does not exist.
- ``checkpoint`` (a ``checkpoint_created`` id, ``ckpt_<turn>_<retry>``) stands for the context
  before the assistant turn whose tool calls it guards: the branch keeps the calls recorded
  before that turn's call, and generates that call again (``turn`` = the calls before it).
- Identity: ``group_id = "branch-" + uuid5(parent, turn, checkpoint, group_index)``, episode
  ``<group_id>-<k>`` (:func:`~workers.rollout.group.episode_id_for`): asking for the same
  branch twice finds the episodes of the first.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store.arguments import whole_number
from store.events import (
    CheckpointCreated,
    EpisodeStarted,
    Event,
    LLMCalled,
    RolledBack,
    ToolReturned,
)
from store.settings import Settings

__all__ = [
    "BRANCH_TASK",
    "MAX_BRANCHES",
    "BranchNotFound",
    "BranchPoint",
    "branch_episode_ids",
    "branch_group_id",
    "branch_point",
    "check_branch_size",
    "send_branch",
]

#: The Celery task that plays a branch (queue ``rollout``).
BRANCH_TASK = "trajstore.branch_episode"
#: The most episodes one branch starts.
MAX_BRANCHES = 256

_NAMESPACE = uuid.UUID("3c5d2b8e-5f7a-4e61-9d0b-7a2e4c1f8b36")


class BranchNotFound(LookupError):
    """The episode, turn or checkpoint a branch was asked from is not recorded; the message
    names it (the API answers 404)."""


@dataclass(frozen=True)
class BranchPoint:
    """The prefix a branch of ``parent`` keeps (module docstring): its ``episode_started``,
    the first ``turn`` LLM calls, the tool results recorded before call ``turn + 1``, and
    ``kept_turns``, the assistant turns those calls leave in the context (calls minus the
    ones rolled back). ``recorded_calls`` is the number of calls the parent holds."""

    parent: str
    turn: int
    checkpoint: str | None
    started: EpisodeStarted
    calls: tuple[LLMCalled, ...]
    tool_results: tuple[ToolReturned, ...]
    kept_turns: int
    recorded_calls: int
    agent: str

    def branched_from(self) -> dict[str, Any]:
        """The ``episode_started.branched_from`` of the branch's episodes."""
        return {"episode_id": self.parent, "turn": self.turn, "checkpoint": self.checkpoint}


def check_branch_size(n: int) -> int:
    """``n`` when it is a whole number in [1, :data:`MAX_BRANCHES`]; ValueError naming ``n``
    otherwise."""
    whole_number("n", n)
    if n > MAX_BRANCHES:
        raise ValueError(f"n must be at most {MAX_BRANCHES} episodes per branch, got {n}")
    return n


def branch_point(parent: str, events: Sequence[Event], *, turn: int | None = None,
                 checkpoint: str | None = None) -> BranchPoint:
    """The prefix of ``parent`` (its stored events, in stream order) that a branch from
    ``turn`` or from ``checkpoint`` keeps (exactly one of them). Raises ValueError for both
    or neither, a negative turn, a stream that is not an episode or an episode of several
    agents (the loop plays one); :class:`BranchNotFound` naming the turn or checkpoint when
    the episode holds none of that number or id."""
    if (turn is None) == (checkpoint is None):
        raise ValueError("give exactly one of turn and checkpoint")
    if not events or not isinstance(events[0], EpisodeStarted):
        raise ValueError(f"stream {parent!r} is not an episode (no episode_started first)")
    started = events[0]
    calls_at: list[int] = [i for i, e in enumerate(events) if isinstance(e, LLMCalled)]
    if checkpoint is not None:
        found = next((i for i, e in enumerate(events) if isinstance(e, CheckpointCreated)
                      and e.checkpoint_id == checkpoint), None)
        if found is None:
            raise BranchNotFound(f"episode {parent!r} has no checkpoint {checkpoint!r}")
        # The checkpoint guards the turn of the call just before it: that call is generated
        # again, so the calls before it are kept.
        turn = max(0, sum(1 for i in calls_at if i < found) - 1)
    assert turn is not None
    whole_number("turn", turn, minimum=0)
    if turn > len(calls_at):
        raise BranchNotFound(f"episode {parent!r} has no turn {turn}: it recorded "
                             f"{len(calls_at)} LLM calls (turns 0 to {len(calls_at)})")
    end = calls_at[turn] if turn < len(calls_at) else len(events)
    prefix = events[:end]
    calls = tuple(e for e in prefix if isinstance(e, LLMCalled))
    agents = {e.agent for e in events if isinstance(e, LLMCalled)}
    if len(agents) > 1:
        raise ValueError(f"episode {parent!r} has LLM calls of several agents "
                         f"({sorted(agents)}); a branch continues one agent's loop")
    rolled_back = sum(len(e.discarded_call_ids) for e in prefix if isinstance(e, RolledBack))
    return BranchPoint(
        parent=parent, turn=turn, checkpoint=checkpoint, started=started, calls=calls,
        tool_results=tuple(e for e in prefix if isinstance(e, ToolReturned)),
        kept_turns=len(calls) - rolled_back, recorded_calls=len(calls_at),
        agent=next(iter(agents), "main"))


def branch_group_id(parent: str, turn: int, checkpoint: str | None = None,
                    group_index: int = 0) -> str:
    """The group id of the branch of ``parent`` from ``turn`` (asked as ``checkpoint``, when
    it was) with ``group_index`` (module docstring)."""
    key = json.dumps(["branch", parent, turn, checkpoint, group_index])
    return f"branch-{uuid.uuid5(_NAMESPACE, key)}"


def branch_episode_ids(group_id: str, n: int) -> list[str]:
    """The ids of the first-attempt episodes of a branch group of ``n`` episodes."""
    return [f"{group_id}-{k}" for k in range(n)]


def send_branch(settings: Settings, *, episode_id: str, turn: int | None,
                checkpoint: str | None, n: int, group_index: int,
                project: str | None = None) -> None:
    """Queue the branch on the rollout queue (:data:`BRANCH_TASK`); ConnectionError naming
    the broker when it cannot be reached. With ``project``, within the project's rollout
    budget (:mod:`workers.rollout.fair`: RolloutBudgetExceeded over it)."""
    from workers.rollout.fair import send_budgeted
    from workers.rollout.remote_dispatch import send_rollout_task

    kwargs = {"turn": turn, "checkpoint": checkpoint, "n": n, "group_index": group_index}
    if project is None:
        send_rollout_task(settings, BRANCH_TASK, args=[episode_id], kwargs=kwargs)
    else:
        send_budgeted(settings, project, BRANCH_TASK, args=[episode_id], kwargs=kwargs)
