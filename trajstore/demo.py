"""The main job: rollouts -> events -> replay -> EGPO training -> new policy -> rollouts.

``run_demo`` creates a run (or resumes one), starts real Celery workers (``rollout`` and
``replay`` in one process, ``train`` in another) on the configured servers or the embedded
default, and for every policy version waits until its batch of rollout groups is replayed,
sends one training step and waits for its ``policy_updated``. With ``overlap`` (the default)
the next batch is sent with the training step, so rollouts run while the trainer trains: that
batch is pinned to the policy the step starts from, one version behind the one it trains (the
trainer corrects it with the stored rollout logprobs, ``RunConfig.correction``, and leases
groups at most 2 versions old). Without it every batch is sent once the step it follows is
recorded, pinned to the policy just trained. Pinning, the run's sampling seed
(``RolloutConfig.seed`` = ``--seed``) and row-by-row seeded sampling make a run's numbers a
function of its options: the same seed gives the same table, whatever the timing. The task
is ``calc`` by default: the ``calc-<seed>-<index>`` tool-use questions
(the ``python`` and ``calculator`` tools, EGPO's strict binary ``tool_answer`` reward) played
from the warm-started policy of :mod:`workers.rollout.warmstart`, whose own mistakes give real
tool errors, rollbacks and negative samples; each version's batch is trained in mini-batches
of 8 samples (:data:`CALC_UPDATE`), with a KL term to the warm start
(:data:`CALC_KL_COEF`). ``task="digits"`` plays the older toy task (reward: the
share of digits in the answer, from a random tiny model).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store import queries
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import (
    NegativeConfig,
    PolicyUpdated,
    RollbackConfig,
    RolloutConfig,
    RunConfig,
    RunCreated,
)
from store.settings import Settings
from workers.engines.registry import BACKENDS

__all__ = ["DemoOptions", "VersionRow", "closing_line", "json_summary", "run_demo", "version_rows",
           "write_charts"]

TASK_ID = "digits"
TASKS = ("digits", "calc")
#: Advantage estimators the demo can train with (EGPO with its entropy bonus, or plain GRPO).
ESTIMATORS = ("egpo", "grpo")
#: Largest accepted ``--seed`` and ``--steps`` (task ids and versions stay small).
MAX_SEED = 10_000
MAX_STEPS = 1_000
#: calc's trainer update: mini-batches of this many samples, for this many epochs. A version's
#: 32 episodes (and their negative samples) make 4 to 6 optimizer steps at lr 2e-4; with the
#: whole batch in one step the strict reward rose in some seeds and not others within 12
#: versions, and two epochs were no better than one.
CALC_UPDATE: tuple[int | None, int] = (8, 1)
#: calc starts every ``--seed`` from one warm start, the base model, as an RL run starts from
#: one pretrained checkpoint: per-seed warm starts answered 0-38% right at version 0 (2% on
#: seeds 4 and 9, where 12 versions could not show learning), so the seed picked the base
#: model's quality rather than the run's. ``--seed`` picks the questions, the sampling and
#: the trainer's seed.
CALC_WARM_START_SEED = 0
#: calc's negative samples: every failed call of a group (up to 8), each trained at
#: ``negative_reward`` -0.5 outside its group's statistics (``NegativeConfig.baseline``
#: ``episodes``). With the seed's rule (one per group, inside the group) a group whose episodes
#: all failed lifted them above its negative, and a weak policy learnt to stop calling tools;
#: one negative per group at -2 left seed 0's tool errors rising (37% -> 48%), and every
#: failed call at -1 fed a spiral on seed 5 (more errors, more negatives pushing the call
#: format down, 29% -> 67% tool errors, 3 tool calls in version 10).
CALC_NEGATIVES = NegativeConfig(negative_reward=-0.5, max_negative_samples_per_group=8,
                                baseline="episodes")
#: calc's KL to the warm start (``TrainerConfig.kl_coef``, verl's ``low_var_kl``): without it
#: seed 8 drifted into malformed tool calls after version 7 (tool errors 33% -> 35% over the
#: run, 58% by version 12) and seed 9 rose only +0.094; at 0.05 both kept the promise and so
#: did the eight others. Negative samples at -0.75 instead made seed 8 worse (tool errors
#: +25 points).
CALC_KL_COEF = 0.05


@dataclass(frozen=True)
class DemoOptions:
    steps: int = 12
    group_size: int = 8
    groups_per_step: int = 4
    backend: str = "transformers"
    seed: int = 0
    resume: str | None = None
    lr: float | None = None
    max_tokens: int | None = None
    timeout_s: float = 900.0
    task: str = "calc"
    overlap: bool = True
    estimator: str = "egpo"
    negatives: bool = True
    rollback: bool = True
    mini_batch_size: int | None = None
    ppo_epochs: int | None = None

    @property
    def generation_tokens(self) -> int:
        """``max_tokens``, or the task's default (8 for digits, 96 for calc)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return 96 if self.task == "calc" else 8

    @property
    def learning_rate(self) -> float:
        """``lr``, or the task's default (3e-2 for digits, 2e-4 for calc: at 1e-3 and 5e-4
        the warm-started calc policy drifts into short answers without tool calls)."""
        if self.lr is not None:
            return self.lr
        return 2e-4 if self.task == "calc" else 3e-2

    @property
    def update_shape(self) -> tuple[int | None, int]:
        """The trainer's ``(mini_batch_size, ppo_epochs)``: the options, or the task's
        defaults (digits: the whole batch once; calc: CALC_UPDATE)."""
        mini, epochs = CALC_UPDATE if self.task == "calc" else (None, 1)
        return (self.mini_batch_size if self.mini_batch_size is not None else mini,
                self.ppo_epochs if self.ppo_epochs is not None else epochs)

    def task_id(self, version: int, group: int) -> str:
        """The task id of group ``group`` at policy ``version``."""
        if self.task == "calc":
            return f"calc-{self.seed}-{version * self.groups_per_step + group}"
        return TASK_ID

    def check(self) -> None:
        """Raise ValueError naming the first option out of range (``--task`` not digits or
        calc, ``--seed`` outside 0..MAX_SEED, ``--steps`` outside 1..MAX_STEPS, ...)."""
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"--estimator must be one of {list(ESTIMATORS)}, "
                             f"got {self.estimator!r}")
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {list(TASKS)}, got {self.task!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed must be in 0..{MAX_SEED}, got {self.seed}")
        if self.steps > MAX_STEPS:
            raise ValueError(f"--steps must be <= {MAX_STEPS}, got {self.steps}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        for name in ("steps", "group_size", "groups_per_step", "mini_batch_size", "ppo_epochs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {list(BACKENDS.names())}, "
                             f"got {self.backend!r}")
        if self.backend == "vllm" and not _installed("vllm"):
            # Found here, not minutes later in a rollout worker's log.
            raise ValueError("--backend vllm needs vLLM: pip install -e '.[vllm]' "
                             "(docs/rollout.md)")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class VersionRow:
    """What the live table shows for one policy version (``negatives``: made by replay;
    ``negatives_trained``: leased and acknowledged by a training step)."""

    version: int
    episodes: int = 0
    reward_mean: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    rollbacks: int = 0
    negatives: int = 0
    failures_by_type: dict[str, int] = field(default_factory=dict)
    train: dict[str, float] = field(default_factory=dict)
    negatives_trained: int = 0

    @property
    def tool_error_rate(self) -> float:
        return self.tool_errors / self.tool_calls if self.tool_calls else 0.0


def version_rows(store: EventStore, run_id: str) -> list[VersionRow]:
    """Per policy version of the run: episodes, mean reward, tool errors, rollbacks,
    negatives, failures by error type, and the metrics of the training step that consumed
    that version's samples."""
    failures = queries.failures_by_version(store, run_id)
    trained = queries.negatives_trained_by_version(store, run_id)
    rows = {v.version: VersionRow(v.version, v.episodes, v.reward_mean, v.tool_calls,
                                  v.tool_errors, v.rollbacks, v.negatives,
                                  failures_by_type=failures.get(v.version, {}),
                                  negatives_trained=trained.get(v.version, 0))
            for v in queries.version_summaries(store, run_id)}
    for recorded in store.read_stream(run_stream_id(run_id)):
        event = recorded.event
        if isinstance(event, PolicyUpdated) and event.version - 1 in rows:
            rows[event.version - 1].train = dict(event.metrics)
    return [rows[v] for v in sorted(rows)]


def write_charts(rows: list[VersionRow], directory: Path) -> tuple[Path, Path]:
    """``reward.png`` (mean reward and tool error rate per policy version) and
    ``failures.png`` (failures by error type per version) in ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    versions = [r.version for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(versions, [r.reward_mean for r in rows], marker="o", label="mean reward")
    ax.plot(versions, [r.tool_error_rate for r in rows], marker="s", linestyle="--",
            label="tool error rate")
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean reward / tool error rate")
    ax.set_title("reward and tool errors by policy version")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    reward = directory / "reward.png"
    fig.tight_layout()
    fig.savefig(reward, dpi=120)
    plt.close(fig)

    kinds = sorted({k for r in rows for k in r.failures_by_type})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0] * len(rows)
    for kind in kinds:
        counts = [r.failures_by_type.get(kind, 0) for r in rows]
        ax.bar(versions, counts, bottom=bottom, label=kind)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_xlabel("policy version")
    ax.set_ylabel("failures")
    ax.set_title("failures by error type")
    if kinds:
        ax.legend(fontsize=7)
    failures = directory / "failures.png"
    fig.tight_layout()
    fig.savefig(failures, dpi=120)
    plt.close(fig)
    return reward, failures


@contextmanager
def _workers(settings: Settings, options: DemoOptions, logs: Path) -> Iterator[list[Any]]:
    """The demo's worker processes (rollout + replay, and train), stopped on exit."""
    from trajstore.processes import die_with_parent
    from trajstore.up import child_env

    env = child_env(settings)
    env["TRAJSTORE_ROLLOUT_BACKEND"] = options.backend
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, queues in (("rollout", "rollout,replay"), ("train", "train")):
        log = open(logs / f"{name}.log", "ab")
        procs.append((name, log, subprocess.Popen(
            [sys.executable, "-m", "trajstore", "worker", "--queues", queues],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # They stop when the demo dies, even by SIGKILL.
            preexec_fn=functools.partial(die_with_parent, os.getpid()))))
    try:
        yield procs
    finally:
        import signal

        for _, _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, log, proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


def _negatives(options: DemoOptions) -> NegativeConfig:
    """The run's negative samples: none with ``--no-negatives``; calc's recipe
    (:data:`CALC_NEGATIVES`), or one per group at -1 inside the group for digits."""
    if not options.negatives:
        return NegativeConfig(max_negative_samples_per_group=0)
    if options.task == "calc":
        return CALC_NEGATIVES
    return NegativeConfig(max_negative_samples_per_group=1)


def _create_run(store: EventStore, settings: Settings, options: DemoOptions) -> str:
    from workers.engines.tinymodel import tiny_model_path
    from workers.rollout.warmstart import warm_start_path

    if options.task == "calc":
        model = str(warm_start_path(settings.data_dir, seed=CALC_WARM_START_SEED))
    else:
        model = str(tiny_model_path(settings.data_dir, seed=options.seed))
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    config = RunConfig(group_size=options.group_size, model=model, tokenizer=model,
                       rollout=RolloutConfig(max_tokens=options.generation_tokens,
                                             max_turns=3 if options.task == "calc" else 2,
                                             seed=options.seed),
                       rollback=RollbackConfig(enable_tool_rollback=options.rollback),
                       negatives=_negatives(options))
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project="demo",
                                                     config=config)], NO_STREAM)
    return run_id


def run_demo(
    store: EventStore,
    settings: Settings,
    options: DemoOptions,
    *,
    on_version: Callable[[list[VersionRow]], None] | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> tuple[str, list[VersionRow]]:
    """Run the loop (module docstring) for ``options.steps`` more policy versions (a resumed
    run continues from its newest version, as ``trajstore train --steps`` counts steps, with
    the task family it was created with).
    Returns the run id and the per-version rows. Raises ValueError for bad options or an
    unknown ``resume`` run, and RuntimeError naming the worker log when a worker dies or
    nothing happens for ``timeout_s``."""
    from workers.app import ensure_configured

    options.check()
    if options.resume:
        run = store.get_run(options.resume)  # NotFoundError (a LookupError) when unknown
        run_id = options.resume
        # A resumed run keeps the task family it was created with (its model tells).
        from workers.rollout.warmstart import is_warm_start

        task = "calc" if is_warm_start(run.config.model) else "digits"
        options = dataclasses.replace(options, task=task)
    else:
        run_id = _create_run(store, settings, options)
    app = ensure_configured()
    record = queries.run_record(store, run_id)
    project = str((record or {}).get("data", {}).get("project") or "default")
    leasing_version = _policy_version(store, run_id)
    mini_batch_size, ppo_epochs = options.update_shape
    train_config = {"lr": options.learning_rate, "groups_per_step": options.groups_per_step,
                    "micro_batch_size": 16, "seed": options.seed,
                    "advantage_estimator": options.estimator,
                    "mini_batch_size": mini_batch_size, "ppo_epochs": ppo_epochs}
    if options.task == "calc":
        train_config["kl_coef"] = CALC_KL_COEF
    if options.overlap:
        # The batch played while version v trains comes from version v (or v + 1 when the
        # step ends first) and is trained at v + 1; an older leftover group is 2 behind.
        train_config["max_staleness"] = 2
    logs = settings.data_dir / "demo" / run_id / "logs"
    want = options.groups_per_step * options.group_size
    with _workers(settings, options, logs) as procs:
        version = leasing_version
        target = leasing_version + options.steps
        done_before = queries.episodes_done(store, run_id)
        sent = 1
        _send_batch(settings, project, options, run_id, version, policy=version)
        while version < target:
            _wait(lambda: queries.episodes_done(store, run_id) - done_before, sent * want,
                  procs, logs, options.timeout_s, on_progress, f"rollouts v{version}")
            app.send_task("trajstore.train_step", args=[run_id, train_config], queue="train")
            if options.overlap and version + 1 < target:
                # Overlap: the next batch rolls out while this step trains, on the policy
                # that the step started from (pinned, so timing never decides which).
                _send_batch(settings, project, options, run_id, version + 1, policy=version)
                sent += 1
            _wait(lambda: _policy_version(store, run_id), version + 1, procs, logs,
                  options.timeout_s, on_progress, f"training v{version}")
            version = _policy_version(store, run_id)
            if not options.overlap and version < target:
                _send_batch(settings, project, options, run_id, version, policy=version)
                sent += 1
            if on_version is not None:
                on_version(version_rows(store, run_id))
    return run_id, version_rows(store, run_id)


def _send_batch(settings: Settings, project: str, options: DemoOptions, run_id: str,
                index: int, *, policy: int) -> None:
    """Queue the rollout groups of batch ``index`` (the batch trained as version index+1),
    played at policy version ``policy``, within the run's project's rollout budget
    (``workers.rollout.fair``: on shared rollout workers the demo's groups take no more
    places than any project's). Group indexes run on across batches: with overlap two
    batches are played at the same policy version, and a group's id is made of its run,
    task, version and index. Raises ``RolloutBudgetExceeded`` naming the setting when the
    project has ``rollout_project_queued`` tasks queued or running already, ConnectionError
    naming the broker when it cannot be reached."""
    from workers.rollout.fair import send_budgeted

    for g in range(options.groups_per_step):
        send_budgeted(settings, project, "trajstore.rollout_group",
                      args=[run_id, options.task_id(index, g)],
                      kwargs={"group_index": index * options.groups_per_step + g,
                              "policy_version": policy})


def _policy_version(store: EventStore, run_id: str) -> int:
    from store.leasing import Leasing

    return Leasing(store).current_policy_version(run_id)


def _wait(value: Callable[[], int], target: int, procs: list[Any], logs: Path,
          timeout_s: float, on_progress: Callable[[str, int, int], None] | None,
          what: str) -> None:
    last, changed = -1, time.monotonic()
    while True:
        current = value()
        if on_progress is not None:
            on_progress(what, min(current, target), target)
        if current >= target:
            return
        if current != last:
            last, changed = current, time.monotonic()
        for name, _, proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"the {name} worker exited ({proc.returncode}); "
                                   f"see {logs / (name + '.log')}")
        if time.monotonic() - changed > timeout_s:
            raise RuntimeError(f"no progress on {what} for {timeout_s:g} s; see the worker "
                               f"logs in {logs}")
        time.sleep(0.5)


#: How many versions the closing line averages at each end of a run.
ENDS = 3


def _mean_sd(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary(rows: list[VersionRow]) -> dict[str, float]:
    """The closing line's figures: mean reward and tool error rate of the first and of the
    last :data:`ENDS` versions (each the mean of those versions' means, with their standard
    deviation as the spread; fewer when the run has fewer), and the gain between them."""
    head, tail = rows[:ENDS], rows[-ENDS:]
    reward_first, reward_first_sd = _mean_sd([r.reward_mean for r in head])
    reward_last, reward_last_sd = _mean_sd([r.reward_mean for r in tail])
    errors_first, errors_first_sd = _mean_sd([r.tool_error_rate for r in head])
    errors_last, errors_last_sd = _mean_sd([r.tool_error_rate for r in tail])
    return {"reward_first3": reward_first, "reward_first3_sd": reward_first_sd,
            "reward_last3": reward_last, "reward_last3_sd": reward_last_sd,
            "reward_gain": reward_last - reward_first,
            "tool_error_rate_first3": errors_first,
            "tool_error_rate_first3_sd": errors_first_sd,
            "tool_error_rate_last3": errors_last, "tool_error_rate_last3_sd": errors_last_sd}


def closing_line(run_id: str, rows: list[VersionRow]) -> str:
    """``run <id>: mean reward <first> ± <sd> (versions a-b) -> <last> ± <sd> (versions c-d),
    <gain>; tool error rate <first> ± <sd> -> <last> ± <sd>``."""
    if not rows:
        return f"run {run_id}: no version played"
    s = summary(rows)
    head, tail = rows[:ENDS], rows[-ENDS:]
    return (f"run {run_id}: mean reward {s['reward_first3']:.3f} ± {s['reward_first3_sd']:.3f}"
            f" (versions {head[0].version}-{head[-1].version}) -> {s['reward_last3']:.3f} ± "
            f"{s['reward_last3_sd']:.3f} (versions {tail[0].version}-{tail[-1].version}), "
            f"{s['reward_gain']:+.3f}; tool error rate {s['tool_error_rate_first3']:.1%} ± "
            f"{s['tool_error_rate_first3_sd']:.1%} -> {s['tool_error_rate_last3']:.1%} ± "
            f"{s['tool_error_rate_last3_sd']:.1%}")


def json_summary(run_id: str, rows: list[VersionRow]) -> dict[str, Any]:
    """The demo's closing summary with exactly the keys of ``--json``: run id, versions,
    reward and tool error rate at the first and last version, rollbacks and the negative
    samples a training step consumed over the run, the mean EGPO entropy bonus of the
    training steps (0 without any), the closing line's figures (:func:`summary`), and the
    mean reward and tool error rate of every version (the curves ``bench/learning.py``
    compares)."""
    bonuses = [r.train["egpo_bonus_mean"] for r in rows if "egpo_bonus_mean" in r.train]
    first = rows[0] if rows else VersionRow(0)
    last = rows[-1] if rows else VersionRow(0)
    return {"run_id": run_id, "versions": len(rows),
            "reward_first": first.reward_mean, "reward_last": last.reward_mean,
            "tool_error_rate_first": first.tool_error_rate,
            "tool_error_rate_last": last.tool_error_rate,
            "rollbacks": sum(r.rollbacks for r in rows),
            "negatives_trained": sum(r.negatives_trained for r in rows),
            "egpo_bonus_mean": statistics.mean(bonuses) if bonuses else 0.0,
            **summary(rows),
            "reward_by_version": [r.reward_mean for r in rows],
            "tool_error_rate_by_version": [r.tool_error_rate for r in rows]}
