"""Projection conflicts: what a re-projection wanted to do to a sample already leased or trained,
and did not do.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- A sample that a trainer leased or acknowledged is never changed or deleted by a later
-- projection of its episode (a rebuild after a code change, a manual replay): the sample stays
-- as it was and the rebuild's wish is recorded here instead, once per sample, projected
-- version, action and set of columns.
CREATE TABLE projection_conflicts (
    conflict_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    episode_id         text NOT NULL,
    run_id             text NOT NULL,
    -- the sample's key, as in samples_key
    kind               text NOT NULL,
    timeline_index     integer NOT NULL,
    sample_id          bigint NOT NULL,
    -- the sample's state when the rebuild met it: leased or consumed
    sample_status      text NOT NULL,
    -- change: the rebuild made this sample with other values (columns says which);
    -- delete: the rebuild made no sample with this key
    action             text NOT NULL CHECK (action IN ('change', 'delete')),
    columns            text[] NOT NULL DEFAULT '{}',
    -- the stream version the rebuild projected
    projected_version  integer NOT NULL,
    recorded_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT projection_conflicts_once
        UNIQUE (episode_id, kind, timeline_index, projected_version, action, columns)
);
CREATE INDEX projection_conflicts_recorded_idx ON projection_conflicts (recorded_at);
"""

DOWNGRADE = r"""
DROP TABLE projection_conflicts;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
