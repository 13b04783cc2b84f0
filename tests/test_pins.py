"""The pinned test environment holds together: every ``pip install`` of the README's two
commands installs with ``constraints.txt``, ``.ci/run`` finds the test command it runs, and
every pin satisfies the bounds ``pyproject.toml`` sets (a bound added for a known
incompatibility, such as pytest's, fails here before any install does)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^# [12]\. .*\n(.+)$", text, flags=re.MULTILINE)


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_both_readme_commands_install_the_pinned_versions() -> None:
    commands = _quickstart_commands()
    assert len(commands) == 2, commands
    for command in commands:
        installs = re.findall(r"pip install [^&]*", command)
        assert installs, command
        for install in installs:
            assert "-c constraints.txt" in install, install


def test_ci_runs_the_readme_test_command() -> None:
    found = subprocess.run(["sed", "-n", r"/^# 2\. /{n;p;q;}", str(ROOT / "README.md")],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == _quickstart_commands()[1]
    assert "sed -n '/^# 2\\. /{n;p;q;}' README.md" in (ROOT / ".ci" / "run").read_text()


def test_every_pin_satisfies_the_projects_bounds() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        requirements += [Requirement(r) for r in extra if not r.startswith("trajstore")]
    pins = _pins()
    assert pins[canonicalize_name("pytest")] < Version("9.2")
    unpinned = []
    for requirement in requirements:
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None:
            unpinned.append(requirement.name)
            continue
        assert requirement.specifier.contains(pinned, prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pinned}, outside pyproject's "
            f"{requirement}")
    assert not unpinned, f"pyproject.toml requires {unpinned}, which constraints.txt omits"
