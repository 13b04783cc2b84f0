"""Training from a dataset version instead of the run's own projection.

A trainer opened with ``dataset=`` (``Trainer.open``, ``trajstore train --dataset``) takes
each step's samples from that version's rows (``store.datasets``) rather than leasing them
from the run's ``samples`` table. The run still owns the policy: its checkpoints, its
``policy_updated`` events and its configuration (advantage estimator, correction, rollout
level) are the run's; only where the samples come from changes. The run's own projection is
thus one dataset among others.

Iteration: a version's rows are taken group by group (``group_id``, in row order), the
groups this run has trained the fewest times first, so one pass covers every group once
before any is trained twice (epochs). How often a row was trained is read from the lineage
the run recorded (``step_samples`` rows naming the version), so a reopened trainer continues
where the last one stopped. A dataset version is immutable, so nothing is leased: two
trainers of one run on one version may take the same groups: train a dataset from one
trainer process (``--nproc`` above 1 is refused with ``--dataset``).

Each step's ``policy_updated`` names the version (``trained.dataset_id``) and the row
indexes it trained (``trained.sample_ids``); from then on the version cannot be deleted
(``dataset_trained_by``, migration 0016).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence

import numpy as np

from store import errors
from store.datasets import DatasetRow, DatasetVersion, get_version, read_rows
from store.db import Database
from store.leasing import Lease, LeasedSample

__all__ = ["DATASET_LEASE_SECONDS", "dataset_lease", "dataset_samples", "resolve_dataset",
           "rows_by_index"]

#: A dataset "lease" holds nothing in the database; its expiry is only nominal.
DATASET_LEASE_SECONDS = 0


def resolve_dataset(db: Database, project: str, ref: str | int) -> DatasetVersion:
    """The dataset version ``ref`` names in ``project``: ``"NAME@VERSION"``, ``"NAME"`` (its
    latest version) or a ``dataset_id`` (an int, or a string of digits). Raises
    NotFoundError naming ``ref`` when there is no such version (or it belongs to another
    project) and ValidationError for a malformed version."""
    from workers.datasets.compare import parse_ref

    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        dataset_id = int(ref)
        with db.connection() as conn:
            row = conn.execute("SELECT name, version, project FROM datasets"
                               " WHERE dataset_id = %s", (dataset_id,)).fetchone()
        if row is None or row[2] != project:
            raise errors.NotFoundError(f"no dataset version with id {dataset_id} in project "
                                       f"{project!r}")
        found = get_version(db, project, row[0], row[1])
    else:
        if not isinstance(ref, str) or not ref or ref.startswith("@"):
            raise errors.ValidationError(f"dataset must be NAME@VERSION, NAME or an id, got "
                                         f"{ref!r}", field="dataset")
        name, version = parse_ref(ref)
        found = get_version(db, project, name, version)
    if found is None:
        raise errors.NotFoundError(f"no dataset {ref!r} in project {project!r}")
    return found


def _sample(row: DatasetRow, index: int) -> LeasedSample:
    mask = np.asarray(row.loss_mask, dtype=np.uint8)
    return LeasedSample(sample_id=index, run_id=row.run_id, group_id=row.group_id,
                        episode_id=row.episode_id, agent=row.agent, kind=row.kind,
                        reward=float(row.reward), policy_version=None,
                        prompt_length=row.prompt_length, token_ids=row.token_ids,
                        loss_mask=mask, logprobs=row.logprobs, status="leased",
                        num_trainable=int(np.count_nonzero(mask)),
                        error_types=row.error_types)


def rows_by_index(db: Database, dataset_id: int, indexes: Sequence[int]) -> list[LeasedSample]:
    """The rows ``indexes`` of a version as samples (``sample_id`` = row index), in the
    given order. NotFoundError naming the first index the version does not hold."""
    rows = read_rows(db, dataset_id)
    out = []
    for index in indexes:
        if not 0 <= index < len(rows):
            raise errors.NotFoundError(f"dataset version {dataset_id} has no row {index}")
        out.append(_sample(rows[index], index))
    return out


def dataset_samples(db: Database, version: DatasetVersion, run_id: str, *, groups: int
                    ) -> list[LeasedSample]:
    """The next ``groups`` groups of ``version`` for ``run_id`` (module docstring): the
    groups the run trained the fewest times, in row order; every row of a chosen group."""
    with db.connection() as conn:
        counts = dict(conn.execute(
            "SELECT sample_id, count(*) FROM step_samples WHERE run_id = %s"
            " AND dataset_id = %s GROUP BY sample_id",
            (run_id, version.dataset_id)).fetchall())
    rows = read_rows(db, version.dataset_id)
    order: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        order.setdefault(row.group_id, []).append(index)
    times = {g: min(int(counts.get(i, 0)) for i in members) for g, members in order.items()}
    position = {g: n for n, g in enumerate(order)}
    chosen = sorted(order, key=lambda g: (times[g], position[g]))[:groups]
    chosen.sort(key=position.__getitem__)
    return [_sample(rows[i], i) for g in chosen for i in order[g]]


def dataset_lease(run_id: str, samples: list[LeasedSample], dataset_id: int) -> Lease:
    """A lease-shaped holder of a dataset step's samples (nothing is leased in the
    database: ``Lease.dataset_id`` tells the trainer not to acknowledge or release it)."""
    return Lease(lease_id=uuid.uuid4(), run_id=run_id,
                 groups=list(dict.fromkeys(s.group_id for s in samples)),
                 expires_at=dt.datetime.now(dt.UTC), samples=samples, dataset_id=dataset_id)
