"""What the agent loop's own rollback trains, on the real store and the real replay: an
episode played by the loop (scripted turns forced through the tiny model) with a failed
tool call, its rollback and a retry, recorded in PostgreSQL, projected by the replay the
workers run and leased. Token by token, which tokens have mask 1 in which sample."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import LLMCalled, RollbackConfig, RunConfig, RunCreated
from store.leasing import Leasing
from tests.rollout.test_loop import TASK
from tests.rollout.turns import tool_call, turn
from workers.engines.backend import SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.replay.jobs.project import project_episode
from workers.rollout.loop import run_episode
from workers.rollout.tools import ToolRegistry

FAILED = turn("use python", tool_call("python", code="print(undefined)"))
FIXED = turn("fixed", tool_call("python", code="print(6 * 7)"))
ANSWER = "The answer is 42."


def play_into_store(store: EventStore, backend: TransformersBackend, registry: ToolRegistry,
                    tiny_model_dir: Path, *, save_negatives: bool
                    ) -> tuple[str, str, list[LLMCalled]]:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig(group_size=1, tokenizer=str(tiny_model_dir),
                       rollback=RollbackConfig(save_negative_samples=save_negatives))
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    result = run_episode(task=TASK, backend=ReplayBackend(backend, [FAILED, FIXED, ANSWER]),
                         tools=registry, sink=store, run_id=run_id, episode_id=episode,
                         sampling=SamplingParams(temperature=1.0, max_tokens=256),
                         rollback=config)
    assert (result.status, result.rollbacks) == ("completed", 1)
    assert result.reward is not None and result.reward.value == 1.0
    calls = [r.event for r in store.read_stream(episode) if isinstance(r.event, LLMCalled)]
    return run_id, episode, calls


def stored_samples(store: EventStore, episode: str) -> dict[tuple[str, int], dict]:
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT kind, timeline_index, reward, status, token_ids, loss_mask, logprobs"
            " FROM samples WHERE episode_id = %s", (episode,)).fetchall()
    return {(kind, index): {
        "reward": reward, "status": status,
        "ids": np.frombuffer(ids, dtype="<i4").tolist(),
        "mask": np.frombuffer(mask, dtype=np.uint8).tolist(),
        "logprobs": np.frombuffer(logprobs, dtype="<f4")}
        for kind, index, reward, status, ids, mask, logprobs in rows}


@pytest.mark.parametrize("save_negatives", [True, False])
def test_the_loops_rolled_back_call_is_trained_only_as_its_negative_sample(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tiny_model_dir: Path, save_negatives: bool) -> None:
    run_id, episode, calls = play_into_store(store, hf_backend, registry, tiny_model_dir,
                                             save_negatives=save_negatives)
    failed, retry, final = calls
    # The loop regenerates with the failed turn and the error feedback in the prompt: the
    # failed call's timeline is a prefix of the retry's.
    assert retry.messages[:-1] == [*TASK.messages, failed.response]
    assert project_episode(store, episode).outcome == "written"
    got = stored_samples(store, episode)
    expected_keys = {("positive", 1), ("positive", 2)}
    if save_negatives:
        expected_keys.add(("negative", 0))
    assert set(got) == expected_keys  # the failed call has no positive sample of its own

    # The retry's sample is its call exactly as the engine saw it; every token before its
    # generation (the question, the failed call, the error feedback) is context.
    prompt, response = retry.prompt_ids.tolist(), retry.response_ids.tolist()
    sample = got[("positive", 1)]
    assert sample["ids"] == prompt + response
    assert sample["mask"] == [0] * len(prompt) + [1] * len(response)
    assert sample["logprobs"][:len(prompt)].tolist() == [0.0] * len(prompt)
    np.testing.assert_allclose(sample["logprobs"][len(prompt):], retry.logprobs)
    assert sample["reward"] == 1.0 and sample["status"] == "ready"
    # The failed generation is in that context: as rendered for the retry's prompt, not
    # trained.
    failed_text = hf_backend.tokenizer.decode(failed.response_ids.tolist(),
                                              skip_special_tokens=True)
    assert "undefined" in failed_text
    assert "undefined" in hf_backend.tokenizer.decode(prompt)

    # The final call trains only its own answer: the retry it follows is context there.
    prompt, response = final.prompt_ids.tolist(), final.response_ids.tolist()
    sample = got[("positive", 2)]
    assert sample["ids"] == prompt + response
    assert sample["mask"] == [0] * len(prompt) + [1] * len(response)
    assert "undefined" not in hf_backend.tokenizer.decode(prompt)

    # Trained over all positive samples: the retry's and the answer's tokens, nothing else.
    trained = sum(sum(got[key]["mask"]) for key in got if key[0] == "positive")
    assert trained == len(retry.response_ids) + len(final.response_ids)

    if save_negatives:
        # The failed call's one place in training: its negative sample, every generated
        # token trained, with the run's negative reward.
        negative = got[("negative", 0)]
        prompt, response = failed.prompt_ids.tolist(), failed.response_ids.tolist()
        assert negative["ids"] == prompt + response
        assert negative["mask"] == [0] * len(prompt) + [1] * len(response)
        np.testing.assert_allclose(negative["logprobs"][len(prompt):], failed.logprobs)
        assert negative["reward"] == -1.0

    lease = Leasing(store).lease_batch(run_id, groups=1, lease_seconds=60)
    assert lease is not None
    assert sorted((s.kind, s.reward) for s in lease.samples) == sorted(
        [("positive", 1.0), ("positive", 1.0)] + ([("negative", -1.0)] if save_negatives
                                                  else []))
