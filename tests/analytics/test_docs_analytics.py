"""docs/analytics.md's command, transcript and Python blocks, run as written against the
seeded store the page describes (``run-analytics``, ``tests/analytics/conftest.py``); a
transcript's commands must print what the page shows (``tests/docs``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.analytics.conftest import Seeded
from tests.docs.blocks import ROOT, blocks
from tests.docs.test_docs import run_block


def test_the_blocks_of_the_analytics_page_run(seeded: Seeded, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=seeded.url, TRAJSTORE_DATA_DIR=str(tmp_path),
               TRAJSTORE_LOG_LEVEL="WARNING",
               PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                     env.get("PATH", "")]))
    ran = 0
    for block in blocks(ROOT / "docs" / "analytics.md"):
        if block.runnable and block.illustration is None:
            run_block(block, env, tmp_path)
            ran += 1
    assert ran >= 4
