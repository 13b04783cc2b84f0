"""Leases of complete groups to trainers.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE TABLE leases (
    lease_id        uuid PRIMARY KEY,
    run_id          text NOT NULL,
    trainer         text,
    groups          text[] NOT NULL,
    samples         integer NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    -- how the lease ended: acked (trained), released (given back), expired (trainer gone)
    ended           text CHECK (ended IN ('acked', 'released', 'expired')),
    ended_at        timestamptz,
    policy_version  integer
);
CREATE INDEX leases_live_idx ON leases (expires_at) WHERE ended IS NULL;

-- stale: older than the trainer's max_staleness when leasing looked at it;
-- skipped: a negative beyond the group's cap.
ALTER TABLE samples DROP CONSTRAINT samples_status_check;
ALTER TABLE samples ADD CONSTRAINT samples_status_check
    CHECK (status IN ('ready', 'leased', 'consumed', 'stale', 'skipped'));
CREATE INDEX samples_lease_idx ON samples (lease_id) WHERE lease_id IS NOT NULL;
"""

DOWNGRADE = r"""
DROP INDEX samples_lease_idx;
UPDATE samples SET status = 'ready' WHERE status IN ('stale', 'skipped');
ALTER TABLE samples DROP CONSTRAINT samples_status_check;
ALTER TABLE samples ADD CONSTRAINT samples_status_check
    CHECK (status IN ('ready', 'leased', 'consumed'));
DROP TABLE leases;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
