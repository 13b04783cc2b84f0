"""``trajstore train``: the training loop in the foreground, with a progress bar.

Registered on the ``trajstore`` command line by ``trajstore.cli``; torch and transformers are
imported only when the command runs, so other commands stay fast.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the ``train`` and ``replay-step`` commands to ``app``."""
    app.command()(train)
    app.command("replay-step")(replay_step)


def train(
    run: Annotated[str, typer.Option("--run", help="The run to train.")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps (policy updates).")] = 1,
    groups: Annotated[int, typer.Option(min=1, help="Complete groups leased per step.")] = 4,
    lr: Annotated[float, typer.Option(min=0.0, help="AdamW learning rate.")] = 1e-6,
    epochs: Annotated[int, typer.Option(min=1, help="PPO epochs over each batch.")] = 1,
    mini_batch: Annotated[int | None, typer.Option(
        min=1, help="Samples per optimizer step (default: the whole batch).")] = None,
    micro_batch: Annotated[int, typer.Option(
        min=1, help="Samples per forward pass (gradient accumulation).")] = 4,
    max_staleness: Annotated[int | None, typer.Option(
        min=0, help="Skip groups more than this many policy versions old.")] = None,
    estimator: Annotated[str | None, typer.Option(
        help="grpo or egpo (default: egpo when the run's EGPO lambda is above 0).")] = None,
    temperature: Annotated[float | None, typer.Option(
        help="Score every sample at this temperature (default: each at the one it was sampled "
             "at: its episode's recorded sampling temperature, else the run's).")] = None,
    kl_coef: Annotated[float, typer.Option(min=0.0, help="KL to the initial model.")] = 0.0,
    model: Annotated[str | None, typer.Option(
        help="Initial model folder (default: the run's).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda[:n] (default: cuda if "
                                               "available).")] = None,
    wait: Annotated[float, typer.Option(min=0.0, help="Seconds to wait for a ready batch "
                                        "before stopping early.")] = 0.0,
    nproc: Annotated[int, typer.Option(min=1, help="Processes (FSDP2 ranks under torchrun); "
                                       "1 trains in this process.")] = 1,
    dataset: Annotated[str | None, typer.Option(
        "--dataset", help="Train this dataset version (NAME@VERSION, NAME for its latest, or "
        "an id) instead of the run's own projection.")] = None,
    trackers: Annotated[str, typer.Option(
        envvar="TRAJSTORE_TRACKERS", help="Metrics trackers, comma-separated: jsonl, "
        "tensorboard, wandb (written under <data dir>/train/<run>).")] = "jsonl",
) -> None:
    """Train a run in the foreground: lease, update, checkpoint, record, for --steps steps
    (with --dataset: that dataset version's rows instead of the run's own samples)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from store import errors
    from store.settings import get_settings
    from trajstore.store_access import open_store
    from workers.trainer.config import TrainerConfig
    from workers.trainer.loop import StepResult, Trainer
    from workers.trainer.trackers import make_trackers

    console = Console(soft_wrap=True)
    try:
        config = TrainerConfig(groups_per_step=groups, lr=lr, ppo_epochs=epochs,
                               mini_batch_size=mini_batch, micro_batch_size=micro_batch,
                               max_staleness=max_staleness, advantage_estimator=estimator,
                               temperature=temperature, kl_coef=kl_coef, device=device)
    except (TypeError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    settings = get_settings()
    try:
        sinks = make_trackers(trackers, settings.data_dir / "train" / run)
    except (ImportError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--trackers") from None
    if dataset is not None and nproc > 1:
        raise typer.BadParameter("training a dataset version runs in one process",
                                 param_hint="--nproc")
    store = open_store(settings)
    if nproc > 1:
        for sink in sinks:  # the ranks' steps are recorded in policy_updated only
            sink.close()
        try:
            code = _train_distributed(store, run, config, nproc=nproc, steps=steps,
                                      wait=wait, model=model)
        except (errors.NotFoundError, ValueError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from None
        finally:
            store.close()
        raise typer.Exit(code)
    try:
        try:
            trainer = Trainer.open(store, run, config=config, model=model, dataset=dataset)
        except (errors.NotFoundError, errors.ValidationError, ValueError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from None
        with Progress(TextColumn("[bold]train[/bold] {task.fields[run]}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[status]}"), console=console) as progress:
            task = progress.add_task("train", total=steps, run=run, status="")

            def show(result: StepResult) -> None:
                metrics = result.metrics
                for sink in sinks:
                    sink.log(metrics, step=result.step)
                progress.update(task, advance=1, status=(
                    f"v{result.version} samples={result.samples} "
                    f"reward={metrics.get('reward_mean', 0.0):.3f} "
                    f"pg_loss={metrics.get('pg_loss', 0.0):.4f}"))

            done = trainer.train(steps, wait_s=wait, on_step=show)
        if done:
            last = done[-1]
            console.print(f"trained {len(done)} step(s); policy version {last.version}, "
                          f"checkpoint {last.checkpoint}")
        else:
            console.print("nothing to train: no complete group is ready")
        if len(done) < steps:
            console.print(f"stopped after {len(done)} of {steps} steps: no batch ready"
                          + (f" within {wait:g}s" if wait else ""))
    finally:
        store.close()
        for sink in sinks:
            sink.close()


def replay_step(
    run: Annotated[str, typer.Argument(help="The run.")],
    step: Annotated[int, typer.Option("--step", min=0,
                                      help="The step number its policy_updated recorded.")],
    version: Annotated[int | None, typer.Option(
        "--version", min=0, help="The policy version, when two trainers recorded the step.")
    ] = None,
    tolerance: Annotated[float, typer.Option(
        min=0.0, help="Largest absolute weight difference accepted.")] = 0.0,
    device: Annotated[str, typer.Option(help="Where to recompute (cpu is deterministic).")
                      ] = "cpu",
    model: Annotated[str | None, typer.Option(
        "--model", help="Initial model folder for a first step (and the KL reference) instead "
        "of the one the step's checkpoint recorded.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Recompute step K of RUN from the log (the samples it trained, the trainer
    configuration and seed it ran with) and the checkpoint before it, and compare the
    weights with the step's stored checkpoint. Exits 1 when they differ by more than
    --tolerance, naming the largest difference; 1 with an error naming an unknown run or
    step, a missing checkpoint or a missing initial model folder."""
    import json

    from store import errors
    from trajstore.store_access import open_store
    from workers.trainer.replay import replay_step as replay

    store = open_store()
    try:
        result = replay(store, run, step, version=version, device=device, model=model)
    except (errors.StoreError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    same = result.within(tolerance)
    if as_json:
        typer.echo(json.dumps({
            "run_id": result.run_id, "step": result.step,
            "policy_version": result.policy_version, "started_from": result.started_from,
            "checkpoint": result.checkpoint, "samples": result.samples,
            "dataset_id": result.dataset_id, "initial_model": result.initial_model,
            "initial_from": result.initial_from, "max_abs_diff": result.max_abs_diff,
            "worst_tensor": result.worst_tensor, "tensors": result.tensors,
            "missing": result.missing, "tolerance": tolerance, "identical": same}))
    else:
        typer.echo(f"step {result.step} of run {result.run_id} (policy version "
                   f"{result.policy_version}): {result.samples} samples from "
                   + ("the run's projection" if result.dataset_id is None
                      else f"dataset version {result.dataset_id}")
                   + f", started from {result.started_from}")
        if result.initial_model is not None:
            typer.echo(f"initial model {result.initial_model} (" + {
                "override": "given with --model", "recorded": "recorded by the trainer",
                "run": "the run's; the checkpoint records none"}[str(result.initial_from)]
                + ")")
        typer.echo(f"{result.tensors} tensors compared with {result.checkpoint}: "
                   f"max abs diff {result.max_abs_diff!r}"
                   + (f" (in {result.worst_tensor})" if result.worst_tensor else ""))
        if result.missing:
            typer.echo(f"tensors the replay does not have: {', '.join(result.missing)}")
        typer.echo("identical" if result.max_abs_diff == 0.0 and not result.missing
                   else ("within" if same else "beyond") + f" tolerance {tolerance!r}")
    if not same:
        raise typer.Exit(1)


def _train_distributed(store: Any, run: str, config: Any, *, nproc: int, steps: int,
                       wait: float, model: str | None) -> int:
    """Check the setup here (before any lease), then start ``nproc`` ranks with torchrun and
    return its exit status."""
    import json
    import subprocess
    import sys

    from trajstore.launch import child_environment
    from workers.trainer.distributed import check_setup

    found = store.get_run(run)
    initial = model or found.config.model
    if initial is None:
        raise ValueError(f"run {run!r} names no model (RunConfig.model); pass --model")
    check_setup(found.config, config, world_size=nproc, model=initial,
                data_dir=store.settings.data_dir, run_id=run)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "workers.trainer.distributed",
               json.dumps({"run": run, "steps": steps, "wait": wait, "model": model,
                           "config": config.to_dict()})]
    return subprocess.call(command, env=child_environment())
