"""Documentation that cannot drift: every command, curl and Python block of the README and
docs/ runs here, as written, against a real ``trajstore serve`` on a database of its own
(one per page), or says (``<!-- illustration: why -->``, ``tests/docs/blocks.py``) why it
cannot and where it is tested instead. The blocks of one page run in order, in one folder, with:

- ``API``: the server's URL; ``KEY``, ``INGEST_KEY``, ``READ_KEY``, ``TRAIN_KEY``: an admin,
  an ingest, a read and a train key of project ``gsm8k``;
- ``TRAJSTORE_DATABASE_URL`` and ``TRAJSTORE_DATA_DIR``: the server's, so the command line
  sees what the server sees;
- ``RUN`` and ``EPISODE``: a run with one replayed episode (Qwen3's chat template, real token
  ids), for pages that show commands on a run.

Shell blocks run under ``bash -euo pipefail``; a transcript (``$ command`` and what it prints)
runs each command and compares what it prints. The analytics page's transcripts need its
seeded run: ``tests/analytics/test_docs_analytics.py`` runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from api.keys import KeyStore
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings
from tests.docs.blocks import ROOT, Block, blocks, pages
from tests.servers import ServerProcess, free_port

pytestmark = pytest.mark.timeout(900)

#: Pages whose runnable blocks another module runs (with the fixtures they need).
RUN_ELSEWHERE = {"docs/analytics.md": "tests/analytics/test_docs_analytics.py"}


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.runnable and b.illustration is None]


def test_every_block_runs_or_says_why_not() -> None:
    """Each runnable block is run by this module (or the one ``RUN_ELSEWHERE`` names), or is
    marked as an illustration with a reason of a few words."""
    for page in pages():
        for block in blocks(page):
            if block.illustration is not None:
                assert len(block.illustration.split()) >= 4, \
                    f"{block.id}: say why the block is an illustration"
                assert block.runnable, f"{block.id}: only runnable blocks need the mark"


@dataclass(frozen=True)
class DocEnv:
    env: dict[str, str]
    store: EventStore


@pytest.fixture
def doc_env(migrated_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocEnv]:
    """A page's world: a database and a server of its own (pages may use the same ids)."""
    url = migrated_db
    data = tmp_path_factory.mktemp("docs-data")
    settings = Settings(database_url=url, data_dir=data, api_key_scrypt_n=1024)
    db = Database(url, max_size=4)
    store = EventStore(db, settings)
    keys = KeyStore(db, settings)
    tokens = {role: keys.create(project="gsm8k", role=role).token
              for role in ("admin", "ingest", "read", "train")}
    keys.close()
    run_id, episode = _replayed_run(store)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_DATA_DIR=str(data),
               TRAJSTORE_API_KEY_SCRYPT_N="1024", TRAJSTORE_LOG_LEVEL="WARNING",
               TRAJSTORE_GATEWAY_ENGINE_MODEL="tiny", TRAJSTORE_GATEWAY_MAX_TOKENS="16",
               KEY=tokens["admin"], INGEST_KEY=tokens["ingest"], READ_KEY=tokens["read"],
               TRAIN_KEY=tokens["train"],
               RUN=run_id, EPISODE=episode,
               PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                     env.get("PATH", "")]))
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "trajstore", "serve", "--port", str(port)],
                           port=port, log=data / "serve.log", env=env, timeout_s=300)
    with server:
        env["API"] = server.url
        yield DocEnv(env=env, store=store)
    store.close()


def _replayed_run(store: EventStore) -> tuple[str, str]:
    """A run of project gsm8k with one finished, projected episode (real token ids)."""
    from tests.api.episodes import create_run, episode_events
    from workers.engines.tokenizers import load_tokenizer
    from workers.replay.jobs.project import project_episode

    run_id, episode = f"docs-{uuid.uuid4().hex[:8]}", f"docs-ep-{uuid.uuid4().hex[:8]}"
    create_run(store, run_id, project="gsm8k", group_size=1)
    store.append(episode, episode_events(load_tokenizer("qwen3"), run_id=run_id,
                                         group_id="g0", a=3, b=5, reward=1.0), "no_stream")
    outcome = project_episode(store, episode)
    assert outcome.status == "completed", outcome
    return run_id, episode


def run_block(block: Block, env: dict[str, str], cwd: Path) -> None:
    """Run ``block`` as written (module docstring); fails the test with its output when it
    fails or a transcript prints something else."""
    if block.transcript:
        for command, expected in _transcript(block.code):
            done = subprocess.run(["bash", "-o", "pipefail", "-c", command], env=env,
                                  cwd=cwd, capture_output=True, text=True, timeout=300)
            got = [line.rstrip() for line in (done.stdout + done.stderr).splitlines()]
            assert got == expected, f"{block.id}: $ {command}\n" + "\n".join(got)
        return
    argv = (["bash", "-euo", "pipefail", "-c", block.code] if block.lang in ("bash", "sh")
            else [sys.executable, "-c", block.code])
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (f"{block.id} failed ({done.returncode}):\n{block.code}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n"
                                  f"--- stderr\n{done.stderr[-3000:]}")


def _transcript(code: str) -> list[tuple[str, list[str]]]:
    """A transcript's ``(command, the lines it prints)`` pairs."""
    steps: list[tuple[str, list[str]]] = []
    for line in code.rstrip("\n").splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and not (line == "" and not steps[-1][1]):
            steps[-1][1].append(line.rstrip())
    return [(command, _strip_blank_tail(lines)) for command, lines in steps]


def _strip_blank_tail(lines: list[str]) -> list[str]:
    while lines and not lines[-1]:
        lines.pop()
    return lines


_PAGES = [p for p in pages() if str(p.relative_to(ROOT)) not in RUN_ELSEWHERE
          and _runnable(p)]


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: p.name)
def test_the_blocks_of_a_page_run(page: Path, doc_env: DocEnv,
                                  tmp_path: Path) -> None:
    for block in _runnable(page):
        run_block(block, doc_env.env, tmp_path)
