"""Warm start for the ``calc`` task family: supervised fine-tuning of the tiny Qwen3 model on
transcripts of a scripted solver that makes mistakes at a set rate.

A model from random weights never emits a tool call, so reinforcement learning has nothing to
work with. :func:`solver_transcripts` plays ``calc`` tasks with a scripted solver: each answer
is ``<think>…</think>`` then a ``<tool_call>`` to ``python`` or ``calculator``; with probability
``error_rate`` the first call is wrong in one of the ways real agents fail (malformed JSON,
``SyntaxError`` or ``NameError`` in the code, an unknown tool), followed by the loop's error
feedback and a corrected retry, as the rollout loop's rollback presents it. After the tool
result comes ``<think>…</think>`` and the number. :func:`warm_start_model` fine-tunes the tiny
model on these (loss on the assistant tokens only), so the policy's own samples make real,
recoverable errors at roughly that rate. Every transcript starts with the same system prompt and
tool schemas, so each step encodes that prefix once without gradient and computes only the rest
with it (:func:`_suffix_loss_sum`), and adds ``drills``: the same turns without the prefix, cheap
rows that teach the small model to copy the operands and the tool's result.

:func:`warm_start_path` caches the result under the data directory in
``warm-calc-v<version>-seed<seed>`` with a ``warmstart.json`` holding the SHA-256 of every
file. A folder whose files do not match (a corrupt or half-written cache) is reported with a
warning naming the file, removed and rebuilt; it is never loaded. Building is deterministic
for a seed and recipe. It trains data parallel in two processes of one thread each (each
scores half of every step's rows; the gradients are summed over gloo and both take the same
optimiser step): about 40 seconds on an idle two-core machine, against about 60 in one
process. Where no child process can be started (from a daemonic process, or a script read
from standard input) one process plays both ranks in turn: the same weights, bit for bit.
Once per seed: the folder is cached.

A rank that a signal kills (a spawn aborted on a loaded machine) is not the recipe's fault: the
build starts again from the starting weights in a fresh scratch folder, up to
:data:`SPAWN_ATTEMPTS` times in all, with a warning naming the rank and the signal; the weights
are the same as a clean build's. A rank that raised or exited with a code is a bug and is not
retried.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engines.tinymodel import build_tiny_model
from workers.engines.transformers_lock import LOCK
from workers.rollout.agent_tasks import calc_question, calc_task
from workers.rollout.calculator import evaluate_expression, format_number
from workers.rollout.rollback import format_error_feedback

__all__ = [
    "FOLDER_PREFIX",
    "MISTAKES",
    "SPAWN_ATTEMPTS",
    "WARM_START_VERSION",
    "WarmStartCacheError",
    "WarmStartOptions",
    "is_warm_start",
    "solver_transcripts",
    "verify_warm_start",
    "warm_start_model",
    "warm_start_path",
]

log = logging.getLogger(__name__)

#: Bump when the recipe changes, so that older cached folders are not reused.
WARM_START_VERSION = 3
#: The kinds of mistake the scripted solver makes.
MISTAKES: tuple[str, ...] = ("malformed", "syntax", "name", "unknown_tool")
_MANIFEST = "warmstart.json"
#: How the name of every cached warm-start folder begins.
FOLDER_PREFIX = "warm-calc-"
#: Attempts of a spawned build whose ranks a signal kills (module docstring): two retries.
SPAWN_ATTEMPTS = 3


class WarmStartCacheError(ValueError):
    """A cached warm-start folder is corrupt; the message names the file and the problem."""


@dataclass(frozen=True)
class WarmStartOptions:
    """The recipe: ``transcripts`` solver transcripts with ``error_rate`` first-call
    mistakes, ``steps`` optimiser steps of ``batch_size`` at learning rate ``lr``, data
    parallel over ``processes`` processes of one thread (part of the recipe: the summation
    order, hence the weights, depends on it)."""

    transcripts: int = 1024
    error_rate: float = 0.4
    steps: int = 400
    batch_size: int = 4
    lr: float = 3e-3
    hidden_size: int = 64
    layers: int = 2
    heads: int = 2
    drills: int = 48
    processes: int = 2

    def check(self) -> None:
        """Raise ValueError naming the first field out of range."""
        for name in ("transcripts", "steps", "batch_size", "hidden_size", "layers", "heads",
                     "processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"warm start {name} must be a positive integer, got {value!r}")
        if (isinstance(self.drills, bool) or not isinstance(self.drills, int)
                or self.drills < 0):
            raise ValueError(f"warm start drills must be a non-negative integer, "
                             f"got {self.drills!r}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"warm start error_rate must be in [0, 1], got {self.error_rate!r}")
        if not self.lr > 0:
            raise ValueError(f"warm start lr must be > 0, got {self.lr!r}")


def _call(name: str, arguments: dict[str, Any]) -> str:
    return ("<tool_call>\n" + json.dumps({"name": name, "arguments": arguments})
            + "\n</tool_call>")


def _think(text: str) -> str:
    return f"<think>\n{text}\n</think>\n\n"


def _good_call(rng: random.Random, expression: str) -> str:
    if rng.random() < 0.5:
        return _think("compute it with python") + _call("python",
                                                        {"code": f"print{expression}"})
    return _think("compute it with the calculator") + _call("calculator",
                                                            {"expression": expression})


def _bad_call(kind: str, expression: str) -> tuple[str, str]:
    """A failing first turn of ``kind`` and the text of its tool error."""
    if kind == "malformed":
        text = _think("compute it with python") + (
            '<tool_call>\n{"name": "python", "arguments": {"code": "print' + expression
            + '"}\n</tool_call>')
        return text, "tool call format is wrong: invalid JSON in <tool_call>"
    if kind == "syntax":
        text = _think("compute it with python") + _call("python",
                                                        {"code": f"print{expression[:-1]}"})
        return text, "SyntaxError: '(' was never closed"
    if kind == "name":
        text = _think("compute it with python") + _call("python",
                                                        {"code": "print(result)"})
        return text, "NameError: name 'result' is not defined"
    text = _think("compute it") + _call("calc", {"expression": expression})
    return text, "ToolNotFoundError: no tool named 'calc'"


def solver_transcripts(count: int, *, seed: int = 0, error_rate: float = 0.3
                       ) -> list[list[dict[str, Any]]]:
    """``count`` chat transcripts of the scripted solver on ``calc-<seed>-<i>`` tasks (module
    docstring). Each is a list of messages (system, user, assistant, [feedback user,
    assistant], tool, assistant) whose assistant ``content`` is the raw generated text.
    Deterministic in ``(seed, error_rate)``. Raises ValueError for a bad count or rate."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
    rng = random.Random(f"warm-{seed}")
    transcripts = []
    for index in range(count):
        task = calc_task(seed, index)
        _, expression = calc_question(seed, index)
        answer = format_number(evaluate_expression(expression))
        messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
        if rng.random() < error_rate:
            bad, error = _bad_call(rng.choice(MISTAKES), expression)
            messages.append({"role": "assistant", "content": bad})
            messages.append({"role": "user", "content": format_error_feedback([error])})
        messages.append({"role": "assistant", "content": _good_call(rng, expression)})
        messages.append({"role": "tool", "content": answer})
        messages.append({"role": "assistant", "content": _think("the tool says") + answer})
        transcripts.append(messages)
    return transcripts


def _encode(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
            ) -> tuple[list[int], list[int]]:
    """Token ids of the rendered transcript and a mask (1 on assistant-generated tokens):
    every assistant turn is rendered as the text after its generation prompt."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:index], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[:index + 1], tools=tools,
                                             tokenize=False)
        context = prompt[len(rendered):]
        generated = full[len(prompt):]
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        generated_ids = tokenizer.encode(generated, add_special_tokens=False)
        ids += context_ids + generated_ids
        mask += [0] * len(context_ids) + [1] * len(generated_ids)
        rendered = full
    return ids, mask


def _common_prefix(sequences: list[list[int]]) -> int:
    """Length of the token prefix every sequence shares (the system prompt and the tools),
    kept one token short of the shortest sequence so every row has a suffix."""
    length = min(len(ids) for ids in sequences) - 1
    first = sequences[0]
    for ids in sequences[1:]:
        length = next((i for i in range(length) if ids[i] != first[i]), length)
    return length


def _drill_chunks(drills: list[tuple[list[int], list[int]]], rows: int
                  ) -> list[list[tuple[list[int], list[int]]]]:
    """``drills`` in order of length, ``rows`` at a time, so that each chunk is padded only
    to its own longest row (a random batch of drills padded to its longest is about 40%
    padding)."""
    ordered = sorted(drills, key=lambda row: len(row[0]))
    return [ordered[i:i + rows] for i in range(0, len(ordered), rows)]


def _labelled(rows: list[tuple[list[int], list[int]]], prefix: int) -> int:
    """How many tokens :func:`_suffix_loss_sum` scores in ``rows``: the assistant tokens
    after the first suffix token (which is predicted from the prefix)."""
    return sum(sum(mask[prefix + 1:]) for _, mask in rows)


def _share(items: list[Any], rank: int, world: int) -> list[Any]:
    """The items of ``rank``: dealt in snake order (0, 1, 1, 0, 0, 1, ...), so that with
    items sorted by size every rank gets about the same amount of work."""
    def owner(index: int) -> int:
        turn = index % (2 * world)
        return turn if turn < world else 2 * world - 1 - turn

    return [item for i, item in enumerate(items) if owner(i) == rank]


def _suffix_loss_sum(model: Any, batch: list[tuple[list[int], list[int]]], prefix: int, *,
                     pad: int) -> tuple[Any, int]:
    """The summed next-token loss over the assistant tokens of ``batch`` and their count.
    The shared prefix (every transcript starts with the same system prompt and tool schemas,
    about 80% of its tokens) is encoded once, without gradient, and its keys and values are
    given to every row; only the suffixes are computed with gradient. This is the forward
    pass the rollout engine makes with a prefix cache; it leaves out the gradient through the
    prefix's representations, which carry no loss. ``prefix`` 0: whole rows (the drills)."""
    import torch
    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import DynamicCache

    cache = None
    if prefix:
        shared = torch.tensor([batch[0][0][:prefix]])
        with torch.no_grad():
            cache = model(input_ids=shared, use_cache=True, past_key_values=DynamicCache()
                          ).past_key_values
        cache.batch_repeat_interleave(len(batch))
    width = max(len(ids) for ids, _ in batch) - prefix
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), prefix + width), dtype=torch.long)
    attention[:, :prefix] = 1
    for row, (ids, mask) in enumerate(batch):
        suffix = ids[prefix:]
        input_ids[row, :len(suffix)] = torch.tensor(suffix)
        attention[row, prefix:prefix + len(suffix)] = 1
        labels[row, :len(suffix)] = torch.tensor(
            [t if m else -100 for t, m in zip(suffix, mask[prefix:], strict=True)])
    hidden = model.model(input_ids=input_ids, attention_mask=attention,
                         past_key_values=cache).last_hidden_state
    # The first suffix token is predicted from the prefix's last position, which has no
    # gradient; it is a user-turn token (no loss) in every transcript. Logits are computed
    # only where a label is: the head is the widest layer, and half the positions carry no
    # loss (user turns, tool results, padding).
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    total = torch.nn.functional.cross_entropy(logits, targets[keep], reduction="sum")
    return total, int(keep.sum())


def _train(ranks: Sequence[int], world: int, rendezvous: str | None, path: str,
           data: list[tuple[list[int], list[int]]], prefix: int, pad: int, seed: int,
           options: WarmStartOptions) -> float:
    """Fine-tune the model in ``path`` as ranks ``ranks`` of ``world`` (module docstring) and
    return the final loss; the process holding rank 0 saves the weights. Every rank holds the
    whole model and draws the same batches; each scores its share of the rows, the gradients
    of the ranks are added and every rank takes the same optimiser step. With one rank per
    process the sums go over gloo (rendezvous in the file ``rendezvous``); one process given
    every rank plays them in turn and adds the same gradients in rank order (the sum gloo
    makes of two ranks). One thread per process: a fixed count keeps the build reproducible,
    and two threads in one process spin at each small operation's barrier as soon as another
    process is busy (several times slower), where two processes meet once a step."""
    import torch
    import torch.distributed as dist

    from workers.trainer.checkpoint import load_model
    from workers.trainer.optim import adamw, clipped_step

    collective = len(ranks) < world
    if collective:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=ranks[0],
                                world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        model = load_model(path, dtype="float32")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = adamw(params, lr=options.lr)
        order = random.Random(seed)
        rows = min(16, -(-options.drills // (2 * world))) if options.drills else 16
        loss_value = 0.0
        for step in range(options.steps):
            batch = order.sample(data, min(options.batch_size, len(data)))
            drill = ([(ids[prefix:], mask[prefix:])
                      for ids, mask in order.sample(data, min(options.drills, len(data)))]
                     if options.drills else [])
            for group in optimizer.param_groups:
                group["lr"] = options.lr * min(1.0, (options.steps - step) / (options.steps / 4))
            flat = None
            for rank in ranks:
                part = _rank_gradient(model, params, batch, drill, rank, world, prefix, pad,
                                      rows)
                flat = part if flat is None else flat + part
            assert flat is not None
            if collective:
                dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            loss_value = float(flat[-1])
            clipped_step(optimizer, params, 1.0)
        if 0 in ranks:
            model.eval()
            model.save_pretrained(path, safe_serialization=True)
        return loss_value
    finally:
        if collective:
            dist.destroy_process_group()


def _rank_gradient(model: Any, params: list[Any], batch: list[tuple[list[int], list[int]]],
                   drill: list[tuple[list[int], list[int]]], rank: int, world: int,
                   prefix: int, pad: int, rows: int) -> Any:
    """Rank ``rank``'s share of a step: the gradient of its rows' loss (the step's loss is
    the mean over the batch's assistant tokens plus the mean over the drills'; each rank
    adds its rows' sums over the global counts), flattened, with that loss last."""
    import torch

    mine = _share(batch, rank, world)
    loss = torch.zeros(())
    if mine:
        total, _ = _suffix_loss_sum(model, mine, prefix, pad=pad)
        loss = loss + total / _labelled(batch, prefix)
    if drill:
        count = _labelled(drill, 0)
        for chunk in _share(_drill_chunks(drill, rows), rank, world):
            total, _ = _suffix_loss_sum(model, chunk, 0, pad=pad)
            loss = loss + total / count
    for p in params:
        p.grad = None
    if loss.requires_grad:
        loss.backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params] + [loss.detach().reshape(1)])


def _train_rank(rank: int, world: int, rendezvous: str, result: str, abort_once: str | None,
                *args: Any) -> None:
    """A spawned rank of :func:`_train`; rank 0 writes the final loss to ``result``.

    ``abort_once`` (``TRAJSTORE_FAULT_WARMSTART_ABORT_ONCE``, tests only): the rank that
    creates this file first kills itself with SIGABRT, as a rank the machine kills dies;
    a rank that finds it trains. A path that cannot be created raises OSError."""
    if abort_once is not None:
        _abort_once(abort_once)
    loss = _train([rank], world, rendezvous, *args)
    if rank == 0:
        Path(result).write_text(repr(loss), encoding="utf-8")


def _abort_once(flag: str) -> None:
    """Create ``flag`` and abort the process, unless it exists (then return)."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an injected fault leaves no core
    os.abort()


def _killed_by(exc: BaseException) -> str | None:
    """The name of the signal that killed a spawned rank when ``exc`` (from
    ``torch.multiprocessing.start_processes``) says one did; None for anything else: a rank
    that raised (``ProcessRaisedException``) or exited with a code, which is a bug that a
    retry would only repeat."""
    from torch.multiprocessing import ProcessExitedException

    if isinstance(exc, ProcessExitedException) and exc.signal_name:
        return str(exc.signal_name)
    return None


def _retry_killed(attempt: Callable[[int], float], *, what: str,
                  attempts: int = SPAWN_ATTEMPTS) -> float:
    """``attempt(number)`` for number 1, 2, ... until one returns, while each failure is a
    rank killed by a signal (:func:`_killed_by`), each logged as a warning naming ``what``,
    the rank and the signal; at most ``attempts`` in all, after which the last exception
    propagates. Any other exception propagates at once. Raises ValueError when ``attempts``
    is not a positive integer."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive integer, got {attempts!r}")
    for number in range(1, attempts + 1):
        try:
            return attempt(number)
        except Exception as exc:
            signal_name = _killed_by(exc)
            if signal_name is None or number == attempts:
                raise
            log.warning("%s: rank %d was killed by %s (attempt %d of %d); starting again in a "
                        "fresh scratch folder", what, getattr(exc, "error_index", -1),
                        signal_name, number, attempts)
    raise AssertionError("unreachable")  # the last attempt returned or raised


def _can_spawn() -> bool:
    """Whether spawned processes can run here: not from a daemonic process (a Celery
    worker's child), nor when the main module is a script that is not on disk (``python -``),
    which a spawned child would import again."""
    import multiprocessing

    import __main__

    if multiprocessing.current_process().daemon:
        return False
    main_file = getattr(__main__, "__file__", None)
    return main_file is None or Path(main_file).is_file()


def warm_start_model(directory: str | os.PathLike[str], *, seed: int = 0,
                     options: WarmStartOptions | None = None) -> Path:
    """Build the tiny model for ``seed`` into ``directory`` and fine-tune it on
    :func:`solver_transcripts` in ``options.processes`` processes; writes the weights, the
    tokenizer and the manifest. Returns the folder. Raises ValueError for a negative seed or
    bad options. A spawned rank killed by a signal is retried (module docstring); one that
    raised or exited with a code raises ``torch.multiprocessing.ProcessException`` at once,
    as does the last attempt."""
    import torch
    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import AutoTokenizer

    options = options or WarmStartOptions()
    options.check()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")

    def starting_model() -> Path:
        return build_tiny_model(directory, seed=seed, hidden_size=options.hidden_size,
                                layers=options.layers, heads=options.heads)

    path = starting_model()
    with LOCK:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tools = [dict(t) for t in calc_task(seed, 0).tools]
    data = [_encode(tokenizer, t, tools)
            for t in solver_transcripts(options.transcripts, seed=seed,
                                        error_rate=options.error_rate)]
    prefix = _common_prefix([ids for ids, _ in data])
    args = (str(path), data, prefix, tokenizer.pad_token_id, seed, options)
    if options.processes == 1 or not _can_spawn():
        # Where no child process can be started, this process plays every rank in turn:
        # the same weights, in about twice the time.
        with torch.random.fork_rng(devices=[]), contextlib.ExitStack() as restore:
            restore.callback(torch.set_num_threads, torch.get_num_threads())
            loss = _train(range(options.processes), options.processes, None, *args)
    else:
        import torch.multiprocessing as mp

        from store.settings import get_settings

        flag = get_settings().fault_warmstart_abort_once
        abort_once = None if flag is None else str(flag)

        def spawn(number: int) -> float:
            if number > 1:
                # A killed rank 0 may have been saving the trained weights over the
                # starting ones: start from the seed's starting weights again.
                starting_model()
            with tempfile.TemporaryDirectory(prefix="warm-start-") as scratch:
                result = Path(scratch) / "loss"
                mp.start_processes(_train_rank, nprocs=options.processes,
                                   start_method="spawn",
                                   args=(options.processes, str(Path(scratch) / "rendezvous"),
                                         str(result), abort_once, *args))
                return float(result.read_text(encoding="utf-8"))

        loss = _retry_killed(spawn, what=f"warm start seed {seed}")
    log.info("warm start seed %d: final SFT loss %.3f", seed, loss)
    manifest = {"version": WARM_START_VERSION, "seed": seed,
                "options": options.__dict__, "final_loss": round(loss, 4),
                "sha256": {f.name: _sha256(f) for f in sorted(path.iterdir())
                           if f.is_file() and f.name != _MANIFEST}}
    (path / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return path


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_warm_start(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a cached warm-start folder against its manifest; returns the manifest. Raises
    WarmStartCacheError naming the file when the manifest is missing or unreadable, a file
    is missing, or a file's SHA-256 differs."""
    folder = Path(path)
    manifest_file = folder / _MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        hashes = manifest["sha256"]
        if not isinstance(hashes, dict) or "model.safetensors" not in hashes:
            raise KeyError("sha256")
    except FileNotFoundError:
        raise WarmStartCacheError(f"warm-start cache {folder}: {_MANIFEST} is missing") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise WarmStartCacheError(f"warm-start cache {folder}: {_MANIFEST} is unreadable "
                                  f"({exc})") from None
    for name, expected in hashes.items():
        file = folder / name
        if not file.is_file():
            raise WarmStartCacheError(f"warm-start cache {folder}: {name} is missing")
        if _sha256(file) != expected:
            raise WarmStartCacheError(f"warm-start cache {folder}: {name} does not match its "
                                      f"checksum (corrupt)")
    return manifest


def is_warm_start(model: str | os.PathLike[str] | None) -> bool:
    """Whether ``model`` (a run's model folder) is a warm start :func:`warm_start_path`
    built."""
    return model is not None and Path(model).name.startswith(FOLDER_PREFIX)


def warm_start_path(data_dir: str | os.PathLike[str], *, seed: int = 0,
                    options: WarmStartOptions | None = None) -> Path:
    """The warm-started model for ``seed`` under ``data_dir``, built once (module docstring).

    A cached folder that fails :func:`verify_warm_start` is reported with a warning naming
    the problem, removed and rebuilt. Building happens in a temporary sibling renamed into
    place. Raises ValueError for a negative ``seed`` or bad options."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    options = options or WarmStartOptions()
    options.check()
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    recipe = hashlib.sha256(json.dumps(options.__dict__, sort_keys=True).encode()).hexdigest()
    target = root / f"{FOLDER_PREFIX}v{WARM_START_VERSION}-seed{seed}-{recipe[:8]}"
    if target.exists():
        try:
            verify_warm_start(target)
            return target
        except WarmStartCacheError as exc:
            log.warning("%s; rebuilding it", exc)
            shutil.rmtree(target, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
    try:
        warm_start_model(staging, seed=seed, options=options)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.exists():
                raise
            verify_warm_start(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
