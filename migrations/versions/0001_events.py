"""The event log: one append-only table.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


UPGRADE = r"""
CREATE TABLE events (
    -- Global order of appends. An identity value is taken when the row is inserted, not when
    -- its transaction commits, so on its own it is NOT a safe reading cursor: a reader that
    -- takes "position > last seen" skips rows whose transaction commits late. Readers order
    -- by (tx_id, position) and stay below the oldest running transaction instead (see
    -- store.eventlog.read_all).
    position        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The writing transaction. pg_current_xact_id() is the 64-bit, wraparound-free id.
    tx_id           xid8 NOT NULL DEFAULT pg_current_xact_id(),
    event_id        uuid NOT NULL,
    stream_id       text NOT NULL,
    stream_version  integer NOT NULL CHECK (stream_version >= 1),
    type            text NOT NULL,
    schema_version  smallint NOT NULL,
    run_id          text,
    group_id        text,
    agent           text,
    -- json, not jsonb: jsonb reorders object keys, and a chat template renders tool schemas
    -- and messages in the order their keys were sent. Replaying a prompt needs them exact.
    data            json NOT NULL,
    -- Token payloads, little-endian int32 / float32. When prompt_base_version is set,
    -- prompt_ids holds only the suffix: the full prompt is the first prompt_prefix_len
    -- tokens of (prompt + response ids) of the event at prompt_base_version in this stream.
    prompt_ids          bytea,
    prompt_base_version integer,
    prompt_prefix_len   integer,
    prompt_len          integer,
    response_ids        bytea,
    logprobs            bytea,
    occurred_at     timestamptz NOT NULL DEFAULT now(),
    recorded_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    CONSTRAINT events_stream_version_key UNIQUE (stream_id, stream_version),
    CONSTRAINT events_delta_complete CHECK (
        (prompt_base_version IS NULL) = (prompt_prefix_len IS NULL)
        AND (prompt_base_version IS NULL OR prompt_base_version < stream_version)
    )
);

-- Token arrays are high-entropy: pglz saves ~20% of their size but costs ~0.45 ms per event
-- and cuts batched ingest several-fold. EXTERNAL keeps them out of line, uncompressed.
ALTER TABLE events ALTER COLUMN prompt_ids SET STORAGE EXTERNAL;
ALTER TABLE events ALTER COLUMN response_ids SET STORAGE EXTERNAL;
ALTER TABLE events ALTER COLUMN logprobs SET STORAGE EXTERNAL;

-- The reading cursor of read_all.
CREATE INDEX events_tx_position_idx ON events (tx_id, position);
CREATE INDEX events_run_type_idx ON events (run_id, type) WHERE run_id IS NOT NULL;
-- Every index costs each append; this one only serves listing runs.
CREATE INDEX events_runs_idx ON events (position) WHERE type = 'run_created';

-- Events are immutable whatever the client: no UPDATE, DELETE or TRUNCATE.
CREATE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events are immutable: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER events_immutable_rows BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_refuse_change();
CREATE TRIGGER events_immutable_table BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change();
REVOKE UPDATE, DELETE, TRUNCATE ON events FROM PUBLIC;

-- Wake subscribers once per appending statement; NOTIFY is delivered at commit, so a
-- woken reader finds the rows visible.
CREATE FUNCTION events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('trajstore_events', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER events_notify AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_notify();
"""

DOWNGRADE = r"""
DROP TABLE events;
DROP FUNCTION events_notify();
DROP FUNCTION events_refuse_change();
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
