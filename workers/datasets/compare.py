"""Comparing two dataset versions: rows added, removed and changed (matched by episode, kind
and timeline index; changed when their content hashes differ), and how the mean reward (and
the mean advantage, when both versions have advantages) moved, overall and per failure type.

``diff_rows`` is pure (two lists of row summaries in); ``diff_datasets`` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from store import datasets as tables
from store import errors
from store.db import Database

__all__ = ["DatasetDiff", "Shift", "diff_datasets", "diff_rows", "parse_ref"]

#: The failure type of rows that met none.
NO_FAILURE = "none"


@dataclass(frozen=True)
class Shift:
    """Mean of a quantity over the rows of each version (None: no row has it) and
    ``shift`` = b - a (None unless both are known)."""

    a: float | None
    b: float | None
    shift: float | None
    rows_a: int
    rows_b: int


@dataclass(frozen=True)
class DatasetDiff:
    """``added`` / ``removed`` / ``changed``: row keys (``episode_id``, ``kind``,
    ``timeline_index``) in b only, in a only, in both with different content;
    ``unchanged``: how many are equal. ``reward`` and ``advantage`` (None unless both
    versions have advantages): the shift of their means overall; ``by_failure_type`` the
    same per failure type (``none`` for rows that met no failure)."""

    a: dict[str, Any]
    b: dict[str, Any]
    added: list[dict[str, Any]]
    removed: list[dict[str, Any]]
    changed: list[dict[str, Any]]
    unchanged: int
    reward: Shift
    advantage: Shift | None
    by_failure_type: dict[str, dict[str, Shift | None]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The comparison as plain JSON-able data."""
        return asdict(self)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _shift(a: list[dict[str, Any]], b: list[dict[str, Any]], column: str) -> Shift:
    va = [r[column] for r in a if r[column] is not None]
    vb = [r[column] for r in b if r[column] is not None]
    ma, mb = _mean(va), _mean(vb)
    return Shift(a=ma, b=mb, shift=None if ma is None or mb is None else mb - ma,
                 rows_a=len(a), rows_b=len(b))


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return (row["episode_id"], row["kind"], row["timeline_index"])


def _named(key: tuple[str, str, int]) -> dict[str, Any]:
    return {"episode_id": key[0], "kind": key[1], "timeline_index": key[2]}


def diff_rows(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], *,
              a_info: dict[str, Any] | None = None, b_info: dict[str, Any] | None = None
              ) -> DatasetDiff:
    """The comparison of two versions' row summaries (``store.datasets.read_row_summaries``:
    episode_id, kind, timeline_index, row_hash, reward, advantage, failure_type)."""
    ka = {_key(r): r for r in a}
    kb = {_key(r): r for r in b}
    added = [_named(k) for k in kb if k not in ka]
    removed = [_named(k) for k in ka if k not in kb]
    changed = [_named(k) for k in ka if k in kb and ka[k]["row_hash"] != kb[k]["row_hash"]]
    unchanged = sum(1 for k in ka if k in kb and ka[k]["row_hash"] == kb[k]["row_hash"])
    with_advantage = any(r["advantage"] is not None for r in a) and any(
        r["advantage"] is not None for r in b)
    types = sorted({r["failure_type"] or NO_FAILURE for r in [*a, *b]})
    by_type: dict[str, dict[str, Shift | None]] = {}
    for t in types:
        ra = [r for r in a if (r["failure_type"] or NO_FAILURE) == t]
        rb = [r for r in b if (r["failure_type"] or NO_FAILURE) == t]
        by_type[t] = {"reward": _shift(ra, rb, "reward"),
                      "advantage": _shift(ra, rb, "advantage") if with_advantage else None}
    return DatasetDiff(a=a_info or {}, b=b_info or {}, added=added, removed=removed,
                       changed=changed, unchanged=unchanged,
                       reward=_shift(list(a), list(b), "reward"),
                       advantage=_shift(list(a), list(b), "advantage") if with_advantage
                       else None, by_failure_type=by_type)


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``"name@version"`` (or ``"name"``: its latest version) as ``(name, version)``.
    Raises ValidationError when the version is not a positive whole number."""
    name, at, version = ref.partition("@")
    if not at:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise errors.ValidationError(f"{ref!r}: a version is a positive whole number",
                                     field="version")
    return name, int(version)


def diff_datasets(db: Database, project: str, a: str | tuple[str, int | None],
                  b: str | tuple[str, int | None]) -> DatasetDiff:
    """Compare versions ``a`` and ``b`` of datasets of ``project`` (each ``"name@version"``,
    ``"name"`` for the latest, or ``(name, version)``). Raises NotFoundError naming the
    version that does not exist."""
    found = []
    for ref in (a, b):
        name, version = parse_ref(ref) if isinstance(ref, str) else ref
        v = tables.get_version(db, project, name, version)
        if v is None:
            what = f"version {version}" if version is not None else "version"
            raise errors.NotFoundError(f"no dataset {name!r} {what} in project {project!r}")
        found.append(v)
    va, vb = found
    info = [{"name": v.name, "version": v.version, "content_hash": v.content_hash,
             "rows": v.num_rows} for v in found]
    return diff_rows(tables.read_row_summaries(db, va.dataset_id),
                     tables.read_row_summaries(db, vb.dataset_id),
                     a_info=info[0], b_info=info[1])
