"""Long-lived objects frozen out of the garbage collector's full collections (``store.heap``).

Each case runs in a fresh interpreter: a freeze is for the whole process, and the test
process's own objects are not the subject."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import heap
from store.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_a_process_that_did_not_install_freezes_nothing() -> None:
    """A library user's own process: loading a tokenizer leaves its collector as it was."""
    out = _run("""
        import gc
        from workers.engines.tokenizers import load_tokenizer
        load_tokenizer("tiny")
        print(gc.get_freeze_count())
    """)
    assert out == "0"


def test_a_tokenizer_loaded_is_frozen_and_one_dropped_is_reclaimed() -> None:
    out = _run("""
        import gc, weakref
        from store import heap
        from workers.engines import tokenizers
        heap.install(0)
        tokenizer = tokenizers.load_tokenizer("tiny")
        frozen = gc.get_freeze_count()
        assert frozen > 0, frozen
        # A cyclic object that only a dropped cache entry held: frozen with the rest, then
        # reclaimed when the cache drops an entry (release: unfreeze, collect, freeze).
        class Node:
            pass
        node = Node(); node.me = node
        alive = weakref.ref(node)
        heap.freeze()
        del node
        gc.collect()
        assert alive() is not None  # frozen: the collector does not look at it
        tokenizers.configure(cache_size=1)
        tokenizers._cache["other"] = object()
        tokenizers.configure(cache_size=1)  # drops the tiny tokenizer: release()
        print(frozen, alive() is None, gc.get_freeze_count() > 0)
    """)
    frozen, reclaimed, refrozen = out.split()
    assert int(frozen) > 1000 and reclaimed == "True" and refrozen == "True"


def test_a_slow_full_collection_freezes_its_survivors() -> None:
    """With a threshold of a microsecond every full collection is slow: the first freezes
    what survived it, and the next full collection walks none of it."""
    out = _run("""
        import gc
        from store import heap
        keep = [[i] for i in range(200_000)]  # lists: tracked by the collector
        assert gc.get_freeze_count() == 0
        heap.install(0.001)
        gc.collect()
        after_first = gc.get_freeze_count()
        print(after_first >= 200_000, heap.installed_pause_ms())
    """)
    assert out == "True 0.001"
    off = _run("""
        import gc
        from store import heap
        keep = [[i] for i in range(200_000)]  # lists: tracked by the collector
        heap.install(0)
        gc.collect()
        print(gc.get_freeze_count(), heap.installed_pause_ms())
    """)
    assert off == "0 0.0"  # 0: only the named loads freeze


def test_bad_thresholds_are_refused() -> None:
    for bad in (-1, float("nan"), float("inf"), True, "20"):
        with pytest.raises(ValueError, match="pause_ms must be a number of milliseconds"):
            heap.install(bad)  # type: ignore[arg-type]
    for bad_setting in (-1, 60_001):
        with pytest.raises(Exception, match="gc_freeze_after_ms"):
            Settings(gc_freeze_after_ms=bad_setting)


def test_the_served_app_freezes_what_it_holds_once_started(pg_url: str, tmp_path: Path) -> None:
    """``trajstore serve``'s app (``freeze_heap``) freezes after its start; an app built
    in a test or a user's process does not."""
    code = """
        import gc, sys
        from fastapi.testclient import TestClient
        from api.app import create_app
        from store.settings import Settings
        settings = Settings(database_url=sys.argv[1], data_dir=sys.argv[2])
        with TestClient(create_app(settings, freeze_heap=%s)) as client:
            assert client.get("/health").status_code == 200
            print(gc.get_freeze_count())
    """
    for freeze, expect_frozen in (("True", True), ("False", False)):
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code % freeze), pg_url, str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr[-3000:]
        frozen = int(done.stdout.strip().splitlines()[-1])
        assert (frozen > 10_000) is expect_frozen, (freeze, frozen)
