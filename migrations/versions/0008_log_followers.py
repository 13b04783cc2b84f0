"""Durable cursors of the processes that follow the event log (the replay dispatcher).

Revision ID: 0008
Revises: 0005
Create Date: 2026-11-24
"""

from alembic import op

revision = "0008"
down_revision = "0005"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- One row per follower: the log position (writing transaction, position) up to which it has
-- acted on every event. A follower that restarts goes on from here, so an event read before
-- the restart and acted on is not acted on again, and none is skipped.
CREATE TABLE log_followers (
    name        text PRIMARY KEY,
    tx_id       bigint NOT NULL,
    position    bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
"""

DOWNGRADE = r"""
DROP TABLE log_followers;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
