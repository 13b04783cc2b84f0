"""trajstore installs top-level packages with common names (``store``, ``workers``, ``api``,
``migrations``). A user whose working folder holds packages of those names still gets a
working command line, and processes it starts run trajstore's code; one on ``PYTHONPATH`` is
refused with its folder named (``trajstore.launch``).

The commands run are the installed ``trajstore`` console script and ``python -m trajstore``,
in a folder whose own ``store``, ``api``, ``workers`` and ``migrations`` packages fail loudly
when imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trajstore.launch import CODE_ROOT, OWN_PACKAGES, child_environment

SHADOWS = ("store", "api", "workers", "migrations")


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    """A project folder with packages named like trajstore's, each raising when imported."""
    folder = tmp_path / "project"
    for name in SHADOWS:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise RuntimeError('the working folder\\'s own {name} package was imported')\n")
    return folder


def _console_script() -> str:
    script = Path(sys.executable).parent / "trajstore"
    if not script.exists():
        pytest.fail(f"no 'trajstore' console script beside {sys.executable}: install the "
                    "project (pip install -e .) to run this test")
    return str(script)


def _env(database_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=database_url, TRAJSTORE_DATA_DIR=str(data_dir), **extra)
    return env


def _run(command: list[str], folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("launcher", ["console script", "python -m trajstore"])
def test_the_command_line_ignores_the_working_folders_packages(
        launcher: str, user_folder: Path, fresh_db: str, tmp_path: Path) -> None:
    command = [_console_script()] if launcher == "console script" else \
        [sys.executable, "-m", "trajstore"]
    env = _env(fresh_db, tmp_path / "data")
    version = _run([*command, "--version"], user_folder, env)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("trajstore "), version.stdout
    # migrate imports store and migrations (Alembic's scripts are found through it); status
    # reads the migrated database back through store.
    for args, expected in ((["migrate"], "database at revision"),
                           (["status"], "database: ")):
        done = _run([*command, *args], user_folder, env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert expected in done.stdout, done.stdout
        assert "own" not in done.stderr, done.stderr


def test_the_processes_it_starts_ignore_the_working_folders_packages(
        user_folder: Path) -> None:
    """``child_environment`` is how trajstore starts workers, ``up``'s children and
    torchrun's ranks: ``python -c`` and ``python -m`` there find trajstore's packages, where
    the plain environment finds the working folder's."""
    code = "import store, api, workers, migrations; print(store.__file__)"
    plain = subprocess.run([sys.executable, "-c", code], cwd=user_folder,
                           capture_output=True, text=True)
    assert plain.returncode != 0 and "working folder's own" in plain.stderr, plain
    for command in ([sys.executable, "-c", code],
                    [sys.executable, "-m", "store.migrate"]):
        done = subprocess.run(command, cwd=user_folder, env=child_environment(),
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    found = subprocess.run([sys.executable, "-c", code], cwd=user_folder,
                           env=child_environment(), capture_output=True, text=True)
    assert Path(found.stdout.strip()).resolve() == CODE_ROOT / "store" / "__init__.py"


def test_a_package_on_pythonpath_that_shadows_trajstores_is_named(
        user_folder: Path, tmp_path: Path) -> None:
    """A user's ``PYTHONPATH`` comes before installed packages, so there the command stops
    with a message naming the folder instead of failing on a missing name."""
    env = _env("postgresql://unused", tmp_path / "data", PYTHONPATH=os.pathsep.join(
        [str(user_folder), os.environ.get("PYTHONPATH", "")]))
    done = _run([_console_script(), "status"], tmp_path, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the package 'store' is {user_folder / 'store'}" in done.stderr, done.stderr
    assert str(CODE_ROOT) in done.stderr
    assert set(SHADOWS) == set(OWN_PACKAGES)
