"""Benchmark: rollout generation with vLLM's offline engine against plain transformers.

Both backends serve the same tiny Qwen3 model (built locally from a seed) in this process, with
the same torch thread count. Measured, for each backend:

- generated tokens/s over R single requests in sequence (arithmetic prompts with the
  calculator schema, temperature 1, ``max_tokens`` M);
- for vLLM also over the same R requests in one batch (continuous batching);
- episodes/s of :func:`workers.rollout.loop.run_episode` on E arithmetic tasks.

Ratios are vLLM over transformers. Without an importable ``vllm`` only transformers is
measured and the script says so.

    python bench/rollout.py                       # R=16, M=64, E=16
    python bench/rollout.py --requests 8 --max-tokens 32 --episodes 4 --no-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.rollout.agent_tasks import arithmetic_tasks  # noqa: E402
from workers.rollout.backend import GenerationRequest, SamplingParams  # noqa: E402
from workers.rollout.builtin_tools import default_tool_registry  # noqa: E402
from workers.rollout.loop import run_episode  # noqa: E402
from workers.rollout.sink import ListSink  # noqa: E402
from workers.rollout.tinymodel import tiny_model_path  # noqa: E402

__all__ = ["main"]


def _requests(count: int, max_tokens: int) -> list[GenerationRequest]:
    tasks = arithmetic_tasks(count, seed=1)
    return [GenerationRequest(sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                      seed=index),
                              messages=task.messages, tools=task.tools)
            for index, task in enumerate(tasks)]


def _sequential(backend: Any, requests: list[GenerationRequest]) -> dict[str, float]:
    backend.generate(requests[0])  # warm-up
    started = time.perf_counter()
    tokens = sum(int(backend.generate(r).response_ids.shape[0]) for r in requests)
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _batched(backend: Any, requests: list[GenerationRequest]) -> dict[str, float]:
    backend.generate_batch(requests[:2])  # warm-up
    started = time.perf_counter()
    tokens = sum(int(r.response_ids.shape[0]) for r in backend.generate_batch(requests))
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _episodes(backend: Any, count: int, max_tokens: int) -> dict[str, float]:
    tools = default_tool_registry()
    tasks = arithmetic_tasks(count, seed=2)
    started = time.perf_counter()
    calls = 0
    for index, task in enumerate(tasks):
        result = run_episode(task=task, backend=backend, tools=tools, sink=ListSink(),
                             run_id="bench",
                             sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                     seed=index))
        calls += result.llm_calls
    seconds = time.perf_counter() - started
    return {"episodes": count, "llm_calls": calls, "seconds": seconds,
            "episodes_per_s": count / seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print (and return) its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the tiny model is cached (a temporary folder by default)")
    parser.add_argument("--no-vllm", action="store_true", help="measure transformers only")
    args = parser.parse_args(argv)
    for name in ("requests", "max_tokens", "episodes", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_dir = tiny_model_path(data_dir)
    import torch

    from workers.rollout.backend_transformers import TransformersBackend
    from workers.rollout.backend_vllm import cpu_engine_environment, vllm_available

    requests = _requests(args.requests, args.max_tokens)
    report: dict[str, Any] = {"requests": args.requests, "max_tokens": args.max_tokens,
                              "episodes": args.episodes, "threads": args.threads}
    hf = TransformersBackend(model_dir)
    torch.set_num_threads(args.threads)
    report["transformers"] = {"sequential": _sequential(hf, requests),
                              "episodes": _episodes(hf, args.episodes, args.max_tokens)}
    if not args.no_vllm:  # before vllm is first imported: an in-process CPU engine
        os.environ.update(cpu_engine_environment(data_dir / "vllm-cache"))
    use_vllm = not args.no_vllm and vllm_available()
    if use_vllm:
        from workers.rollout.backend_vllm import VLLMBackend

        engine = VLLMBackend(model_dir, distributed_executor_backend="uni", enforce_eager=True,
                             dtype="float32", max_model_len=2048, seed=0)
        torch.set_num_threads(args.threads)  # the engine lowers it; keep the comparison fair
        report["vllm"] = {"sequential": _sequential(engine, requests),
                          "batched": _batched(engine, requests),
                          "episodes": _episodes(engine, args.episodes, args.max_tokens)}
        base = report["transformers"]
        report["ratios"] = {
            "tokens_per_s_sequential": report["vllm"]["sequential"]["tokens_per_s"]
            / base["sequential"]["tokens_per_s"],
            "tokens_per_s_batched": report["vllm"]["batched"]["tokens_per_s"]
            / base["sequential"]["tokens_per_s"],
            "episodes_per_s": report["vllm"]["episodes"]["episodes_per_s"]
            / base["episodes"]["episodes_per_s"],
        }
    hf_seq, hf_ep = report["transformers"]["sequential"], report["transformers"]["episodes"]
    print(f"tiny Qwen3, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.episodes} episodes, {args.threads} torch threads")
    print(f"transformers  sequential {hf_seq['tokens_per_s']:8.1f} tokens/s   "
          f"episodes {hf_ep['episodes_per_s']:6.2f}/s")
    if use_vllm:
        vllm = report["vllm"]
        ratios = report["ratios"]
        print(f"vLLM          sequential {vllm['sequential']['tokens_per_s']:8.1f} tokens/s "
              f"(x{ratios['tokens_per_s_sequential']:.2f})   "
              f"episodes {vllm['episodes']['episodes_per_s']:6.2f}/s "
              f"(x{ratios['episodes_per_s']:.2f})")
        print(f"vLLM          batched    {vllm['batched']['tokens_per_s']:8.1f} tokens/s "
              f"(x{ratios['tokens_per_s_batched']:.2f})")
    else:
        reason = "--no-vllm given" if args.no_vllm else "vllm is not importable"
        print(f"vLLM not measured ({reason}): transformers numbers only, no ratio")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
