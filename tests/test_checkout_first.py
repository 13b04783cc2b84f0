"""A test session runs the code of the checkout it was started from, whatever is installed
(an editable install of another clone) or on ``PYTHONPATH``, in its own process and in every
process a test starts (servers, workers, ranks): ``tests/conftest.py`` puts the checkout first.

The proof: a second checkout of this tree, whose packages carry a mark the first one lacks,
runs a small test session of its own from another working folder, with the first checkout
first on ``PYTHONPATH`` (as a developer's shell or an outer test session has it), and its
tests find the mark in this process and in a process they start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "store", "trajstore", "workers")

PROBE = '''
import os
import subprocess
import sys

import api
import store
import trajstore
import workers

MARK = os.environ["TRAJSTORE_TEST_CHECKOUT_MARK"]
MODULES = (api, store, trajstore, workers)


def test_the_session_imports_this_checkout():
    for module in MODULES:
        assert getattr(module, "CHECKOUT_MARK", None) == MARK, module.__file__


def test_a_process_it_starts_imports_this_checkout(tmp_path):
    code = ("import api, store, trajstore, workers; "
            "print(*(getattr(m, 'CHECKOUT_MARK', m.__file__) "
            "for m in (api, store, trajstore, workers)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [MARK] * len(MODULES), out
'''


def _copy_checkout(destination: Path) -> None:
    """The files git knows in this checkout (tracked, and new ones it does not ignore), with
    their working-tree contents, copied under ``destination``."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"this checkout is no git work tree ({exc}), so it cannot be cloned")
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def test_a_second_checkout_runs_its_own_code(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    _copy_checkout(clone)
    mark = uuid.uuid4().hex
    for package in PACKAGES:
        with open(clone / package / "__init__.py", "a") as f:
            f.write(f"\nCHECKOUT_MARK = {mark!r}\n")
    (clone / "tests" / "test_checkout_probe.py").write_text(PROBE)
    # The first checkout's code is what this process imported, and it carries no mark: a
    # session that ran it would fail the probe.
    import store

    assert not hasattr(store, "CHECKOUT_MARK")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, TRAJSTORE_TEST_CHECKOUT_MARK=mark,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(clone / "tests" / "test_checkout_probe.py")],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "2 passed" in done.stdout, done.stdout[-4000:]
