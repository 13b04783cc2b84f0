"""deploy/: the files parse, every setting they name exists, every command they run exists, and
only the one-shot steps (migrations, the app role) connect as the owner of the tables: every
service connects as the app role, with the password the app-role step sets."""

from __future__ import annotations

import re
import shlex
import urllib.parse
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
            if k in ("services", "containers", "initContainers"):
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


APP_ROLE = "trajstore_app"
OWNER = "trajstore"  # POSTGRES_USER of the compose file, the owner in the k8s Secret
ONE_SHOT = {"migrate", "app-role"}


def _user(url: str) -> str:
    return urllib.parse.urlsplit(url).username or ""


def _password(url: str) -> str:
    return urllib.parse.urlsplit(url).password or ""


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_services_connect_as_the_app_role_and_only_one_shots_as_the_owner() -> None:
    services = _compose()["services"]
    assert services["postgres"]["environment"]["POSTGRES_USER"] == OWNER
    ours = {name: svc for name, svc in services.items()
            if str(svc.get("image", "")).startswith("trajstore")}
    assert ONE_SHOT <= set(ours) and len(ours) > len(ONE_SHOT)
    for name, svc in ours.items():
        url = svc["environment"]["TRAJSTORE_DATABASE_URL"]
        if name in ONE_SHOT:
            assert _user(url) == OWNER, name
            assert svc.get("restart") == "no", name
        else:
            assert _user(url) == APP_ROLE, (name, url)
            assert "${APP_DB_PASSWORD" in _password(url), (name, url)
            # Nothing starts before the role exists with its grants.
            assert svc["depends_on"]["app-role"] == {
                "condition": "service_completed_successfully"}, name
    role = ours["app-role"]
    assert role["command"] == ["app-role", "--role", APP_ROLE, "--password-env",
                               "APP_DB_PASSWORD"]
    # The password the step sets is the one the services' URL holds (same variable, default).
    app_password = _password(ours["api"]["environment"]["TRAJSTORE_DATABASE_URL"])
    assert role["environment"]["APP_DB_PASSWORD"] == app_password
    assert role["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert ours["migrate"]["command"] == ["migrate"]


def _k8s() -> list[dict[str, Any]]:
    return [d for name, d in _documents() if name != "compose.yaml"]


def _secret_refs(pod_spec: dict[str, Any]) -> dict[str, set[str]]:
    """Container name -> the Secrets its environment comes from."""
    out: dict[str, set[str]] = {}
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        out[c["name"]] = {e["secretRef"]["name"] for e in c.get("envFrom", [])
                          if "secretRef" in e}
        out[c["name"]] |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                           if "secretKeyRef" in e.get("valueFrom", {})}
    return out


def test_k8s_deployments_use_the_app_role_and_the_job_the_owner() -> None:
    docs = _k8s()
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    app_url = secrets["trajstore"]["TRAJSTORE_DATABASE_URL"]
    owner = secrets["trajstore-owner"]
    assert _user(app_url) == APP_ROLE and _user(owner["TRAJSTORE_DATABASE_URL"]) == OWNER
    assert _password(app_url) == owner["APP_DB_PASSWORD"]
    assert urllib.parse.urlsplit(app_url).netloc.split("@")[1] == \
        urllib.parse.urlsplit(owner["TRAJSTORE_DATABASE_URL"]).netloc.split("@")[1]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert deployments
    for d in deployments:
        for container, refs in _secret_refs(d["spec"]["template"]["spec"]).items():
            assert refs == {"trajstore"}, (d["metadata"]["name"], container, refs)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    assert [c["args"] for c in spec["initContainers"]] == [["migrate"]]
    assert [c["args"] for c in spec["containers"]] == [
        ["app-role", "--role", APP_ROLE, "--password-env", "APP_DB_PASSWORD"]]
    assert _secret_refs(spec) == {"migrate": {"trajstore-owner"},
                                  "app-role": {"trajstore-owner"}}
