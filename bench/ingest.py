"""Ingest benchmark: store.append against the raw ceiling of a binary COPY, in one run.

Appends ``episodes`` trajectories of ``turns`` LLM calls each (every prompt extends the
previous call by ``new_prompt`` tokens; ``generated`` tokens with logprobs per call) through
``EventStore.append`` in batches, then copies the very bytes the store wrote (delta-encoded
prompt suffix, response ids, logprobs, JSON data) into a plain table with psycopg's binary
COPY. Prints events/s, MB/s, bytes on disk per event and the ratios; targets: batched append
>= 0.5x the COPY rate, disk for one 30-turn trajectory <= 1.5x its unique-token bytes.

    python bench/ingest.py [--episodes 20 --turns 30 --batch 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

from bench.common import realistic_trajectory, scratch_database  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import EventStore  # noqa: E402
from store.events import EpisodeStarted  # noqa: E402
from store.settings import Settings  # noqa: E402

RAW_TABLE = """
CREATE TABLE raw_events (
    event_id uuid, stream_id text, stream_version int, type text, data jsonb,
    prompt_ids bytea, response_ids bytea, logprobs bytea
);
ALTER TABLE raw_events ALTER COLUMN prompt_ids SET STORAGE EXTERNAL;
ALTER TABLE raw_events ALTER COLUMN response_ids SET STORAGE EXTERNAL;
ALTER TABLE raw_events ALTER COLUMN logprobs SET STORAGE EXTERNAL;
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--new-prompt", type=int, default=2000)
    parser.add_argument("--generated", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=10, help="events per append call")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()

    episodes = [
        realistic_trajectory(args.turns, new_prompt=args.new_prompt, generated=args.generated,
                             seed=i)
        for i in range(args.episodes)
    ]
    n_events = args.episodes * args.turns
    payload_mb = args.episodes * args.turns * (args.new_prompt + 2 * args.generated) * 4 / 1e6
    unique_token_bytes = args.turns * (args.new_prompt + 2 * args.generated) * 4
    text_bytes = sum(
        len(m["content"].encode()) for c in episodes[0] for m in c.messages[-2:]
    ) + sum(len(c.response["content"].encode()) for c in episodes[0])

    print(f"{n_events} llm_called events per round ({args.episodes} trajectories x "
          f"{args.turns} turns, +{args.new_prompt} prompt / {args.generated} generated tokens "
          f"per call), batches of {args.batch}; MB/s counts stored token payload")
    with scratch_database() as url:
        settings = Settings(database_url=url)
        store = EventStore(Database(url, max_size=2), settings)
        conn = psycopg.connect(url)
        conn.execute(RAW_TABLE)
        conn.commit()
        ratios = []
        for rep in range(args.repeats):
            streams = [f"r{rep}-ep-{e}" for e in range(args.episodes)]
            for stream in streams:  # opening events, not timed
                store.append(stream, [EpisodeStarted(run_id="bench", group_id=stream)])
            fresh = [[c.model_copy(update={"event_id": uuid.uuid4()}) for c in calls]
                     for calls in episodes]
            t0 = time.perf_counter()
            for stream, calls in zip(streams, fresh, strict=True):
                for i in range(0, len(calls), args.batch):
                    store.append(stream, calls[i : i + args.batch])
            store_s = time.perf_counter() - t0

            rows = conn.execute(
                "SELECT event_id, stream_id, stream_version, type, data, prompt_ids,"
                " response_ids, logprobs FROM events WHERE type = 'llm_called'"
                " AND stream_id LIKE %s ORDER BY position",
                (f"r{rep}-%",),
            ).fetchall()
            conn.commit()
            rows = [(uuid.uuid4(), *r[1:4], Jsonb(r[4]), *r[5:]) for r in rows]
            t0 = time.perf_counter()
            with conn.cursor() as cur, cur.copy(
                "COPY raw_events FROM STDIN (FORMAT BINARY)"
            ) as copy:
                copy.set_types(["uuid", "text", "int4", "text", "jsonb", "bytea", "bytea",
                                "bytea"])
                for r in rows:
                    copy.write_row(r)
            conn.commit()
            raw_s = time.perf_counter() - t0
            store_rate, raw_rate = n_events / store_s, n_events / raw_s
            ratios.append(store_rate / raw_rate)
            print(f"  round {rep + 1}: store.append {store_rate:7.1f} events/s "
                  f"({payload_mb / store_s:5.1f} MB/s) | raw binary COPY {raw_rate:7.1f} "
                  f"events/s ({payload_mb / raw_s:5.1f} MB/s) | ratio {ratios[-1]:.2f}")

        n_all = n_events * args.repeats
        events_size = conn.execute("SELECT pg_total_relation_size('events')").fetchone()[0]
        raw_size = conn.execute("SELECT pg_total_relation_size('raw_events')").fetchone()[0]
        one = conn.execute(
            "SELECT sum(pg_column_size(e.*)) FROM events e WHERE stream_id = 'r0-ep-0'"
            " AND type = 'llm_called'"
        ).fetchone()[0]
        conn.close()
        store.close()

    print(f"  median ratio append/COPY = {statistics.median(ratios):.2f}  (target >= 0.5)")
    print(f"  disk per event: events {events_size / n_all:,.0f} B (table + TOAST + indexes), "
          f"raw table {raw_size / n_all:,.0f} B")
    print(f"  one {args.turns}-turn trajectory: {one:,} B stored vs {unique_token_bytes:,} B of "
          f"unique tokens + logprobs: ratio {one / unique_token_bytes:.2f} (target <= 1.5); "
          f"its message text adds {text_bytes:,} B before compression")
    full = sum(len(c.prompt_ids) for c in episodes[0]) * 4
    print(f"  (full prompts stored without delta encoding would be {full:,} B of prompt ids "
          f"alone: {full / unique_token_bytes:.1f}x)")


if __name__ == "__main__":
    main()
