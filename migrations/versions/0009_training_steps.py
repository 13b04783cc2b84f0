"""Training steps as data: staleness and off-policy correction of every policy_updated.

Revision ID: 0009
Revises: 0005
Create Date: 2026-11-24
"""

from alembic import op

revision = "0009"
down_revision = "0005"
branch_labels = None
depends_on = None

FUNCTIONS = r"""
-- One row per policy_updated: what the step trained, how stale it was (policy version gap of
-- its samples, samples skipped as too stale) and what the off-policy correction did. Metrics a
-- step did not record (older trainers, or no sample knowing its version) are NULL.
CREATE FUNCTION analytics_training_steps(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, step integer, samples integer, episodes integer,
    skipped_stale integer, version_gap_min double precision,
    version_gap_mean double precision, version_gap_max double precision,
    correction_ratio_mean double precision, correction_ratio_max double precision,
    correction_clipped_frac double precision, correction_rejected_frac double precision,
    correction_kl double precision, uncorrected_samples integer,
    reward_mean double precision, occurred_at timestamptz)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT e.run_id,
           (e.data->>'version')::integer,
           (e.data->>'step')::integer,
           (e.data->'metrics'->>'samples')::double precision::integer,
           (e.data->'metrics'->>'episodes')::double precision::integer,
           (e.data->'metrics'->>'skipped_stale')::double precision::integer,
           (e.data->'metrics'->>'version_gap_min')::double precision,
           (e.data->'metrics'->>'version_gap_mean')::double precision,
           (e.data->'metrics'->>'version_gap_max')::double precision,
           (e.data->'metrics'->>'correction_ratio_mean')::double precision,
           (e.data->'metrics'->>'correction_ratio_max')::double precision,
           (e.data->'metrics'->>'correction_clipped_frac')::double precision,
           (e.data->'metrics'->>'correction_rejected_frac')::double precision,
           (e.data->'metrics'->>'correction_kl')::double precision,
           (e.data->'metrics'->>'correction_uncorrected_samples')::double precision::integer,
           (e.data->'metrics'->>'reward_mean')::double precision,
           e.occurred_at
    FROM events e
    WHERE e.type = 'policy_updated' AND e.run_id IS NOT NULL
      AND (run IS NULL OR e.run_id = run)
      AND (min_version IS NULL OR (e.data->>'version')::integer >= min_version)
      AND (max_version IS NULL OR (e.data->>'version')::integer <= max_version)
      AND (since IS NULL OR e.occurred_at >= since)
      AND (until IS NULL OR e.occurred_at < until)
$$;

CREATE VIEW training_steps AS SELECT * FROM analytics_training_steps();
"""

DOWNGRADE = r"""
DROP VIEW training_steps;
DROP FUNCTION analytics_training_steps;
"""


def upgrade() -> None:
    op.execute(FUNCTIONS)


def downgrade() -> None:
    op.execute(DOWNGRADE)
