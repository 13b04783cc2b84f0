"""``trajstore dataset``: derive, list, show, compare and delete named, versioned datasets
(:mod:`workers.datasets`; docs/datasets.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from store import errors

__all__ = ["register"]

dataset_app = typer.Typer(name="dataset", no_args_is_help=True, rich_markup_mode=None,
                          help="Named, versioned datasets derived from runs' logs under "
                               "stated rules (docs/datasets.md).")


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def _rules(rules_file: Path | None, options: dict[str, Any]) -> dict[str, Any]:
    """The rules of ``--rules`` (a JSON file) with the options given put over them."""
    rules: dict[str, Any] = {}
    if rules_file is not None:
        try:
            rules = json.loads(rules_file.read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"cannot read JSON rules from {rules_file}: {exc}",
                                     param_hint="--rules") from None
        if not isinstance(rules, dict):
            raise typer.BadParameter("the rules file holds a JSON object",
                                     param_hint="--rules")
    for path, value in options.items():
        if value is None or value == []:
            continue
        part, _, leaf = path.partition(".")
        section = rules.setdefault(part, {}) if leaf else rules
        if not isinstance(section, dict):
            raise typer.BadParameter(f"rules.{part} must be an object", param_hint="--rules")
        section[leaf or part] = value
    return rules


def _summary(v: Any) -> dict[str, Any]:
    return {"name": v.name, "version": v.version, "project": v.project,
            "content_hash": v.content_hash, "rows": v.num_rows, "episodes": v.num_episodes,
            "excluded": v.excluded, "run_ids": v.run_ids, "code_version": v.code_version,
            "rules": v.rules, "created_at": v.created_at.isoformat(),
            "trained_by": [{"run_id": t["run_id"], "step": t["step"]} for t in v.trained_by]}


@dataset_app.command("derive")
def derive(
    name: Annotated[str, typer.Argument(help="Dataset name.")],
    run: Annotated[list[str], typer.Option("--run", help="Run id (repeat for several).")],
    rules_file: Annotated[Path | None, typer.Option(
        "--rules", help="JSON file of rules (docs/datasets.md); the options below go over "
        "it.")] = None,
    reward_function: Annotated[str | None, typer.Option(
        "--reward-function", help="pkg.module:function called with each episode.")] = None,
    reward_source: Annotated[str | None, typer.Option(
        "--reward-source", help="Only recorded rewards of this source.")] = None,
    merge_level: Annotated[str | None, typer.Option(
        "--merge-level", help="text or token (default: the run's).")] = None,
    negatives: Annotated[bool | None, typer.Option(
        "--negatives/--no-negatives", help="Keep negative samples (default: the run's).")]
    = None,
    negative_cap: Annotated[int | None, typer.Option(
        "--negative-cap", help="Negatives per group.")] = None,
    negative_reward: Annotated[float | None, typer.Option(
        "--negative-reward", help="Reward of a negative sample.")] = None,
    last_turn: Annotated[bool, typer.Option(
        "--last-turn", help="Train only each sample's last LLM turn.")] = False,
    agent: Annotated[list[str] | None, typer.Option(
        "--agent", help="Only samples of this agent (repeat).")] = None,
    status: Annotated[list[str] | None, typer.Option(
        "--status", help="Only episodes that finished so (repeat).")] = None,
    task: Annotated[list[str] | None, typer.Option(
        "--task", help="Only episodes of this task (repeat).")] = None,
    min_version: Annotated[int | None, typer.Option(
        "--min-version", help="Lowest policy version.")] = None,
    max_version: Annotated[int | None, typer.Option(
        "--max-version", help="Highest policy version.")] = None,
    error_type: Annotated[list[str] | None, typer.Option(
        "--error-type", help="Only episodes that met this error type (repeat).")] = None,
    advantage: Annotated[bool, typer.Option(
        "--advantage", help="Compute GRPO advantages over each group.")] = False,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Processes.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Derive a version of dataset NAME from the runs' logs under the rules: a new version
    when its content hash is new, else the existing one (nothing written)."""
    from trajstore.store_access import open_store
    from workers.datasets import derive_dataset

    rules = _rules(rules_file, {
        "reward.function": reward_function, "reward.source": reward_source,
        "merge.compare_level": merge_level, "negatives.enabled": negatives,
        "negatives.cap": negative_cap, "negatives.reward": negative_reward,
        "train.turns": "last" if last_turn else None, "train.agents": agent,
        "filters.statuses": status, "filters.tasks": task,
        "filters.min_version": min_version, "filters.max_version": max_version,
        "filters.error_types": error_type,
        "advantage": {"kind": "grpo"} if advantage else None})
    store = open_store()
    try:
        made = derive_dataset(store, name, run, rules, jobs=jobs)
    except (errors.StoreError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    v = made.version
    if as_json:
        typer.echo(json.dumps({**_summary(v), "created": made.created,
                               "from_projection": made.from_projection,
                               "replayed": made.replayed}, sort_keys=True))
        return
    left = ", ".join(f"{k} {n}" for k, n in sorted(made.excluded.items())) or "none"
    typer.echo(f"dataset {v.name} version {v.version} "
               f"({'new' if made.created else 'exists already, nothing written'}): "
               f"{v.num_rows} rows from {v.num_episodes} episodes, sha256 {v.content_hash}; "
               f"episodes left out: {left}; samples of {made.from_projection} episode(s) "
               f"taken from their projection, {made.replayed} replayed")


@dataset_app.command("list")
def list_(
    name: Annotated[str | None, typer.Argument(help="Only this dataset's versions.")] = None,
    project: Annotated[str, typer.Option("--project", help="Project.")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Every version of the project's datasets (of NAME only, when given)."""
    from store.datasets import list_versions
    from trajstore.store_access import open_store

    store = open_store()
    try:
        found = list_versions(store.db, project, name)
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps([_summary(v) for v in found], sort_keys=True))
        return
    if not found:
        typer.echo("no datasets")
    for v in found:
        typer.echo(f"{v.name}@{v.version}  {v.num_rows} rows  {v.num_episodes} episodes  "
                   f"sha256 {v.content_hash[:16]}  {v.created_at:%Y-%m-%d %H:%M}  "
                   f"runs {','.join(v.run_ids)}")


@dataset_app.command("show")
def show(
    ref: Annotated[str, typer.Argument(help="NAME@VERSION (NAME alone: the latest).")],
    project: Annotated[str, typer.Option("--project", help="Project.")] = "default",
) -> None:
    """One version as JSON: rules, runs, code version, content hash, counts."""
    from store.datasets import get_version
    from trajstore.store_access import open_store
    from workers.datasets.compare import parse_ref

    store = open_store()
    try:
        name, version = parse_ref(ref)
        found = get_version(store.db, project, name, version)
    except errors.StoreError as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    if found is None:
        raise _fail(errors.NotFoundError(f"no dataset {ref!r} in project {project!r}"))
    typer.echo(json.dumps(_summary(found), indent=2, sort_keys=True))


@dataset_app.command("diff")
def diff(
    a: Annotated[str, typer.Argument(help="NAME@VERSION")],
    b: Annotated[str, typer.Argument(help="NAME@VERSION")],
    project: Annotated[str, typer.Option("--project", help="Project.")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Compare two versions: rows added, removed, changed; shift of mean rewards and
    advantages, overall and per failure type."""
    from trajstore.store_access import open_store
    from workers.datasets import diff_datasets

    store = open_store()
    try:
        d = diff_datasets(store.db, project, a, b)
    except errors.StoreError as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(d.to_dict(), sort_keys=True))
        return

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:+.4f}"

    typer.echo(f"{a} -> {b}: {len(d.added)} added, {len(d.removed)} removed, "
               f"{len(d.changed)} changed, {d.unchanged} unchanged")
    typer.echo(f"mean reward {fmt(d.reward.a)} -> {fmt(d.reward.b)} (shift "
               f"{fmt(d.reward.shift)})" + ("" if d.advantage is None else
                                            f"; mean advantage shift {fmt(d.advantage.shift)}"))
    for kind, shifts in d.by_failure_type.items():
        r, adv = shifts["reward"], shifts["advantage"]
        assert r is not None
        typer.echo(f"  {kind}: rows {r.rows_a} -> {r.rows_b}, reward shift {fmt(r.shift)}"
                   + ("" if adv is None else f", advantage shift {fmt(adv.shift)}"))


@dataset_app.command("delete")
def delete(
    ref: Annotated[str, typer.Argument(help="NAME@VERSION")],
    project: Annotated[str, typer.Option("--project", help="Project.")] = "default",
) -> None:
    """Delete a version with its rows; refused while a training step that trained it is
    recorded. A version is never changed."""
    from store.datasets import delete_version
    from trajstore.store_access import open_store
    from workers.datasets.compare import parse_ref

    store = open_store()
    try:
        name, version = parse_ref(ref)
        if version is None:
            raise errors.ValidationError("name the version to delete: NAME@VERSION")
        delete_version(store.db, project, name, version)
    except errors.StoreError as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    typer.echo(f"deleted {name}@{version}")


@dataset_app.command("export")
def export(
    ref: Annotated[str, typer.Argument(help="NAME@VERSION (NAME alone: the latest).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="File to write.")],
    fmt: Annotated[str, typer.Option("--format", help="samples (Parquet, verl columns), "
                                     "verl-prompts, verl-batch (safetensors), atif, sft "
                                     "(JSONL): as trajstore export.")] = "samples",
    min_reward: Annotated[float | None, typer.Option(
        "--min-reward", help="atif, sft: only episodes whose reward (the version's) is at "
        "least this.")] = None,
    group: Annotated[str | None, typer.Option(
        "--group", help="samples, verl-batch: only this group's rows.")] = None,
    kind: Annotated[str | None, typer.Option(
        "--kind", help="samples, verl-batch: positive or negative rows only.")] = None,
    data_source: Annotated[str | None, typer.Option(
        "--data-source", help="verl-prompts: the data_source column.")] = None,
    pad_token_id: Annotated[int | None, typer.Option(
        "--pad-token-id", min=0, help="verl-batch: padding token.")] = None,
    project: Annotated[str, typer.Option("--project", help="Project.")] = "default",
) -> None:
    """Export a version in any format of trajstore export: the same bytes as exporting the
    same samples from the run (docs/datasets.md)."""
    from api.errors import ApiError
    from api.exports import prepare_dataset
    from store.datasets import get_version
    from store.settings import get_settings
    from trajstore.export_cli import _write
    from trajstore.store_access import open_store
    from workers.datasets.compare import parse_ref

    if output.is_dir():
        raise typer.BadParameter(f"{output} is a folder", param_hint="--output")
    if not output.parent.is_dir() and str(output.parent):
        raise typer.BadParameter(f"folder {output.parent} does not exist", param_hint="--output")
    settings = get_settings()
    store = open_store(settings)
    try:
        name, version = parse_ref(ref)
        found = get_version(store.db, project, name, version)
        if found is None:
            raise errors.NotFoundError(f"no dataset {ref!r} in project {project!r}")
        made = prepare_dataset(store, found, fmt, group_id=group, kind=kind,
                               min_reward=min_reward, data_source=data_source,
                               pad_token_id=pad_token_id,
                               rows_per_group=settings.api_export_rows_per_group)
        size = _write(made.chunks, output)
    except ApiError as exc:
        raise _fail(ValueError(exc.message)) from None
    except (errors.StoreError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    typer.echo(f"wrote {output} ({fmt}, {size} bytes)")


def register(app: typer.Typer) -> None:
    """Add the ``dataset`` commands to ``app``."""
    app.add_typer(dataset_app)
