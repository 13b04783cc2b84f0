"""The code that wrote each episode's projection: ``episodes.projected_by``.

A dataset derived under rules that replay the episode as the run's own projection did may take
its samples from the projection instead of replaying the events again, but only from one that
the same code version wrote (``workers.replay.code_version``): the column names it. NULL for
projections written before (they are replayed, never reused).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-29
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE episodes ADD COLUMN projected_by text;
"""

DOWNGRADE = r"""
ALTER TABLE episodes DROP COLUMN projected_by;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
