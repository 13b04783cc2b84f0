"""Web-page sessions end on the server: signing out records the session, and a recorded
session is refused even though its cookie is still well-formed and unexpired.

``ended_sessions`` holds the SHA-256 of each ended session token with the token's own
expiry; rows past their expiry are deleted as new ones arrive (an expired token is refused
anyway). Neither the analyst role nor ``PUBLIC`` is granted anything on it.

Revision ID: 0014
Revises: 0012
Create Date: 2026-11-29
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE TABLE ended_sessions (
    token_hash  bytea PRIMARY KEY,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX ended_sessions_expiry_idx ON ended_sessions (expires_at);
"""

DOWNGRADE = r"""
DROP TABLE ended_sessions;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
