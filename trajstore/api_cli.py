"""``trajstore serve`` and ``trajstore keys …``, registered on the ``trajstore`` command line.

Cheap to import: FastAPI, uvicorn and the store open only inside the commands (``api.keys``,
whose roles are ``--role``'s choices, imports neither).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import typer

from api.keys import ROLES

__all__ = ["register"]

#: The roles a key can have (``api.keys.ROLES``), as the choices of ``--role``.
Role = StrEnum("Role", {name: name for name in ROLES})  # type: ignore[misc]


def serve(
    host: Annotated[str | None, typer.Option(help="Interface (default: settings).")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535,
                                             help="Port (default: settings).")] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Worker processes "
                                                "(default: settings).")] = None,
    replay: Annotated[bool, typer.Option(
        "--replay/--no-replay", help="Replay finished episodes in this process when no "
        "replay worker does (--no-replay: leave it to replay workers, as trajstore up and "
        "the deployment files do).")] = True,
    local: Annotated[bool, typer.Option(
        "--local", help="Local mode (TRAJSTORE_LOCAL_MODE): requests without an API key act "
        "as the admin of TRAJSTORE_LOCAL_PROJECT (default 'local'). Loopback addresses "
        "only.")] = False,
) -> None:
    """Serve the REST API (uvicorn): ingest, queries, batches, the capture gateway, OTLP
    traces, the web page. Alone it also replays the episodes it ingests (one copy of the
    replay follower: a replay worker that leads the log takes precedence); with
    ``--no-replay`` it says at start, and ``/ready`` says, when no process replays. In local
    mode (``--local`` or ``TRAJSTORE_LOCAL_MODE``) an address that is not loopback is
    refused before anything starts, naming it."""
    import os

    import uvicorn

    from store.settings import get_settings
    from trajstore.processes import register
    from trajstore.store_access import open_store

    if local:
        # The app reads its settings in uvicorn's process(es): they learn it from here.
        os.environ["TRAJSTORE_LOCAL_MODE"] = "true"
        get_settings.cache_clear()
    settings = get_settings()
    named = "--host/--port" if host or port else "TRAJSTORE_API_HOST/TRAJSTORE_API_PORT"
    host_named = "--host" if host else "TRAJSTORE_API_HOST"
    host, port = host or settings.api_host, port or settings.api_port
    if settings.local_mode:
        _check_loopback(host, setting=host_named)
        typer.secho(f"LOCAL MODE: requests without an API key act as the admin of project "
                    f"{settings.local_project!r}; listening on {host} only", err=True,
                    fg="yellow")
    # What the app needs answers before the server starts: a wrong setting is one line.
    open_store(settings).close()
    _check_listen(host, port, setting=named)
    register(settings.data_dir, "serve")
    _start_replay(settings) if replay else _say_who_replays(settings)
    uvicorn.run("api.app:app_factory", factory=True, host=host,
                port=port, workers=workers or settings.api_workers,
                log_level=settings.log_level.lower(), proxy_headers=True)


def _start_replay(settings: Any) -> None:
    """Run a copy of the replay follower in this process, projecting episodes here on one
    thread, a replay of each project in turn (``workers.replay.jobs.dispatch.replay_here``).
    When replay cannot run here (its packages are not installed), say so loudly and serve
    anyway."""
    from store.followers import NO_REPLAY

    try:
        from workers.replay.jobs.dispatch import replay_here
        from workers.replay.jobs.project import project_episode  # noqa: F401 - its imports
    except ImportError as exc:
        typer.secho(f"WARNING: this process cannot replay ({exc}): {NO_REPLAY}", err=True,
                    fg="yellow")
        return
    from store.eventlog import EventStore

    replay_here(lambda: EventStore.open(settings), settings)
    typer.echo("replay: finished episodes are replayed in this process unless a replay "
               "worker leads (--no-replay leaves it to the workers)", err=True)


def _say_who_replays(settings: Any) -> None:
    """With ``--no-replay``: whether a replay worker follows the log now; loudly when none."""
    from store.followers import NO_REPLAY, REPLAY_FOLLOWER, leader_present
    from trajstore.store_access import open_store

    store = open_store(settings)
    try:
        present = leader_present(store, REPLAY_FOLLOWER)
    finally:
        store.close()
    if present:
        typer.echo("replay: left to the replay workers (one follows the log)", err=True)
    else:
        typer.secho(f"WARNING: {NO_REPLAY}", err=True, fg="yellow")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or a name that resolves
    only to such addresses (``localhost``); an empty host, ``0.0.0.0``, ``::`` or a name
    that does not resolve is not."""
    import ipaddress
    import socket

    name = host.strip().strip("[]")
    if not name:
        return False
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def _check_loopback(host: str, *, setting: str) -> None:
    """Local mode answers requests without a key: a ``ConfigurationError`` naming
    ``setting`` and the address when ``host`` is not loopback."""
    from store.errors import ConfigurationError

    if not is_loopback(host):
        raise ConfigurationError(setting, f"local mode (TRAJSTORE_LOCAL_MODE / --local) takes "
                                 f"requests without a key, so it serves on loopback only "
                                 f"(127.0.0.1, ::1, localhost), not on {host!r}")


def _check_listen(host: str, port: int, *, setting: str) -> None:
    """Whether the API can listen on ``host:port``; a ``ConfigurationError`` naming
    ``setting`` when the address is taken or not this machine's."""
    import socket

    from store.errors import ConfigurationError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise ConfigurationError(setting, f"cannot listen on {host}:{port}: "
                                 f"{exc.strerror or exc}") from None


def _key_store():  # type: ignore[no-untyped-def]
    from api.keys import KeyStore
    from store.settings import get_settings
    from trajstore.store_access import open_store

    settings = get_settings()
    store = open_store(settings)
    return store, KeyStore(store.db, settings)


def create_key(
    project: Annotated[str, typer.Option(help="Project the key may see.")],
    role: Annotated[Role, typer.Option(help="What the key may do: ingest (record), read "
                                    "(query, export), train (read, lease and acknowledge "
                                    "batches, record policy versions), or admin "
                                    "(everything the others may).")],
    name: Annotated[str | None, typer.Option(help="A note saying what the key is for.")]
    = None,
) -> None:
    """Create an API key; the key is printed once and only its hash is kept."""
    store, keys = _key_store()
    try:
        try:
            new = keys.create(project=project, role=role.value, name=name)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    finally:
        store.close()
    typer.echo(f"key_id:  {new.key.key_id}\nproject: {new.key.project}\nrole:    "
               f"{new.key.role}\nkey (shown once, keep it secret):\n{new.token}")


def list_keys(
    project: Annotated[str | None, typer.Option(help="Only this project's keys.")] = None,
    revoked: Annotated[bool, typer.Option("--revoked", help="Include revoked keys.")]
    = False,
) -> None:
    """List API keys (ids, projects, roles; never secrets)."""
    store, keys = _key_store()
    try:
        found = keys.list(project=project, include_revoked=revoked)
    finally:
        store.close()
    typer.echo(f"{'key_id':<18}{'project':<24}{'role':<8}{'created':<27}{'revoked':<27}name")
    for k in found:
        revoked_at = k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else "-"
        typer.echo(f"{k.key_id:<18}{k.project:<24}{k.role:<8}"
                   f"{k.created_at.isoformat(timespec='seconds'):<27}{revoked_at:<27}"
                   f"{k.name or ''}")


def revoke_key(key_id: Annotated[str, typer.Argument(help="The key id to revoke.")]) -> None:
    """Revoke an API key: it stops working at once, for good."""
    from store import errors

    store, keys = _key_store()
    try:
        key = keys.revoke(key_id)
    except errors.NotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    typer.echo(f"revoked {key.key_id} (project {key.project}, role {key.role})")


def register(app: typer.Typer) -> None:
    """Add ``serve`` and the ``keys`` commands to the ``trajstore`` CLI."""
    app.command("serve")(serve)
    keys = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)
    keys.command("create")(create_key)
    keys.command("list")(list_keys)
    keys.command("revoke")(revoke_key)
    app.add_typer(keys, name="keys")
