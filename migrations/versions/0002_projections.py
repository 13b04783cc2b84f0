"""Projections of replayed episodes: episodes, samples, timeline forks, failures.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- Finding finished episodes: the sweep and the replay task look them up by stream.
CREATE INDEX events_finished_idx ON events (stream_id) WHERE type = 'episode_finished';

-- A run's configuration as its run_created event states it.
CREATE TABLE runs (
    run_id                 text PRIMARY KEY,
    project                text NOT NULL,
    group_size             integer NOT NULL,
    max_negatives_per_group integer NOT NULL,
    save_negative_samples  boolean NOT NULL,
    config                 jsonb NOT NULL,
    created_at             timestamptz NOT NULL
);

CREATE TABLE episodes (
    episode_id        text PRIMARY KEY,
    run_id            text NOT NULL,
    group_id          text NOT NULL,
    task_id           text,
    -- completed, terminated, truncated, error, aborted (from episode_finished) or invalid
    -- (the events could not be replayed; invalid_reason says why).
    status            text NOT NULL,
    invalid_reason    text,
    reward            double precision,
    policy_version    integer,
    llm_calls         integer NOT NULL DEFAULT 0,
    tool_calls        integer NOT NULL DEFAULT 0,
    tool_errors       integer NOT NULL DEFAULT 0,
    attempts_failed   integer NOT NULL DEFAULT 0,
    rollbacks         integer NOT NULL DEFAULT 0,
    timelines         integer NOT NULL DEFAULT 0,
    survivors         integer NOT NULL DEFAULT 0,
    forks             integer NOT NULL DEFAULT 0,
    drifted_messages  integer NOT NULL DEFAULT 0,
    negatives         integer NOT NULL DEFAULT 0,
    tokens            integer NOT NULL DEFAULT 0,
    started_at        timestamptz,
    finished_at       timestamptz,
    -- The projection checkpoint: the stream version replayed into these rows.
    projected_version integer NOT NULL,
    projected_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX episodes_run_group_idx ON episodes (run_id, group_id);

CREATE TABLE samples (
    sample_id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id            text NOT NULL,
    group_id          text NOT NULL,
    episode_id        text NOT NULL REFERENCES episodes ON DELETE CASCADE,
    agent             text NOT NULL,
    kind              text NOT NULL CHECK (kind IN ('positive', 'negative')),
    -- positive: the surviving timeline's recording index; negative: the failed call's.
    timeline_index    integer NOT NULL,
    reward            double precision,
    policy_version    integer,
    prompt_length     integer NOT NULL,
    num_tokens        integer NOT NULL,
    num_trainable     integer NOT NULL,
    num_drifted       integer NOT NULL DEFAULT 0,
    -- little-endian int32 ids, uint8 mask, float32 logprobs, one entry per token
    token_ids         bytea NOT NULL,
    loss_mask         bytea NOT NULL,
    logprobs          bytea NOT NULL,
    -- negatives only: which failure, and when (the per-group cap keeps the earliest)
    failed_at         timestamptz,
    failure_version   integer,
    position_key      text,
    retry_index       integer,
    error_types       text[],
    error_messages    text[],
    status            text NOT NULL DEFAULT 'ready'
                      CHECK (status IN ('ready', 'leased', 'consumed')),
    lease_id          uuid,
    leased_until      timestamptz,
    consumed_version  integer,
    created_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT samples_key UNIQUE (episode_id, kind, timeline_index)
);
ALTER TABLE samples ALTER COLUMN token_ids SET STORAGE EXTERNAL;
ALTER TABLE samples ALTER COLUMN logprobs SET STORAGE EXTERNAL;
CREATE INDEX samples_run_group_idx ON samples (run_id, group_id);
CREATE INDEX samples_ready_idx ON samples (run_id, group_id) WHERE status = 'ready';

CREATE TABLE timeline_forks (
    episode_id     text NOT NULL REFERENCES episodes ON DELETE CASCADE,
    agent          text NOT NULL,
    timeline       integer NOT NULL,
    other          integer NOT NULL,
    message_index  integer NOT NULL,
    reason         text NOT NULL,
    PRIMARY KEY (episode_id, timeline, other)
);

CREATE TABLE failures (
    failure_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id          text NOT NULL,
    group_id        text NOT NULL,
    episode_id      text NOT NULL REFERENCES episodes ON DELETE CASCADE,
    agent           text NOT NULL,
    policy_version  integer,
    -- 'tool': a tool_returned with an error; 'attempt': an attempt_failed (rollback).
    source          text NOT NULL CHECK (source IN ('tool', 'attempt')),
    stream_version  integer NOT NULL,
    tool_name       text,
    error_type      text,
    error_message   text,
    position_key    text,
    retry_index     integer,
    -- whether a later attempt at the same position of the same agent succeeded
    recovered       boolean NOT NULL DEFAULT false,
    occurred_at     timestamptz,
    CONSTRAINT failures_key UNIQUE (episode_id, stream_version)
);
CREATE INDEX failures_run_idx ON failures (run_id, policy_version);

-- Where a subscriber of the log has got to, (tx_id, position) as store.eventlog reads it.
CREATE TABLE projection_checkpoints (
    name        text PRIMARY KEY,
    tx_id       bigint NOT NULL,
    position    bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
"""

DOWNGRADE = r"""
DROP TABLE projection_checkpoints;
DROP TABLE failures;
DROP TABLE timeline_forks;
DROP TABLE samples;
DROP TABLE episodes;
DROP TABLE runs;
DROP INDEX events_finished_idx;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
