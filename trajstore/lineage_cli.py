"""``trajstore lineage``: what fed a training step, which steps trained an episode
(:mod:`store.lineage`; docs/datasets.md, Lineage)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from store import errors

__all__ = ["register"]

lineage_app = typer.Typer(name="lineage", no_args_is_help=True, rich_markup_mode=None,
                          help="Which samples each training step trained (docs/datasets.md).")


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def _source(dataset_id: int | None) -> str:
    return "the run's projection" if dataset_id is None else f"dataset version {dataset_id}"


@lineage_app.command("step")
def step(
    run: Annotated[str, typer.Argument(help="Run id.")],
    step_number: Annotated[int, typer.Option("--step", min=0,
                                             help="The step number policy_updated recorded.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What fed step K of RUN: the samples it trained (ids, episodes, rewards), in batch
    order. Exits 1 naming the run or the step when there is none."""
    from store.lineage import step_lineage
    from trajstore.store_access import open_store

    store = open_store()
    try:
        versions = step_lineage(store.db, run, step_number)
    except (errors.StoreError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    if as_json:
        out: dict[str, Any] = {"run_id": run, "step": step_number, "versions": [
            {"policy_version": v.policy_version, "dataset_id": v.dataset_id,
             "samples": [{"position": s.position, "sample_id": s.sample_id,
                          "episode_id": s.episode_id, "reward": s.reward} for s in v.samples]}
            for v in versions]}
        typer.echo(json.dumps(out, sort_keys=True))
        return
    for v in versions:
        typer.echo(f"step {step_number} of run {run}: policy version {v.policy_version}, "
                   f"{len(v.samples)} samples of {len(v.episode_ids)} episodes from "
                   f"{_source(v.dataset_id)}")
        for s in v.samples:
            typer.echo(f"  sample {s.sample_id}  episode {s.episode_id}  reward {s.reward:g}")


@lineage_app.command("episode")
def episode(
    episode_id: Annotated[str, typer.Argument(help="Episode id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Which training steps trained samples of EPISODE. Exits 1 naming the episode when
    there is none."""
    from store.lineage import episode_lineage
    from trajstore.store_access import open_store

    store = open_store()
    try:
        steps = episode_lineage(store.db, episode_id)
    except (errors.StoreError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps({"episode_id": episode_id, "steps": [
            {"run_id": s.run_id, "step": s.step, "policy_version": s.policy_version,
             "dataset_id": s.dataset_id, "sample_ids": list(s.sample_ids),
             "rewards": list(s.rewards)} for s in steps]}, sort_keys=True))
        return
    if not steps:
        typer.echo(f"no step trained episode {episode_id} yet")
    for s in steps:
        typer.echo(f"run {s.run_id} step {s.step} (policy version {s.policy_version}) trained "
                   f"samples {', '.join(map(str, s.sample_ids))} from {_source(s.dataset_id)}")


def register(app: typer.Typer) -> None:
    """Add the ``lineage`` commands to ``app``."""
    app.add_typer(lineage_app)
