"""API keys, and the index that pages through a run's episodes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- A key is shown once, when it is created; only its scrypt hash is kept. key_id is the
-- public part of the key (it names the row to check against); revoking sets revoked_at,
-- rows are never deleted so that a revoked key can never come back.
CREATE TABLE api_keys (
    key_id       text PRIMARY KEY,
    project      text NOT NULL,
    role         text NOT NULL CHECK (role IN ('ingest', 'read', 'admin')),
    name         text,
    secret_hash  bytea NOT NULL,
    salt         bytea NOT NULL,
    -- 'scrypt$<n>$<r>$<p>': the parameters the hash was made with, so that they can change
    -- for new keys without invalidating old ones.
    hash_params  text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz
);
CREATE INDEX api_keys_project_idx ON api_keys (project);

-- Listing a run's episodes in start order with a cursor: an index walk of the page only.
-- Partial, so that appends of other event types never touch it.
CREATE INDEX events_episodes_idx ON events (run_id, position) WHERE type = 'episode_started';
"""

DOWNGRADE = r"""
DROP INDEX events_episodes_idx;
DROP TABLE api_keys;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
