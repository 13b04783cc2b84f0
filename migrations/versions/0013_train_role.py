"""The ``train`` role: keys that lease, acknowledge and record policy versions.

Reading never changes state: leasing, acknowledging, releasing and renewing leases,
appending ``policy_updated`` and reporting ``policy_served`` need a ``train`` (or ``admin``)
key. The role check of ``api_keys`` takes the new role; keys of the other roles keep theirs.
Downgrading refuses while a ``train`` key exists (revoked ones included: rows are never
deleted), naming how many, rather than dropping them.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE api_keys DROP CONSTRAINT api_keys_role_check;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_role_check
    CHECK (role IN ('ingest', 'read', 'train', 'admin'));
"""

DOWNGRADE = r"""
DO $$
DECLARE
    n bigint;
BEGIN
    SELECT count(*) INTO n FROM api_keys WHERE role = 'train';
    IF n > 0 THEN
        RAISE EXCEPTION 'cannot downgrade below 0013: % API key(s) have the role train', n;
    END IF;
END $$;
ALTER TABLE api_keys DROP CONSTRAINT api_keys_role_check;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_role_check
    CHECK (role IN ('ingest', 'read', 'admin'));
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
