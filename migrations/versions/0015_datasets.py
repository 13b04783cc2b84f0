"""Named, versioned datasets derived from the log under stated rules.

``datasets``: one row per version of a named dataset of a project: its rules, the runs it
was derived from, the code version that built it and the content hash (sha256) of its rows
with the rules and code version. A name's versions are numbered 1, 2, 3...; a name never
holds the same hash twice, and never gives a number twice (``dataset_names``).
``dataset_rows``: the samples of a version (episode, kind and timeline index as the key;
token ids, mask, rollout logprobs, reward, advantage when computed).
``dataset_trained_by``: the training steps that trained a version (the hook for lineage;
nothing writes it yet).

A version is immutable: the database refuses any UPDATE of both tables and any DELETE of a
row while its version exists; a version is deleted whole, and refused while a training step
references it.

Revision ID: 0015
Revises: 0012
Create Date: 2026-11-29
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE TABLE datasets (
    dataset_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project        text NOT NULL,
    name           text NOT NULL,
    version        integer NOT NULL CHECK (version >= 1),
    content_hash   text NOT NULL CHECK (content_hash ~ '^[0-9a-f]{64}$'),
    rules          jsonb NOT NULL,
    run_ids        text[] NOT NULL,
    code_version   text NOT NULL,
    num_rows       integer NOT NULL,
    num_episodes   integer NOT NULL,
    -- episodes of the runs left out, by reason (filters, no reward, not replayable...)
    excluded       jsonb NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT datasets_version_key UNIQUE (project, name, version),
    CONSTRAINT datasets_hash_key UNIQUE (project, name, content_hash)
);

-- The last version number each name gave: a number is never given twice, even after its
-- version was deleted.
CREATE TABLE dataset_names (
    project        text NOT NULL,
    name           text NOT NULL,
    last_version   integer NOT NULL,
    PRIMARY KEY (project, name)
);

CREATE TABLE dataset_rows (
    dataset_id     bigint NOT NULL REFERENCES datasets ON DELETE CASCADE,
    row_index      integer NOT NULL,
    run_id         text NOT NULL,
    group_id       text NOT NULL,
    episode_id     text NOT NULL,
    agent          text NOT NULL,
    kind           text NOT NULL CHECK (kind IN ('positive', 'negative')),
    timeline_index integer NOT NULL,
    prompt_length  integer NOT NULL,
    num_tokens     integer NOT NULL,
    num_trainable  integer NOT NULL,
    reward         double precision NOT NULL,
    advantage      double precision,
    -- the row's failure type: a negative's first error type; for a positive, the first
    -- error type its episode met (NULL: none)
    failure_type   text,
    error_types    text[],
    -- little-endian int32 ids, uint8 mask, float32 logprobs, one entry per token
    token_ids      bytea NOT NULL,
    loss_mask      bytea NOT NULL,
    logprobs       bytea NOT NULL,
    row_hash       text NOT NULL,
    PRIMARY KEY (dataset_id, row_index),
    CONSTRAINT dataset_rows_key UNIQUE (dataset_id, episode_id, kind, timeline_index)
);
ALTER TABLE dataset_rows ALTER COLUMN token_ids SET STORAGE EXTERNAL;
ALTER TABLE dataset_rows ALTER COLUMN logprobs SET STORAGE EXTERNAL;
CREATE INDEX dataset_rows_episode_idx ON dataset_rows (episode_id);

CREATE TABLE dataset_trained_by (
    dataset_id     bigint NOT NULL REFERENCES datasets ON DELETE RESTRICT,
    run_id         text NOT NULL,
    step           integer NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (dataset_id, run_id, step)
);

CREATE FUNCTION datasets_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        RAISE EXCEPTION 'a dataset version is immutable: % of % refused', TG_OP, TG_TABLE_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF TG_TABLE_NAME = 'dataset_rows'
       AND EXISTS (SELECT 1 FROM datasets d WHERE d.dataset_id = OLD.dataset_id) THEN
        RAISE EXCEPTION 'a dataset version is immutable: its rows are deleted only with it'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF TG_TABLE_NAME = 'datasets'
       AND EXISTS (SELECT 1 FROM dataset_trained_by t WHERE t.dataset_id = OLD.dataset_id) THEN
        RAISE EXCEPTION 'dataset % version % was trained by a recorded step: it cannot be deleted',
            OLD.name, OLD.version USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER datasets_immutable BEFORE UPDATE OR DELETE ON datasets
    FOR EACH ROW EXECUTE FUNCTION datasets_immutable();
CREATE TRIGGER dataset_rows_immutable BEFORE UPDATE OR DELETE ON dataset_rows
    FOR EACH ROW EXECUTE FUNCTION datasets_immutable();
"""

DOWNGRADE = """
DROP TABLE dataset_trained_by;
DROP TABLE dataset_rows;
DROP TABLE datasets;
DROP TABLE dataset_names;
DROP FUNCTION datasets_immutable();
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
