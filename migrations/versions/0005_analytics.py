"""Failure analytics: error signatures, tool call projection, analytics functions and views.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The signature of an error message: the same failure with other numbers, paths, quoted
# names or ids groups together. store/error_signature.py holds the same rules in Python and
# the tests check that both agree; change them together (in a new migration).
SIGNATURE_FUNCTION = r"""
CREATE FUNCTION trajstore_error_signature(message text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    s text := message;
    -- not right after a letter, digit or underscore
    w constant text := '(?<![0-9A-Za-z_])';
    hex8 constant text := '[0-9A-Fa-f]{8}-';
    hex4 constant text := '[0-9A-Fa-f]{4}-';
BEGIN
    -- Only ASCII classes and no alternation whose choice depends on the engine: PostgreSQL's
    -- regular expressions prefer the longest match, Python's the first alternative, and
    -- these patterns give both the same answer.
    s := regexp_replace(s, w || hex8 || hex4 || hex4 || hex4 || '[0-9A-Fa-f]{12}'
                           || '(?![0-9A-Za-z_])', '<uuid>', 'g');
    s := regexp_replace(s, w || '0[xX][0-9A-Fa-f]+(?![0-9A-Za-z_])', '<hex>', 'g');
    s := regexp_replace(s, w || '(?=[0-9A-Fa-f]*[A-Fa-f])(?=[0-9A-Fa-f]*[0-9])'
                           || '[0-9A-Fa-f]{8,}(?![0-9A-Za-z_])', '<hex>', 'g');
    s := regexp_replace(s, w || '([A-Za-z]:|[.]{1,2}|~)?([/\\][0-9A-Za-z_.@+-]+)+', '<path>',
                        'g');
    s := regexp_replace(s, w || '''[^''\n]*''', '''<str>''', 'g');
    s := regexp_replace(s, w || '"[^"\n]*"', '"<str>"', 'g');
    s := regexp_replace(s, w || '`[^`\n]*`', '`<str>`', 'g');
    s := regexp_replace(s, w || '[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?', '<n>', 'g');
    s := regexp_replace(s, '[ \t\n\r\f\v]+', ' ', 'g');
    RETURN left(btrim(s, ' '), 1000);
END;
$$;
"""

TABLES = r"""
-- The raw text stays in error_message; the signature is derived from it by the database, so
-- that every writer (and a rebuild) stores the same one.
ALTER TABLE failures
    ADD COLUMN error_signature text
        GENERATED ALWAYS AS (trajstore_error_signature(error_message)) STORED,
    -- the attempt that failed was rolled back and the position tried again
    ADD COLUMN retried boolean NOT NULL DEFAULT false,
    -- retries from this failure until the agent passed its position; NULL: never passed
    ADD COLUMN retries_to_recover integer CHECK (retries_to_recover >= 1);

-- One row per tool_returned: the calls that tool error rates are shares of.
CREATE TABLE tool_calls (
    episode_id      text NOT NULL REFERENCES episodes ON DELETE CASCADE,
    stream_version  integer NOT NULL,
    run_id          text NOT NULL,
    group_id        text NOT NULL,
    agent           text NOT NULL,
    -- the agent's latest llm_called version, as failures.policy_version
    policy_version  integer,
    tool_name       text NOT NULL,
    is_error        boolean NOT NULL,
    error_type      text,
    position_key    text,
    duration_ms     double precision,
    occurred_at     timestamptz,
    PRIMARY KEY (episode_id, stream_version)
);

-- Every analytics function narrows by run first, then by version or time: these are the
-- index walks their plans take (tests/analytics checks the plans on a store of 1M events).
CREATE INDEX tool_calls_run_idx ON tool_calls (run_id, policy_version, tool_name);
CREATE INDEX episodes_run_version_idx ON episodes (run_id, policy_version);
CREATE INDEX episodes_finished_at_idx ON episodes (finished_at);

-- Episodes projected before this revision have no tool_calls rows and no retry columns:
-- mark them for replay, and the periodic sweep re-projects them (sample lease state is kept
-- by the projection writer).
UPDATE episodes SET projected_version = 0;
"""

# Each view is an inlinable SQL function (LANGUAGE sql, STABLE, one SELECT) with optional
# filters, and a view that calls it with none. The planner inlines the body into the calling
# query, so a NULL filter folds away and a given one becomes an index condition; a WHERE on
# the view's run_id is pushed below its GROUP BY in the same way. Argument names differ from
# every column name in the bodies (a column would win over an argument of the same name).
# Time windows select episodes by finished_at: since <= finished_at < until. A join to
# episodes that only serves the window is a LEFT JOIN on its key (every projection row has its
# episode), which the planner drops when no window is given. Joins to episodes also equate
# run_id (a projection row's run is its episode's), so that a run filter reaches the episodes'
# run index rather than a scan of every episode. Filters fold away only when the planner sees
# their values: constants, or parameters of an unprepared statement (as store.analytics sends
# them); an expression such as now() - interval '1 hour' is not folded and the plan cannot use
# the finished_at index.
FUNCTIONS = r"""
CREATE FUNCTION analytics_failure_patterns(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
    tool text DEFAULT NULL, error_kind text DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, tool_name text, error_type text, position_key text,
    failures bigint, episodes_affected bigint, tool_calls bigint,
    share_of_calls double precision, recovered_by_retry bigint,
    recovered_by_retry_rate double precision, mean_retries_to_recover double precision,
    terminated_episodes bigint)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH grouped AS (
        SELECT f.run_id, f.policy_version, f.tool_name, f.error_type, f.position_key,
               count(*) AS failures,
               count(DISTINCT f.episode_id) AS episodes_affected,
               count(f.retries_to_recover) AS recovered_by_retry,
               avg(f.retries_to_recover)::double precision AS mean_retries_to_recover,
               count(DISTINCT f.episode_id) FILTER (WHERE e.status = 'terminated')
                   AS terminated_episodes
        FROM failures f
        JOIN episodes e ON e.episode_id = f.episode_id AND e.run_id = f.run_id
        WHERE f.source = 'tool'
          AND (run IS NULL OR f.run_id = run)
          AND (min_version IS NULL OR f.policy_version >= min_version)
          AND (max_version IS NULL OR f.policy_version <= max_version)
          AND (since IS NULL OR e.finished_at >= since)
          AND (until IS NULL OR e.finished_at < until)
          AND (tool IS NULL OR f.tool_name = tool)
          AND (error_kind IS NULL OR f.error_type = error_kind)
        GROUP BY f.run_id, f.policy_version, f.tool_name, f.error_type, f.position_key
    ), calls AS (
        SELECT t.run_id, t.policy_version, t.tool_name, count(*) AS calls
        FROM tool_calls t
        LEFT JOIN episodes e ON e.episode_id = t.episode_id AND e.run_id = t.run_id
        WHERE (run IS NULL OR t.run_id = run)
          AND (min_version IS NULL OR t.policy_version >= min_version)
          AND (max_version IS NULL OR t.policy_version <= max_version)
          AND (since IS NULL OR e.finished_at >= since)
          AND (until IS NULL OR e.finished_at < until)
          AND (tool IS NULL OR t.tool_name = tool)
        GROUP BY t.run_id, t.policy_version, t.tool_name
    )
    SELECT g.run_id, g.policy_version, g.tool_name, g.error_type, g.position_key,
           g.failures, g.episodes_affected, coalesce(c.calls, 0),
           g.failures::double precision / nullif(c.calls, 0),
           g.recovered_by_retry, g.recovered_by_retry::double precision / g.failures,
           g.mean_retries_to_recover, g.terminated_episodes
    FROM grouped g
    LEFT JOIN calls c ON c.run_id = g.run_id AND c.tool_name = g.tool_name
                     AND c.policy_version IS NOT DISTINCT FROM g.policy_version
$$;

CREATE FUNCTION analytics_rollback_outcomes(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, episodes bigint, episodes_with_rollback bigint,
    rollbacks bigint, failed_attempts bigint, rolled_back_positions bigint,
    successful_retries bigint, recovery_rate double precision,
    terminated_at_retry_limit bigint, mean_reward_with_rollback double precision,
    mean_reward_without_rollback double precision)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT e.run_id, e.policy_version,
           count(*),
           count(*) FILTER (WHERE e.rollbacks > 0),
           coalesce(sum(e.rollbacks), 0),
           coalesce(sum(e.attempts_failed), 0),
           coalesce(sum(p.retried_positions), 0),
           coalesce(sum(p.recovered_positions), 0),
           sum(p.recovered_positions)::double precision / nullif(sum(p.retried_positions), 0),
           -- the retry limit is the run's rollback.max_tool_retries: a failure at that
           -- retry index is not retried and ends the episode terminated
           count(*) FILTER (WHERE e.status = 'terminated' AND p.last_unretried
                            >= (r.config #>> '{rollback,max_tool_retries}')::integer),
           avg(e.reward) FILTER (WHERE e.rollbacks > 0),
           avg(e.reward) FILTER (WHERE e.rollbacks = 0)
    FROM episodes e
    JOIN runs r ON r.run_id = e.run_id
    CROSS JOIN LATERAL (
        SELECT count(DISTINCT (f.agent, f.position_key)) FILTER (WHERE f.retried)
                   AS retried_positions,
               count(DISTINCT (f.agent, f.position_key))
                   FILTER (WHERE f.retries_to_recover IS NOT NULL) AS recovered_positions,
               max(f.retry_index) FILTER (WHERE NOT f.retried) AS last_unretried
        FROM failures f
        WHERE f.episode_id = e.episode_id AND f.source = 'tool'
    ) p
    WHERE (run IS NULL OR e.run_id = run)
      AND (min_version IS NULL OR e.policy_version >= min_version)
      AND (max_version IS NULL OR e.policy_version <= max_version)
      AND (since IS NULL OR e.finished_at >= since)
      AND (until IS NULL OR e.finished_at < until)
    GROUP BY e.run_id, e.policy_version
$$;

CREATE FUNCTION analytics_tool_error_rates(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL, tool text DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, tool_name text, calls bigint, errors bigint,
    error_rate double precision, episodes bigint, episodes_with_errors bigint,
    error_types bigint, recovered_errors bigint, mean_duration_ms double precision)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    WITH calls AS (
        SELECT t.run_id, t.policy_version, t.tool_name,
               count(*) AS calls,
               count(*) FILTER (WHERE t.is_error) AS errors,
               count(DISTINCT t.episode_id) AS episodes,
               count(DISTINCT t.episode_id) FILTER (WHERE t.is_error) AS episodes_with_errors,
               count(DISTINCT t.error_type) FILTER (WHERE t.is_error) AS error_types,
               avg(t.duration_ms) AS mean_duration_ms
        FROM tool_calls t
        LEFT JOIN episodes e ON e.episode_id = t.episode_id AND e.run_id = t.run_id
        WHERE (run IS NULL OR t.run_id = run)
          AND (min_version IS NULL OR t.policy_version >= min_version)
          AND (max_version IS NULL OR t.policy_version <= max_version)
          AND (since IS NULL OR e.finished_at >= since)
          AND (until IS NULL OR e.finished_at < until)
          AND (tool IS NULL OR t.tool_name = tool)
        GROUP BY t.run_id, t.policy_version, t.tool_name
    ), recovered AS (
        SELECT f.run_id, f.policy_version, f.tool_name,
               count(*) FILTER (WHERE f.recovered) AS recovered_errors
        FROM failures f
        LEFT JOIN episodes e ON e.episode_id = f.episode_id AND e.run_id = f.run_id
        WHERE f.source = 'tool'
          AND (run IS NULL OR f.run_id = run)
          AND (min_version IS NULL OR f.policy_version >= min_version)
          AND (max_version IS NULL OR f.policy_version <= max_version)
          AND (since IS NULL OR e.finished_at >= since)
          AND (until IS NULL OR e.finished_at < until)
          AND (tool IS NULL OR f.tool_name = tool)
        GROUP BY f.run_id, f.policy_version, f.tool_name
    )
    SELECT c.run_id, c.policy_version, c.tool_name, c.calls, c.errors,
           c.errors::double precision / c.calls, c.episodes, c.episodes_with_errors,
           c.error_types, coalesce(r.recovered_errors, 0), c.mean_duration_ms
    FROM calls c
    LEFT JOIN recovered r ON r.run_id = c.run_id AND r.tool_name = c.tool_name
                         AND r.policy_version IS NOT DISTINCT FROM c.policy_version
$$;

CREATE FUNCTION analytics_episode_outcomes(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, group_id text, status text, episodes bigint,
    mean_reward double precision, min_reward double precision, max_reward double precision,
    mean_llm_calls double precision, mean_tool_calls double precision,
    mean_tokens double precision, max_tokens integer)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT e.run_id, e.policy_version, e.group_id, e.status, count(*),
           avg(e.reward), min(e.reward), max(e.reward),
           avg(e.llm_calls)::double precision, avg(e.tool_calls)::double precision,
           avg(e.tokens)::double precision, max(e.tokens)
    FROM episodes e
    WHERE (run IS NULL OR e.run_id = run)
      AND (min_version IS NULL OR e.policy_version >= min_version)
      AND (max_version IS NULL OR e.policy_version <= max_version)
      AND (since IS NULL OR e.finished_at >= since)
      AND (until IS NULL OR e.finished_at < until)
    GROUP BY e.run_id, e.policy_version, e.group_id, e.status
$$;

CREATE FUNCTION analytics_timeline_stats(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, episodes bigint, timelines_before bigint,
    timelines_after bigint, merge_ratio double precision, forks bigint,
    forks_content bigint, forks_tool_calls bigint, forks_tools bigint,
    forks_token_drift bigint, drifted_messages bigint, episodes_with_drift bigint)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- Invalid episodes were never merged: they are left out.
    SELECT e.run_id, e.policy_version, count(*),
           sum(e.timelines), sum(e.survivors),
           sum(e.timelines)::double precision / nullif(sum(e.survivors), 0),
           sum(k.forks), sum(k.content), sum(k.tool_calls), sum(k.tools), sum(k.token_drift),
           sum(e.drifted_messages), count(*) FILTER (WHERE e.drifted_messages > 0)
    FROM episodes e
    CROSS JOIN LATERAL (
        SELECT count(*) AS forks,
               count(*) FILTER (WHERE tf.reason = 'content') AS content,
               count(*) FILTER (WHERE tf.reason = 'tool_calls') AS tool_calls,
               count(*) FILTER (WHERE tf.reason = 'tools') AS tools,
               count(*) FILTER (WHERE tf.reason = 'token_drift') AS token_drift
        FROM timeline_forks tf
        WHERE tf.episode_id = e.episode_id
    ) k
    WHERE e.status <> 'invalid'
      AND (run IS NULL OR e.run_id = run)
      AND (min_version IS NULL OR e.policy_version >= min_version)
      AND (max_version IS NULL OR e.policy_version <= max_version)
      AND (since IS NULL OR e.finished_at >= since)
      AND (until IS NULL OR e.finished_at < until)
    GROUP BY e.run_id, e.policy_version
$$;

CREATE FUNCTION analytics_negative_sample_stats(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (
    run_id text, policy_version integer, positives bigint, negatives bigint,
    negative_share double precision, episodes_with_negatives bigint,
    groups_with_negatives bigint, ready bigint, leased bigint, consumed bigint,
    skipped bigint, stale bigint, mean_negative_tokens double precision,
    mean_negative_trainable double precision, mean_negative_reward double precision)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT s.run_id, s.policy_version,
           count(*) FILTER (WHERE s.kind = 'positive'),
           count(*) FILTER (WHERE s.kind = 'negative'),
           (count(*) FILTER (WHERE s.kind = 'negative'))::double precision / count(*),
           count(DISTINCT s.episode_id) FILTER (WHERE s.kind = 'negative'),
           count(DISTINCT s.group_id) FILTER (WHERE s.kind = 'negative'),
           count(*) FILTER (WHERE s.kind = 'negative' AND s.status = 'ready'),
           count(*) FILTER (WHERE s.kind = 'negative' AND s.status = 'leased'),
           count(*) FILTER (WHERE s.kind = 'negative' AND s.status = 'consumed'),
           count(*) FILTER (WHERE s.kind = 'negative' AND s.status = 'skipped'),
           count(*) FILTER (WHERE s.kind = 'negative' AND s.status = 'stale'),
           (avg(s.num_tokens) FILTER (WHERE s.kind = 'negative'))::double precision,
           (avg(s.num_trainable) FILTER (WHERE s.kind = 'negative'))::double precision,
           avg(s.reward) FILTER (WHERE s.kind = 'negative')
    FROM samples s
    LEFT JOIN episodes e ON e.episode_id = s.episode_id AND e.run_id = s.run_id
    WHERE (run IS NULL OR s.run_id = run)
      AND (min_version IS NULL OR s.policy_version >= min_version)
      AND (max_version IS NULL OR s.policy_version <= max_version)
      AND (since IS NULL OR e.finished_at >= since)
      AND (until IS NULL OR e.finished_at < until)
    GROUP BY s.run_id, s.policy_version
$$;

CREATE FUNCTION analytics_error_signatures(
    run text DEFAULT NULL, min_version integer DEFAULT NULL, max_version integer DEFAULT NULL,
    since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
    tool text DEFAULT NULL, error_kind text DEFAULT NULL)
RETURNS TABLE (
    run_id text, tool_name text, error_type text, error_signature text, failures bigint,
    episodes_affected bigint, first_version integer, last_version integer,
    first_seen timestamptz, last_seen timestamptz, example_message text)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT f.run_id, f.tool_name, f.error_type, f.error_signature, count(*),
           count(DISTINCT f.episode_id), min(f.policy_version), max(f.policy_version),
           min(f.occurred_at), max(f.occurred_at),
           -- the example does not depend on the database's collation
           min(f.error_message COLLATE "C")
    FROM failures f
    LEFT JOIN episodes e ON e.episode_id = f.episode_id AND e.run_id = f.run_id
    WHERE f.source = 'tool'
      AND (run IS NULL OR f.run_id = run)
      AND (min_version IS NULL OR f.policy_version >= min_version)
      AND (max_version IS NULL OR f.policy_version <= max_version)
      AND (since IS NULL OR e.finished_at >= since)
      AND (until IS NULL OR e.finished_at < until)
      AND (tool IS NULL OR f.tool_name = tool)
      AND (error_kind IS NULL OR f.error_type = error_kind)
    GROUP BY f.run_id, f.tool_name, f.error_type, f.error_signature
$$;

CREATE VIEW failure_patterns AS SELECT * FROM analytics_failure_patterns();
CREATE VIEW rollback_outcomes AS SELECT * FROM analytics_rollback_outcomes();
CREATE VIEW tool_error_rates AS SELECT * FROM analytics_tool_error_rates();
CREATE VIEW episode_outcomes AS SELECT * FROM analytics_episode_outcomes();
CREATE VIEW timeline_stats AS SELECT * FROM analytics_timeline_stats();
CREATE VIEW negative_sample_stats AS SELECT * FROM analytics_negative_sample_stats();
CREATE VIEW error_signatures AS SELECT * FROM analytics_error_signatures();
"""

DOWNGRADE = r"""
DROP VIEW error_signatures, negative_sample_stats, timeline_stats, episode_outcomes,
    tool_error_rates, rollback_outcomes, failure_patterns;
DROP FUNCTION analytics_error_signatures, analytics_negative_sample_stats,
    analytics_timeline_stats, analytics_episode_outcomes, analytics_tool_error_rates,
    analytics_rollback_outcomes, analytics_failure_patterns;
DROP INDEX episodes_finished_at_idx;
DROP INDEX episodes_run_version_idx;
DROP TABLE tool_calls;
ALTER TABLE failures DROP COLUMN retries_to_recover, DROP COLUMN retried,
    DROP COLUMN error_signature;
DROP FUNCTION trajstore_error_signature(text);
"""


def upgrade() -> None:
    op.execute(SIGNATURE_FUNCTION)
    op.execute(TABLES)
    op.execute(FUNCTIONS)


def downgrade() -> None:
    op.execute(DOWNGRADE)
