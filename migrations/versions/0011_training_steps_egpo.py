"""Training steps show what the step trained on: the negative samples in its batch and EGPO's
entropy bonus (its mean size over the responses that got one, and their share).

``analytics_training_steps`` (and the ``training_steps`` view over it) gains three columns at
the end: ``negatives``, ``egpo_bonus_mean``, ``egpo_bonus_frac`` (NULL for steps that did not
record them: older trainers, or GRPO, which has no bonus). The view is dropped and made again;
the privileges granted on it (an analyst role's SELECT) are carried over.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# (column, type, expression over the policy_updated event e), in the function's column order.
# The metrics are JSON numbers; counts are cast through double precision.
_METRIC = "(e.data->'metrics'->>'{}')::double precision"
_COUNT = _METRIC + "::integer"
COLUMNS_0009: list[tuple[str, str, str]] = [
    ("run_id", "text", "e.run_id"),
    ("policy_version", "integer", "(e.data->>'version')::integer"),
    ("step", "integer", "(e.data->>'step')::integer"),
    ("samples", "integer", _COUNT.format("samples")),
    ("episodes", "integer", _COUNT.format("episodes")),
    ("skipped_stale", "integer", _COUNT.format("skipped_stale")),
    ("version_gap_min", "double precision", _METRIC.format("version_gap_min")),
    ("version_gap_mean", "double precision", _METRIC.format("version_gap_mean")),
    ("version_gap_max", "double precision", _METRIC.format("version_gap_max")),
    ("correction_ratio_mean", "double precision", _METRIC.format("correction_ratio_mean")),
    ("correction_ratio_max", "double precision", _METRIC.format("correction_ratio_max")),
    ("correction_clipped_frac", "double precision", _METRIC.format("correction_clipped_frac")),
    ("correction_rejected_frac", "double precision",
     _METRIC.format("correction_rejected_frac")),
    ("correction_kl", "double precision", _METRIC.format("correction_kl")),
    ("uncorrected_samples", "integer", _COUNT.format("correction_uncorrected_samples")),
    ("reward_mean", "double precision", _METRIC.format("reward_mean")),
    ("occurred_at", "timestamptz", "e.occurred_at"),
]
COLUMNS_0011 = [*COLUMNS_0009,
                ("negatives", "integer", _COUNT.format("negatives")),
                ("egpo_bonus_mean", "double precision", _METRIC.format("egpo_bonus_mean")),
                ("egpo_bonus_frac", "double precision", _METRIC.format("egpo_bonus_frac"))]


def _function(columns: list[tuple[str, str, str]]) -> str:
    """The ``analytics_training_steps`` function returning ``columns``: one row per
    policy_updated of the run (all runs when NULL), filtered by version and time."""
    returns = ", ".join(f"{name} {kind}" for name, kind, _ in columns)
    select = ",\n           ".join(expression for _, _, expression in columns)
    return f"""
CREATE FUNCTION analytics_training_steps(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE ({returns})
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT {select}
    FROM events e
    WHERE e.type = 'policy_updated' AND e.run_id IS NOT NULL
      AND (run IS NULL OR e.run_id = run)
      AND (min_version IS NULL OR (e.data->>'version')::integer >= min_version)
      AND (max_version IS NULL OR (e.data->>'version')::integer <= max_version)
      AND (since IS NULL OR e.occurred_at >= since)
      AND (until IS NULL OR e.occurred_at < until)
$$;
"""


def _replace(columns: list[tuple[str, str, str]]) -> str:
    """Drop and make again the function and the view, keeping the privileges others hold on
    the view (a dropped view loses them)."""
    return f"""
CREATE TEMP TABLE training_steps_grants ON COMMIT DROP AS
    SELECT g.grantee, g.privilege_type
    FROM information_schema.role_table_grants g
    WHERE g.table_schema = current_schema() AND g.table_name = 'training_steps'
      AND g.grantee <> (SELECT viewowner FROM pg_views
                        WHERE schemaname = current_schema() AND viewname = 'training_steps');
DROP VIEW training_steps;
DROP FUNCTION analytics_training_steps;
{_function(columns)}
CREATE VIEW training_steps AS SELECT * FROM analytics_training_steps();
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT * FROM training_steps_grants LOOP
        EXECUTE format('GRANT %s ON training_steps TO %s', g.privilege_type,
                       CASE WHEN g.grantee = 'PUBLIC' THEN 'PUBLIC'
                            ELSE quote_ident(g.grantee) END);
    END LOOP;
END
$grants$;
DROP TABLE training_steps_grants;
"""


def upgrade() -> None:
    op.execute(_replace(COLUMNS_0011))


def downgrade() -> None:
    op.execute(_replace(COLUMNS_0009))
