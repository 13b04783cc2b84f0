"""Training steps as data: staleness and off-policy correction of every policy_updated; and
exclusion records, why an episode or sample did not reach training, in one taxonomy.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from alembic import op

revision = "0009"
down_revision = "0008"
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

-- Why an episode, or one of its samples, did not reach training: one row per exclusion, the
-- category from one taxonomy (infra, grader, format, tool, timeout, truncated, stale, capped,
-- rejected, invalid) and the detail it was derived from. sample_id is NULL when the whole
-- episode is excluded (a truncated or failed episode that still yielded a sample trains and
-- is not listed). The rules, in order (docs/training.md lists them):
--   episode invalid                          -> invalid   (detail: invalid_reason)
--   episode truncated                        -> truncated
--   episode aborted, reason "no event for"   -> timeout   (the sweep closed it)
--   episode aborted otherwise                -> infra
--   episode error: reason mentions the reward or grader -> grader; a tool -> tool; format or
--     parse -> format; timeout or "timed out" -> timeout; anything else -> infra
--   sample status stale                      -> stale     (older than the trainer's bound)
--   sample status skipped                    -> capped    (negative over the group's cap)
-- "rejected" (by the off-policy correction) is a per-step statistic of policy_updated
-- (correction_rejected_frac): rejection acts on tokens inside a trained batch.
CREATE FUNCTION analytics_exclusions(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, group_id text, episode_id text, sample_id bigint, policy_version integer,
    category text, detail text, finished_at timestamptz)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH finished AS (
        SELECT e.run_id, e.group_id, e.episode_id, e.policy_version, e.status,
               e.invalid_reason, e.finished_at,
               (SELECT ev.data->>'reason' FROM events ev
                 WHERE ev.stream_id = e.episode_id AND ev.type = 'episode_finished'
                 ORDER BY ev.stream_version DESC LIMIT 1) AS reason
        FROM episodes e
        WHERE (run IS NULL OR e.run_id = run)
          AND (min_version IS NULL OR e.policy_version >= min_version)
          AND (max_version IS NULL OR e.policy_version <= max_version)
          AND (since IS NULL OR e.finished_at >= since)
          AND (until IS NULL OR e.finished_at < until)
    )
    SELECT f.run_id, f.group_id, f.episode_id, NULL::bigint, f.policy_version,
           CASE
               WHEN f.status = 'invalid' THEN 'invalid'
               WHEN f.status = 'truncated' THEN 'truncated'
               WHEN f.status = 'aborted' AND f.reason LIKE 'no event for%' THEN 'timeout'
               WHEN f.status = 'aborted' THEN 'infra'
               WHEN f.reason ~* '(reward|grader)' THEN 'grader'
               WHEN f.reason ~* 'tool' THEN 'tool'
               WHEN f.reason ~* '(format|pars)' THEN 'format'
               WHEN f.reason ~* '(timeout|timed out)' THEN 'timeout'
               ELSE 'infra'
           END,
           coalesce(f.invalid_reason, f.reason, f.status),
           f.finished_at
    FROM finished f
    WHERE f.status IN ('invalid', 'aborted')
       OR (f.status IN ('truncated', 'error')  -- these train when they yielded a sample
           AND NOT EXISTS (SELECT 1 FROM samples p
                           WHERE p.episode_id = f.episode_id AND p.kind = 'positive'))
    UNION ALL
    SELECT s.run_id, s.group_id, s.episode_id, s.sample_id, s.policy_version,
           CASE s.status WHEN 'stale' THEN 'stale' ELSE 'capped' END,
           s.kind || ' sample ' || s.status, f.finished_at
    FROM samples s JOIN finished f ON f.episode_id = s.episode_id
    WHERE s.status IN ('stale', 'skipped')
$$;

CREATE VIEW exclusions AS SELECT * FROM analytics_exclusions();
"""

DOWNGRADE = r"""
DROP VIEW exclusions, training_steps;
DROP FUNCTION analytics_exclusions, analytics_training_steps;
"""


def upgrade() -> None:
    op.execute(FUNCTIONS)


def downgrade() -> None:
    op.execute(DOWNGRADE)
