"""``trajstore export``: a run's data as a file other tools read (:mod:`api.exports`):
``samples`` and ``verl-prompts`` (Parquet), ``verl-batch`` (safetensors), ``atif`` and
``sft`` (JSON lines). docs/exports.md describes each format."""

from __future__ import annotations

import enum
import os
import secrets
from pathlib import Path
from typing import Annotated, Any

import typer

from store import errors
from store.settings import get_settings

__all__ = ["ExportFormat", "register"]


class ExportFormat(enum.StrEnum):
    samples = "samples"
    verl_prompts = "verl-prompts"
    verl_batch = "verl-batch"
    atif = "atif"
    sft = "sft"


class SampleKind(enum.StrEnum):
    positive = "positive"
    negative = "negative"


class SampleStatus(enum.StrEnum):
    ready = "ready"
    leased = "leased"
    consumed = "consumed"
    stale = "stale"
    skipped = "skipped"
    no_reward = "no_reward"


_FLAGS = {"min_reward": "--min-reward", "group_id": "--group", "kind": "--kind",
          "status": "--status", "data_source": "--data-source",
          "pad_token_id": "--pad-token-id"}


def _ground_truths(tasks_dir: Path) -> Any:
    """Task id → the task's ground truth (None when no built-in task and no task of
    ``tasks_dir`` has that id), as the rollout worker resolves tasks."""
    from workers.rollout.agent_tasks import TaskFormatError, resolve_task

    def lookup(task_id: str) -> Any:
        try:
            return resolve_task(task_id, tasks_dir=tasks_dir).ground_truth
        except TaskFormatError:
            raise
        except ValueError:
            return None

    return lookup


def _write(chunks: Any, output: Path) -> int:
    """Write ``chunks`` to a temporary file beside ``output``, then rename it: a failed
    export leaves no partial file. The file gets the permissions any new file of this
    process gets (0666 less the umask; a temporary file's own 0600 would hide an export
    from the group that reads it)."""
    folder = output.parent if str(output.parent) else Path(".")
    while True:
        tmp = folder / f".{output.name}.{secrets.token_hex(6)}.part"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:  # pragma: no cover - another export drew the same name
            continue
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def export(
    run: Annotated[str, typer.Option("--run", help="Run id.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="File to write.")],
    fmt: Annotated[ExportFormat, typer.Option("--format", help="samples (Parquet, verl "
                                              "columns), verl-prompts (Parquet for verl's "
                                              "RLHFDataset), verl-batch (safetensors), atif "
                                              "(JSONL), sft (JSONL).")] = ExportFormat.samples,
    min_reward: Annotated[float | None, typer.Option(
        "--min-reward", help="atif, sft: only episodes whose reward is at least this.")]
    = None,
    group: Annotated[str | None, typer.Option(
        "--group", help="samples, verl-batch: only this group's samples.")] = None,
    kind: Annotated[SampleKind | None, typer.Option(
        "--kind", help="samples, verl-batch: positive or negative samples only.")] = None,
    status: Annotated[SampleStatus | None, typer.Option(
        "--status", help="samples, verl-batch: samples in this state only.")] = None,
    data_source: Annotated[str | None, typer.Option(
        "--data-source", help="verl-prompts: the data_source column (default: the run "
        "id).")] = None,
    pad_token_id: Annotated[int | None, typer.Option(
        "--pad-token-id", min=0, help="verl-batch: padding token (default: the run "
        "tokenizer's pad token).")] = None,
    tasks_dir: Annotated[Path | None, typer.Option(
        "--tasks-dir", help="verl-prompts: folder of task JSONL files whose ground truths "
        "fill reward_model (default: <data dir>/tasks, as the rollout worker reads).")]
    = None,
) -> None:
    """Export a run's data to a file: its samples, verl's prompt dataset or padded batch,
    ATIF trajectories or SFT chat lines (docs/exports.md)."""
    from api.errors import ApiError
    from api.exports import prepare
    from trajstore.store_access import open_store

    settings = get_settings()
    if not output.parent.is_dir() and str(output.parent):
        raise typer.BadParameter(f"folder {output.parent} does not exist", param_hint="--output")
    if output.is_dir():
        raise typer.BadParameter(f"{output} is a folder", param_hint="--output")
    if tasks_dir is not None and fmt is not ExportFormat.verl_prompts:
        raise typer.BadParameter("only verl-prompts takes it", param_hint="--tasks-dir")
    truths = None
    if fmt is ExportFormat.verl_prompts:
        truths = _ground_truths(tasks_dir or settings.data_dir / "tasks")
    store = open_store(settings)
    try:
        made = prepare(store, run, fmt.value, group_id=group,
                       kind=kind.value if kind else None,
                       status=status.value if status else None, min_reward=min_reward,
                       data_source=data_source, pad_token_id=pad_token_id,
                       rows_per_group=settings.api_export_rows_per_group,
                       ground_truth=truths)
        size = _write(made.chunks, output)
    except ApiError as exc:
        message = exc.message
        for name, flag in _FLAGS.items():  # the API's names as this command's options
            message = message.replace(name, flag)
        option = _FLAGS.get(exc.extra.get("field", ""))
        if exc.status == 422 and option:
            raise typer.BadParameter(message, param_hint=option) from None
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, errors.StoreError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    typer.echo(f"wrote {output} ({fmt.value}, {size} bytes)")


def register(app: typer.Typer) -> None:
    """Add the ``export`` command to ``app``."""
    app.command("export")(export)
