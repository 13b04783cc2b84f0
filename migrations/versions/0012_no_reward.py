"""No invented reward: an episode without a reward is not trainable until one arrives.

Samples gain the status ``no_reward``: the samples of an episode that has no
``reward_assigned`` yet (and, for the moment between a late reward's append and its
re-projection, the samples that reward is about to replace). Leasing never takes them. The
ready samples of unrewarded episodes projected before are set so.

``analytics_exclusions`` (and the ``exclusions`` view over it) gains the category
``no_reward`` for such an episode, and classifies by what it is: a ``truncated`` episode is
``truncated`` only when it yielded no positive sample, an ``error`` episode is classified by
its reason when it yielded no positive sample or has no reward. Same columns, so the view
and the privileges granted on it stay.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

import importlib

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE samples DROP CONSTRAINT samples_status_check;
ALTER TABLE samples ADD CONSTRAINT samples_status_check
    CHECK (status IN ('ready', 'leased', 'consumed', 'stale', 'skipped', 'no_reward'));
-- Samples projected before this revision for an episode without a reward were ready (and
-- leasing made their reward 0.0): they wait for their reward now, as a new projection's do.
UPDATE samples s SET status = 'no_reward' FROM episodes e
 WHERE e.episode_id = s.episode_id AND e.reward IS NULL AND s.status = 'ready';

-- Why an episode, or one of its samples, did not reach training (docs/training.md lists the
-- rules). In order, for an episode (sample_id NULL):
--   invalid                                   -> invalid   (detail: invalid_reason)
--   aborted, reason "no event for"            -> timeout   (the sweep closed it)
--   aborted otherwise                         -> infra
--   truncated with no positive sample         -> truncated
--   error with no positive sample or no reward: reason mentions the reward or grader ->
--     grader; a tool -> tool; format or parse -> format; timeout or "timed out" -> timeout;
--     anything else -> infra
--   no reward_assigned (any other status)     -> no_reward (until a reward arrives)
-- and for a sample: status stale -> stale, skipped -> capped.
CREATE OR REPLACE FUNCTION analytics_exclusions(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, group_id text, episode_id text, sample_id bigint, policy_version integer,
    category text, detail text, finished_at timestamptz)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH finished AS (
        SELECT e.run_id, e.group_id, e.episode_id, e.policy_version, e.status,
               e.invalid_reason, e.finished_at, e.reward,
               (SELECT ev.data->>'reason' FROM events ev
                 WHERE ev.stream_id = e.episode_id AND ev.type = 'episode_finished'
                 ORDER BY ev.stream_version DESC LIMIT 1) AS reason,
               EXISTS (SELECT 1 FROM samples p
                       WHERE p.episode_id = e.episode_id AND p.kind = 'positive')
                   AS has_positive
        FROM episodes e
        WHERE (run IS NULL OR e.run_id = run)
          AND (min_version IS NULL OR e.policy_version >= min_version)
          AND (max_version IS NULL OR e.policy_version <= max_version)
          AND (since IS NULL OR e.finished_at >= since)
          AND (until IS NULL OR e.finished_at < until)
    ), classified AS (
        SELECT f.*,
               CASE
                   WHEN f.status = 'invalid' THEN 'invalid'
                   WHEN f.status = 'aborted' AND f.reason LIKE 'no event for%' THEN 'timeout'
                   WHEN f.status = 'aborted' THEN 'infra'
                   WHEN f.status = 'truncated' AND NOT f.has_positive THEN 'truncated'
                   WHEN f.status = 'error' AND (NOT f.has_positive OR f.reward IS NULL) THEN
                       CASE
                           WHEN f.reason ~* '(reward|grader)' THEN 'grader'
                           WHEN f.reason ~* 'tool' THEN 'tool'
                           WHEN f.reason ~* '(format|pars)' THEN 'format'
                           WHEN f.reason ~* '(timeout|timed out)' THEN 'timeout'
                           ELSE 'infra'
                       END
                   WHEN f.reward IS NULL THEN 'no_reward'
               END AS category
        FROM finished f
    )
    SELECT c.run_id, c.group_id, c.episode_id, NULL::bigint, c.policy_version, c.category,
           CASE WHEN c.category = 'no_reward'
                THEN 'no reward_assigned: not trainable until a reward arrives'
                ELSE coalesce(c.invalid_reason, c.reason, c.status) END,
           c.finished_at
    FROM classified c
    WHERE c.category IS NOT NULL
    UNION ALL
    SELECT s.run_id, s.group_id, s.episode_id, s.sample_id, s.policy_version,
           CASE s.status WHEN 'stale' THEN 'stale' ELSE 'capped' END,
           s.kind || ' sample ' || s.status, f.finished_at
    FROM samples s JOIN finished f ON f.episode_id = s.episode_id
    WHERE s.status IN ('stale', 'skipped')
$$;
"""


def _exclusions_0009() -> str:
    """The function as migration 0009 made it, to put back on downgrade."""
    functions = importlib.import_module("migrations.versions.0009_training_steps").FUNCTIONS
    start = functions.index("CREATE FUNCTION analytics_exclusions(")
    end = functions.index("CREATE VIEW exclusions")
    return "CREATE OR REPLACE" + functions[start:end][len("CREATE"):]


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(
        "UPDATE samples SET status = 'ready' WHERE status = 'no_reward';"
        " ALTER TABLE samples DROP CONSTRAINT samples_status_check;"
        " ALTER TABLE samples ADD CONSTRAINT samples_status_check"
        " CHECK (status IN ('ready', 'leased', 'consumed', 'stale', 'skipped'));"
        + _exclusions_0009())
