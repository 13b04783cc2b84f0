"""Lineage: which samples each training step trained.

A trainer's ``policy_updated`` carries ``trained``: the ids of the samples the step trained,
their episodes and the rewards they were trained with, and the dataset version they came
from (NULL: the run's own projection). A trigger on ``events`` copies them into
``step_samples`` when the event is inserted, so the rows are written in the transaction that
records the step, or not at all; a step that names a dataset version also gets its
``dataset_trained_by`` row (from then on the version cannot be deleted).

Two indexed questions: what fed step k of run R (``step_samples_step_idx``), and which steps
trained episode e (``step_samples_episode_idx``).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE TABLE step_samples (
    run_id          text NOT NULL,
    -- the policy version the step recorded (unique per run) and its step number
    policy_version  integer NOT NULL,
    step            integer NOT NULL,
    -- the position of the sample in the step's batch
    position        integer NOT NULL,
    -- the projection's sample id (samples.sample_id) when the step trained the run's own
    -- projection; the row index of the dataset version otherwise
    sample_id       bigint NOT NULL,
    episode_id      text NOT NULL,
    reward          double precision NOT NULL,
    dataset_id      bigint REFERENCES datasets ON DELETE RESTRICT,
    -- the policy_updated event (events.position) that recorded the step: every such event
    -- of the log gets its rows, whatever else the log holds
    event_position  bigint NOT NULL,
    PRIMARY KEY (event_position, position)
);
CREATE INDEX step_samples_step_idx ON step_samples (run_id, step, policy_version, position);
CREATE INDEX step_samples_episode_idx
    ON step_samples (episode_id, run_id, policy_version, position);

CREATE FUNCTION step_samples_record() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    trained json := NEW.data->'trained';
    dataset bigint;
BEGIN
    IF trained IS NULL OR json_typeof(trained) <> 'object' OR NEW.run_id IS NULL THEN
        RETURN NULL;
    END IF;
    dataset := (trained->>'dataset_id')::bigint;
    IF dataset IS NOT NULL AND NOT EXISTS (SELECT 1 FROM datasets WHERE dataset_id = dataset)
    THEN
        RAISE EXCEPTION 'policy_updated: trained.dataset_id % names no dataset version',
            dataset;
    END IF;
    INSERT INTO step_samples (run_id, policy_version, step, position, sample_id, episode_id,
                              reward, dataset_id, event_position)
    SELECT NEW.run_id, (NEW.data->>'version')::integer, (NEW.data->>'step')::integer,
           t.n - 1, t.sample_id::bigint, t.episode_id, t.reward::double precision, dataset,
           NEW.position
    FROM ROWS FROM (json_array_elements_text(trained->'sample_ids'),
                    json_array_elements_text(trained->'episode_ids'),
                    json_array_elements_text(trained->'rewards'))
         WITH ORDINALITY AS t(sample_id, episode_id, reward, n);
    IF dataset IS NOT NULL THEN
        INSERT INTO dataset_trained_by (dataset_id, run_id, step)
        VALUES (dataset, NEW.run_id, (NEW.data->>'step')::integer) ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER step_samples_record AFTER INSERT ON events
    FOR EACH ROW WHEN (NEW.type = 'policy_updated')
    EXECUTE FUNCTION step_samples_record();
"""

DOWNGRADE = """
DROP TRIGGER step_samples_record ON events;
DROP FUNCTION step_samples_record();
DROP TABLE step_samples;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
