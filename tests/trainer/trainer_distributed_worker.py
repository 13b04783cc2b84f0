"""One rank of a distributed trainer for the tests, run under ``torchrun``.

Argument: a JSON object with the database URL, data folder, run id, ``TrainerConfig`` fields
and ``steps``; with ``hold_rank`` that rank writes its pid to ``hold_file`` once it holds the
batch and sleeps (to be SIGKILLed there). Rank 0 prints one JSON line per trained step.
With ``jobs`` (a list of objects holding ``run_id`` and any of ``config``, ``pack``,
``checkpointing``), the one process group trains each job's run in turn, with a trainer of
its own: several setups for the price of one start of the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings
from workers.trainer.config import TrainerConfig
from workers.trainer.distributed import DistributedHooks, DistributedTrainer, exit_rank

torch.set_num_threads(1)
args = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
store = None
if rank == 0:
    store = EventStore(Database(args["url"], max_size=2),
                       Settings(database_url=args["url"], data_dir=args["data_dir"]))


def hold(this_rank: int) -> None:
    if this_rank == args.get("hold_rank"):
        Path(args["hold_file"]).write_text(str(os.getpid()))
        time.sleep(600)


for job in args.get("jobs") or [args]:
    trainer = DistributedTrainer.open(
        store, job["run_id"], config=TrainerConfig(**job.get("config", args.get("config", {}))),
        data_dir=args["data_dir"], pack=job.get("pack", False),
        activation_checkpointing=job.get("checkpointing", False))
    for _ in range(args.get("steps", 1)):
        result = trainer.step(hooks=DistributedHooks(after_batch=hold))
        if rank == 0:
            print(json.dumps({"run_id": job["run_id"], "version": result.version,
                              "samples": list(result.sample_ids),
                              "checkpoint": str(result.checkpoint) if result.checkpoint
                              else None, "metrics": result.metrics}), flush=True)
dist.barrier()
if store is not None:
    store.close()
dist.destroy_process_group()
exit_rank(0)
