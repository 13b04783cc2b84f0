"""One rank of a distributed trainer for the tests, run under ``torchrun``.

Argument: a JSON object with the database URL, data folder, run id, ``TrainerConfig`` fields
and ``steps``; with ``hold_rank`` that rank writes its pid to ``hold_file`` once it holds the
batch and sleeps (to be SIGKILLed there). Rank 0 prints one JSON line per trained step.
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
trainer = DistributedTrainer.open(store, args["run_id"], config=TrainerConfig(**args["config"]),
                                  data_dir=args["data_dir"], pack=args.get("pack", False),
                                  activation_checkpointing=args.get("checkpointing", False))


def hold(this_rank: int) -> None:
    if this_rank == args.get("hold_rank"):
        Path(args["hold_file"]).write_text(str(os.getpid()))
        time.sleep(600)


for _ in range(args.get("steps", 1)):
    result = trainer.step(hooks=DistributedHooks(after_batch=hold))
    if rank == 0:
        print(json.dumps({"version": result.version, "samples": list(result.sample_ids),
                          "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                          "metrics": result.metrics}), flush=True)
dist.barrier()
if store is not None:
    store.close()
dist.destroy_process_group()
exit_rank(0)
