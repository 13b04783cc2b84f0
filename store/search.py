"""Finding episodes by what a person remembers of them: part of the episode id, of the task
id, or of an error (a tool's error type, message or output, a failed LLM call's error, a
failed attempt's errors, the reason replay refused the episode or it finished as it did).

The web page's search box asks this (``/ui/search``); it reads the log and the episodes
projection, so an episode is found before it is replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store.eventlog import EventStore
from store.rows import safe_data

__all__ = ["Match", "search_episodes"]

_T = safe_data("t.data")

# Each branch gives (position, episode id, what matched, the text that matched). The error
# texts are the ones the page shows, so a match can be read where it is found.
_SEARCH = f"""
WITH hit AS (
  SELECT t.position, t.stream_id AS episode_id,
         CASE WHEN t.stream_id ILIKE %(p)s ESCAPE '\\' THEN 'episode' ELSE 'task' END AS what,
         CASE WHEN t.stream_id ILIKE %(p)s ESCAPE '\\' THEN t.stream_id
              ELSE {_T}->>'task_id' END AS detail
    FROM events t
   WHERE t.type = 'episode_started' AND t.run_id = ANY(%(runs)s)
     AND (t.stream_id ILIKE %(p)s ESCAPE '\\' OR {_T}->>'task_id' ILIKE %(p)s ESCAPE '\\')
  UNION ALL
  SELECT t.position, t.stream_id, 'tool error',
         {_T}->>'name' || ': ' || coalesce({_T}->>'error_type', 'error') || ': '
           || coalesce({_T}->>'error_message', {_T}->>'output')
    FROM events t
   WHERE t.type = 'tool_returned' AND t.run_id = ANY(%(runs)s)
     AND (({_T}->>'is_error')::boolean OR {_T}->>'error_type' IS NOT NULL)
     AND concat_ws(' ', {_T}->>'error_type', {_T}->>'error_message', {_T}->>'output')
         ILIKE %(p)s ESCAPE '\\'
  UNION ALL
  SELECT t.position, t.stream_id, 'failed LLM call',
         coalesce({_T}->'response'->'error'->>'type', 'error') || ': '
           || coalesce({_T}->'response'->'error'->>'message', '')
    FROM events t
   WHERE t.type = 'llm_called' AND t.run_id = ANY(%(runs)s)
     AND ({_T}->'response'->'error') IS NOT NULL
     AND ({_T}->'response'->>'error') ILIKE %(p)s ESCAPE '\\'
  UNION ALL
  SELECT t.position, t.stream_id, 'failed attempt',
         concat_ws(': ', {_T}->>'position_key', ({_T}->'error_types')::text,
                   ({_T}->'error_messages')::text)
    FROM events t
   WHERE t.type = 'attempt_failed' AND t.run_id = ANY(%(runs)s)
     AND concat_ws(' ', ({_T}->'error_types')::text, ({_T}->'error_messages')::text)
         ILIKE %(p)s ESCAPE '\\'
  UNION ALL
  SELECT t.position, t.stream_id, 'finished ' || ({_T}->>'status'), {_T}->>'reason'
    FROM events t
   WHERE t.type = 'episode_finished' AND t.run_id = ANY(%(runs)s)
     AND {_T}->>'reason' ILIKE %(p)s ESCAPE '\\'
  UNION ALL
  SELECT 0, e.episode_id, 'replay refused it', e.invalid_reason
    FROM episodes e
   WHERE e.run_id = ANY(%(runs)s) AND e.invalid_reason ILIKE %(p)s ESCAPE '\\'
)
SELECT episode_id, what, detail FROM (
  SELECT DISTINCT ON (episode_id) episode_id, what, detail, position FROM hit
   ORDER BY episode_id, position
) first ORDER BY position DESC, episode_id LIMIT %(limit)s
"""


@dataclass(frozen=True)
class Match:
    """An episode found, what matched (``episode``, ``task``, ``tool error``, ``failed LLM
    call``, ``failed attempt``, ``finished <status>``, ``replay refused it``) and the
    matching text (the first match in the episode)."""

    episode_id: str
    what: str
    detail: str | None


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def search_episodes(store: EventStore, *, run_ids: Sequence[str], text: str,
                    limit: int = 50) -> list[Match]:
    """The episodes of ``run_ids`` where ``text`` occurs (case-insensitive, as plain text:
    ``%`` and ``_`` are no wildcards) in the episode or task id or an error (module
    docstring), newest first, at most ``limit``. Raises ValueError for blank ``text`` or a
    ``limit`` below 1; no runs find nothing."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the search text must not be blank")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
    if not run_ids:
        return []
    params: dict[str, Any] = {"p": _like(text.strip()), "runs": list(run_ids),
                              "limit": limit}
    with store.db.connection() as conn:
        rows = conn.execute(_SEARCH, params).fetchall()
    return [Match(episode_id=r[0], what=r[1], detail=r[2]) for r in rows]
