"""deploy/: the files parse, every setting they name exists, every command they run exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml

from store.settings import Settings
from trajstore.cli import app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CLI = typer.main.get_command(app)


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = [("compose.yaml", yaml.safe_load((DEPLOY / "compose.yaml").read_text()))]
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _walk(node: Any, key: str | None = None):
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from _walk(v, k)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, key)


def _settings_named() -> set[str]:
    names: set[str] = set()
    for _, doc in _documents():
        for k, _ in _walk(doc):
            if isinstance(k, str) and k.startswith("TRAJSTORE_"):
                names.add(k)
    names |= set(re.findall(r"\b(TRAJSTORE_[A-Z0-9_]+)=", (DEPLOY / "Dockerfile").read_text()))
    return names


def _commands() -> list[tuple[str, list[str]]]:
    """The argv of every container that runs the trajstore image."""
    found: list[tuple[str, list[str]]] = []
    for name, doc in _documents():
        for k, v in _walk(doc):
            if k in ("services", "containers"):
                items = v.values() if isinstance(v, dict) else v
                for item in items:
                    argv = item.get("command") or item.get("args")
                    if str(item.get("image", "")).startswith("trajstore") and argv:
                        found.append((name, argv))
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("CMD "):
            found.append(("Dockerfile", yaml.safe_load(line[4:])))
    return found


def test_files_parse_and_have_what_the_guide_says() -> None:
    docs = _documents()
    kinds = {(d.get("kind"), d.get("metadata", {}).get("name")) for _, d in docs if "kind" in d}
    assert ("Job", "trajstore-migrate") in kinds
    assert ("Secret", "trajstore") in kinds
    for deployment in ("trajstore-api", "trajstore-replay", "trajstore-rollout",
                       "trajstore-sweep", "trajstore-trainer"):
        assert ("Deployment", deployment) in kinds
    trainer = next(d for _, d in docs if d.get("metadata", {}).get("name") == "trajstore-trainer"
                   and d["kind"] == "Deployment")
    spec = trainer["spec"]["template"]["spec"]
    assert "nvidia.com/gpu.present" in spec["nodeSelector"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    compose = docs[0][1]
    assert set(compose["services"]) >= {"postgres", "redis", "migrate", "api", "replay",
                                        "rollout", "sweep", "trainer"}
    reservation = compose["services"]["trainer"]["deploy"]["resources"]["reservations"]
    assert reservation["devices"][0]["capabilities"] == ["gpu"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM .+ AS cpu$", dockerfile, re.M)
    assert re.search(r"^FROM .+ AS cuda$", dockerfile, re.M)


def test_every_setting_named_exists() -> None:
    fields = {f"TRAJSTORE_{name.upper()}" for name in Settings.model_fields}
    named = _settings_named()
    assert named, "no settings found: the test reads nothing"
    assert not named - fields, f"unknown settings: {sorted(named - fields)}"


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=lambda x: shlex.join(x)
                         if isinstance(x, list) else x)
def test_every_command_exists(where: str, argv: list[str]) -> None:
    ctx = CLI.make_context("trajstore", list(argv), resilient_parsing=False)
    name, command, rest = CLI.resolve_command(ctx, list(argv))
    assert command is not None, f"{where}: no command {argv[0]!r}"
    try:
        command.make_context(name or argv[0], rest, parent=ctx)
    except click.UsageError as exc:  # an option the command does not have
        raise AssertionError(f"{where}: {shlex.join(argv)}: {exc}") from None
