"""Replay benchmark: episodes/s and events/s projected into samples, against a plain
sequential read of the same events in the same run.

Records ``episodes`` episodes of ``turns`` tool-calling turns each (Qwen3's chat template and
tokenizer, prompts rendered and tokenized as an engine would), then times, in alternating
rounds: (a) reading every episode's events one stream at a time (``read_stream``, token
payloads decoded) and (b) projecting the same episodes the way the sweep and a rebuild do
(``project_episodes`` in batches of ``workers.replay.jobs.project.BATCH``: one read of the batch's
events, then per episode segmentation + merge + samples, then one transaction writing the
batch's rows and checkpoints). Target: (b) >= 0.5x the plain read rate. For reference it also
times (c) the per-episode path of the replay task (``project_episode``: read, replay, one
transaction per episode) on a second set of episodes, and (d) the projection of a third set
by a ``ProjectionPool`` of ``--jobs`` processes, the way ``trajstore replay --rebuild --jobs N``
projects; (c) and (d) are printed beside the target, which is (b)'s.

    python bench/replay.py [--episodes 40 --turns 6 --rounds 3 --tool-tokens 0 --reply-tokens 0
                            --system-tokens 0 --shared-prompt --jobs 2]

By default messages are short (a sentence, a number) and every episode asks its own question;
``--tool-tokens`` and ``--reply-tokens`` lengthen tool outputs and replies, ``--turns`` the
episodes, ``--system-tokens`` adds a system prompt, and ``--shared-prompt`` makes the four
episodes of a group ask the same question (as a GRPO group's rollouts do), to see how the
ratio moves with the shape of the episodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import scratch_database, words  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import NO_STREAM, EventStore, run_stream_id  # noqa: E402
from store.events import (  # noqa: E402
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RunConfig,
    RunCreated,
    ToolReturned,
)
from store.settings import Settings  # noqa: E402
from workers.engines.tokenizers import load_tokenizer  # noqa: E402
from workers.replay.jobs.parallel import ProjectionPool  # noqa: E402
from workers.replay.jobs.project import (  # noqa: E402
    BATCH,  # noqa: E402
    project_episode,
    project_episodes,
)

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def episode(tokenizer, run_id: str, group: str, turns: int, seed: int, *,
            tool_tokens: int = 0, reply_tokens: int = 0, system_tokens: int = 0,
            task: int | None = None) -> list:
    """One episode of ``turns`` calculator calls; with ``tool_tokens`` / ``reply_tokens``,
    each tool output / reply carries about that many tokens of English-like text more; with
    ``system_tokens``, a system prompt of about that many tokens (the same in every episode)
    opens it. ``task`` numbers the user's request (default: ``seed``); episodes of one GRPO
    group share it."""
    rng = np.random.default_rng(seed)

    def pad(n: int) -> str:
        return " " + words(rng, n) if n else ""

    def render(messages, gen):
        return tokenizer.apply_chat_template(messages, tools=[TOOL], tokenize=False,
                                             add_generation_prompt=gen)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    system = ([{"role": "system", "content": words(np.random.default_rng(12345),
                                                    system_tokens)}]
              if system_tokens else [])
    messages: list[dict[str, Any]] = [*system, {
        "role": "user",
        "content": f"Compute the running total of {seed if task is None else task} items."}]
    events: list[Event] = [EpisodeStarted(run_id=run_id, group_id=group, messages=messages,
                                          tools=[TOOL])]
    for t in range(turns):
        call = {"id": f"c{t}", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": f"{seed}+{t}"})}}
        last = t == turns - 1
        response: dict[str, Any] = ({"role": "assistant", "content": f"The total is {seed + t}."
                     + pad(reply_tokens)} if last
                    else {"role": "assistant", "content": f"Step {t}: adding."
                          + pad(reply_tokens), "tool_calls": [call]})
        prompt = render(messages, True)
        full = render([*messages, response], False)
        generated = encode(full[len(prompt):].rstrip())
        events.append(LLMCalled(call_id=f"call-{t}", messages=list(messages), tools=[TOOL],
                                prompt_ids=encode(prompt), response_ids=generated,
                                logprobs=np.full(len(generated), -0.1), response=response))
        if not last:
            output = str(seed + t) + pad(tool_tokens)
            events.append(ToolReturned(name="calculator", output=output))
            messages = [*messages, response, {"role": "tool", "content": output}]
    return [*events, RewardAssigned(value=1.0), EpisodeFinished(status="completed")]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tool-tokens", type=int, default=0,
                        help="about this many tokens of text more in every tool output")
    parser.add_argument("--reply-tokens", type=int, default=0,
                        help="about this many tokens of text more in every reply")
    parser.add_argument("--system-tokens", type=int, default=0,
                        help="a system prompt of about this many tokens opens every episode")
    parser.add_argument("--shared-prompt", action="store_true",
                        help="the 4 episodes of a group share their request, as GRPO groups do")
    parser.add_argument("--jobs", type=int, default=2,
                        help="processes of the ProjectionPool timed in (d); 0 skips (d)")
    args = parser.parse_args(argv)
    shape = {"tool_tokens": args.tool_tokens, "reply_tokens": args.reply_tokens,
             "system_tokens": args.system_tokens}
    tokenizer = load_tokenizer("qwen3")
    with scratch_database() as url, contextlib.ExitStack() as stack:
        store = EventStore(Database(url, max_size=2), Settings(database_url=url))
        pool = (stack.enter_context(ProjectionPool(url, jobs=args.jobs)) if args.jobs > 0
                else None)
        # Warm up once: the tokenizer's byte-offset table is built on first use per process.
        warm = f"warm-{uuid.uuid4().hex[:6]}"
        store.append(run_stream_id(warm), [RunCreated(run_id=warm, config=RunConfig(
            tokenizer="qwen3"))], NO_STREAM)
        store.append(f"{warm}-ep", episode(tokenizer, warm, "g", args.turns, 0, **shape),
                     NO_STREAM)
        project_episode(store, f"{warm}-ep")
        if pool is not None:  # every process loads the tokenizer before the timing starts
            warm_ids = [f"{warm}-pool{i}" for i in range(4 * args.jobs)]
            for i, ep in enumerate(warm_ids):
                store.append(ep, episode(tokenizer, warm, "g", 1, i), NO_STREAM)
            pool.project(warm_ids)
        ratios: list[float] = []
        single: list[float] = []
        pooled: list[float] = []
        for r in range(args.rounds):
            run_id = f"bench-{r}-{uuid.uuid4().hex[:6]}"
            store.append(run_stream_id(run_id),
                         [RunCreated(run_id=run_id, config=RunConfig(tokenizer="qwen3",
                                                                     group_size=4))],
                         NO_STREAM)
            sets: list[list[str]] = [[], [], []]
            for e in range(3 * args.episodes):
                ep = f"{run_id}-ep{e}"
                store.append(ep, episode(tokenizer, run_id, f"g{e // 4}", args.turns, e,
                                         task=e // 4 if args.shared_prompt else None,
                                         **shape), NO_STREAM)
                sets[e // args.episodes].append(ep)
            ids, others, parallel = sets
            n_events = sum(len(store.read_stream(ep)) for ep in ids)
            t0 = time.perf_counter()
            for ep in ids:
                store.read_stream(ep)
            read_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for start in range(0, len(ids), BATCH):
                outcomes = project_episodes(store, ids[start:start + BATCH])
                assert all(o.status == "completed" for o in outcomes), outcomes
            replay_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for ep in others:
                assert project_episode(store, ep).status == "completed"
            single_s = time.perf_counter() - t0
            ratios.append(read_s / replay_s)
            single.append(read_s / single_s)
            pool_text = ""
            if pool is not None:
                t0 = time.perf_counter()
                outcomes = pool.project(parallel)
                pool_s = time.perf_counter() - t0
                assert all(o.status == "completed" for o in outcomes), outcomes
                pooled.append(read_s / pool_s)
                pool_text = (f" | {args.jobs} processes {len(parallel) / pool_s:7.1f} "
                             f"episodes/s (ratio {pooled[-1]:.2f})")
            print(f"  round {r + 1}: replay {len(ids) / replay_s:7.1f} episodes/s "
                  f"({n_events / replay_s:8.1f} events/s) | plain read "
                  f"{len(ids) / read_s:7.1f} episodes/s ({n_events / read_s:8.1f} events/s)"
                  f" | ratio {ratios[-1]:.2f} | per-episode task path "
                  f"{len(others) / single_s:7.1f} episodes/s (ratio {single[-1]:.2f})"
                  + pool_text)
        store.close()
    extra = (f" (tool outputs +{args.tool_tokens}, replies +{args.reply_tokens} tokens)"
             if args.tool_tokens or args.reply_tokens else "")
    extra += f" (system prompt {args.system_tokens} tokens)" if args.system_tokens else ""
    extra += " (groups share their request)" if args.shared_prompt else ""
    def verdict(ratio: float) -> str:
        return f"{ratio:.2f} ({'met' if ratio >= 0.5 else 'not met'})"

    print(f"{args.episodes} episodes x {args.turns} turns per round{extra}; median replay/read "
          f"against the target 0.5: one process {verdict(statistics.median(ratios))}"
          + (f", {args.jobs} processes {verdict(statistics.median(pooled))}" if pooled else "")
          + f"; per-episode task path {statistics.median(single):.2f}")
    print(f"RESULT replay_vs_read={statistics.median(ratios):.3f}"
          + (f" pool_vs_read={statistics.median(pooled):.3f}" if pooled else "")
          + f" task_path_vs_read={statistics.median(single):.3f}")
    return ratios


if __name__ == "__main__":
    main()
