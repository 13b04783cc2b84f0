"""Credentials scoped to one episode: the key a rollout worker gives a user's RolloutServer.

``api_keys`` gains ``run_id`` and ``episode_id`` (the one run and episode such a key may
record into; NULL for a key of the whole project) and ``expires_at`` (NULL: never; a key past
it reads as revoked at that time). The worker revokes the key when the episode ends; the
expiry bounds a key whose worker died before it could.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-29
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE api_keys ADD COLUMN run_id text;
ALTER TABLE api_keys ADD COLUMN episode_id text;
ALTER TABLE api_keys ADD COLUMN expires_at timestamptz;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_episode_needs_run
    CHECK (episode_id IS NULL OR run_id IS NOT NULL);
"""

DOWNGRADE = r"""
DELETE FROM api_keys WHERE run_id IS NOT NULL OR expires_at IS NOT NULL;
ALTER TABLE api_keys DROP CONSTRAINT api_keys_episode_needs_run;
ALTER TABLE api_keys DROP COLUMN expires_at;
ALTER TABLE api_keys DROP COLUMN episode_id;
ALTER TABLE api_keys DROP COLUMN run_id;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
