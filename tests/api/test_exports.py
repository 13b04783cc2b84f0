"""Exports of a run (``GET /v1/runs/{run}/export?format=…`` and ``trajstore export``):
verl's prompt dataset and padded batch, ATIF trajectories and SFT lines, from episodes
recorded with the real Qwen3 chat template and replayed by the real projection."""

from __future__ import annotations

import gc
import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from api import exports
from api.app import create_app
from api.keys import KeyStore
from api.places import Held
from store.db import Database
from store.eventlog import EventStore
from store.events import EpisodeStarted
from store.settings import Settings
from tests.api.conftest import Project, make_project
from tests.api.episodes import ADD_TOOL, create_run, episode_events
from workers.replay.jobs.project import project_episode


@dataclass
class Recorded:
    episode_id: str
    group_id: str
    task_id: str
    reward: float | None
    finished: bool
    failed_attempt: bool
    events: list[Any]


@dataclass
class Dataset:
    project: Project
    run_id: str
    empty_run: str
    episodes: list[Recorded]


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def dataset(pg_url: str, qwen3: Any) -> Iterator[Dataset]:
    settings = Settings(database_url=pg_url, api_key_scrypt_n=1024)
    store = EventStore(Database(pg_url, max_size=2), settings)
    project = make_project(KeyStore(store.db, settings))
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    empty_run = f"run-{uuid.uuid4().hex[:8]}"
    create_run(store, run_id, project=project.name, group_size=2, max_negatives=1)
    create_run(store, empty_run, project=project.name)
    plan = [  # group, task, reward, failed attempt, finished, projected
        ("g0", "arith-0-0", 1.0, True, True, True),
        ("g0", "arith-0-0", 0.0, False, True, True),
        ("g1", "arith-0-1", 1.0, False, True, True),
        ("g1", "arith-0-1", 0.5, False, True, True),
        ("g2", "own-task", 1.0, False, True, False),   # finished, not replayed yet
        ("g2", "own-task", None, False, False, False),  # still running
    ]
    episodes = []
    for i, (group, task, reward, failed, finished, projected) in enumerate(plan):
        episode_id = f"ep{i}-{uuid.uuid4().hex[:6]}"
        events = episode_events(qwen3, run_id=run_id, group_id=group, a=i + 1, b=2 + i,
                                reward=reward if reward is not None else 0.0,
                                failed_attempt=failed, seed=i)
        started = events[0]
        assert isinstance(started, EpisodeStarted)
        events[0] = started.model_copy(update={"task_id": task})
        if not finished:
            events = [e for e in events if e.type not in ("reward_assigned",
                                                          "episode_finished")]
        store.append(episode_id, events, "no_stream")
        if projected:
            assert project_episode(store, episode_id).outcome == "written"
        episodes.append(Recorded(episode_id, group, task, reward, finished, failed, events))
    yield Dataset(project, run_id, empty_run, episodes)
    store.close()


@pytest.fixture
def client(pg_url: str, tmp_path: Path, api_store: EventStore) -> Iterator[TestClient]:
    settings = Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024,
                        api_export_rows_per_group=2)
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def _export(client: TestClient, ds: Dataset, fmt: str, **params: Any) -> Any:
    r = client.get(f"/v1/runs/{ds.run_id}/export", params={"format": fmt, **params},
                   headers=ds.project.headers("read"))
    assert r.status_code == 200, r.text
    return r


def _samples(client: TestClient, ds: Dataset) -> list[dict[str, Any]]:
    r = client.get(f"/v1/runs/{ds.run_id}/samples", params={"limit": 100},
                   headers=ds.project.headers("read"))
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def test_verl_prompts_one_row_per_task(client: TestClient, dataset: Dataset) -> None:
    r = _export(client, dataset, "verl-prompts")
    assert r.headers["content-type"] == "application/vnd.apache.parquet"
    assert f'{dataset.run_id}.prompts.parquet' in r.headers["content-disposition"]
    rows = pq.read_table(io.BytesIO(r.content)).to_pylist()
    assert [row["extra_info"]["task_id"] for row in rows] == ["arith-0-0", "arith-0-1",
                                                                "own-task"]
    first = {e.task_id: e for e in reversed(dataset.episodes)}
    for index, row in enumerate(rows):
        recorded = first[row["extra_info"]["task_id"]]
        assert row["prompt"] == [{"role": m["role"], "content": m["content"]}
                                 for m in recorded.events[0].messages]
        assert row["prompt"][0]["role"] == "user" and "plus" in row["prompt"][0]["content"]
        assert row["data_source"] == dataset.run_id
        assert row["reward_model"] is None  # the API does not know the tasks' answers
        info = row["extra_info"]
        assert info["index"] == index
        assert info["episode_id"] == recorded.episode_id
        assert info["group_id"] == recorded.group_id
        assert json.loads(info["tools"]) == [ADD_TOOL]
    named = _export(client, dataset, "verl-prompts", data_source="arith")
    assert {row["data_source"] for row in
            pq.read_table(io.BytesIO(named.content)).to_pylist()} == {"arith"}


def test_verl_batch_pads_like_verl(client: TestClient, dataset: Dataset, qwen3: Any,
                                   tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    r = _export(client, dataset, "verl-batch")
    assert r.headers["content-type"] == "application/octet-stream"
    path = tmp_path / "batch.safetensors"
    path.write_bytes(r.content)
    batch = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    samples = _samples(client, dataset)
    n = len(samples)
    assert n >= 5 and sum(s["is_negative"] for s in samples) == 1
    p_len = max(s["prompt_length"] for s in samples)
    r_len = max(s["num_tokens"] - s["prompt_length"] for s in samples)
    assert batch["prompts"].shape == (n, p_len)
    assert batch["responses"].shape == (n, r_len)
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert batch[name].shape == (n, p_len + r_len), name
    for name in ("response_mask", "rollout_log_probs", "token_level_scores"):
        assert batch[name].shape == (n, r_len), name
    assert batch["uid"].shape == (n,)
    assert meta["format"] == "trajstore-verl-batch" and meta["run_id"] == dataset.run_id
    pad = qwen3.pad_token_id
    assert int(meta["pad_token_id"]) == pad
    uids = json.loads(meta["uids"])
    assert json.loads(meta["episode_ids"]) == [s["episode_id"] for s in samples]
    for i, s in enumerate(samples):
        p, r = s["prompt_length"], s["num_tokens"] - s["prompt_length"]
        ids = batch["input_ids"][i].tolist()
        mask = batch["attention_mask"][i].tolist()
        # Prompt left-padded, response right-padded.
        assert ids[:p_len - p] == [pad] * (p_len - p)
        assert ids[p_len - p:p_len] == s["prompt_ids"]
        assert ids[p_len:p_len + r] == s["response_ids"]
        assert ids[p_len + r:] == [pad] * (r_len - r)
        assert mask == [0] * (p_len - p) + [1] * (p + r) + [0] * (r_len - r)
        assert batch["prompts"][i].tolist() == ids[:p_len]
        assert batch["responses"][i].tolist() == ids[p_len:]
        positions = batch["position_ids"][i].tolist()
        assert positions[p_len - p:p_len + r] == list(range(p + r))
        assert positions[:p_len - p] == [0] * (p_len - p)
        # The loss mask and the logprobs line up with the response tokens.
        response_mask = batch["response_mask"][i].tolist()
        assert response_mask == s["response_mask"] + [0] * (r_len - r)
        logprobs = batch["rollout_log_probs"][i].numpy()
        assert np.allclose(logprobs[:r], s["rollout_log_probs"])
        assert (logprobs[np.array(response_mask) == 0] == 0).all()
        assert (logprobs[np.array(response_mask) == 1] < 0).all()
        scores = batch["token_level_scores"][i].numpy()
        assert scores[r - 1] == pytest.approx(s["reward"])
        assert (np.delete(scores, r - 1) == 0).all()
        assert uids[int(batch["uid"][i])] == s["uid"]
        assert bool(batch["is_negative"][i]) == s["is_negative"]
        assert int(batch["sample_id"][i]) == s["sample_id"]
    assert batch["rollout_log_probs"].dtype.is_floating_point
    # Filters as the samples listing's; an explicit pad token.
    negative = _export(client, dataset, "verl-batch", kind="negative", pad_token_id=0)
    path.write_bytes(negative.content)
    only = load_file(str(path))
    assert only["is_negative"].tolist() == [True]
    assert int(safe_open(str(path), framework="pt").metadata()["pad_token_id"]) == 0


def test_atif_one_trajectory_per_finished_episode(client: TestClient,
                                                   dataset: Dataset) -> None:
    r = _export(client, dataset, "atif")
    assert r.headers["content-type"].startswith("application/x-ndjson")
    docs = [json.loads(line) for line in r.text.splitlines()]
    finished = [e for e in dataset.episodes if e.finished]
    assert [d["session_id"] for d in docs] == [e.episode_id for e in finished]
    for doc, recorded in zip(docs, finished, strict=True):
        assert doc["schema_version"] == "ATIF-v1.7"
        assert doc["agent"]["name"] == "main"
        assert doc["agent"]["tool_definitions"] == [ADD_TOOL]
        steps = doc["steps"]
        assert [s["step_id"] for s in steps] == list(range(1, len(steps) + 1))
        assert steps[0]["source"] == "user" and "plus" in steps[0]["message"]
        calls = [e for e in recorded.events if e.type == "llm_called"]
        agent = [s for s in steps if s["source"] == "agent"]
        assert len(agent) == len(calls)
        for step, call in zip(agent, calls, strict=True):
            assert step["metrics"]["completion_token_ids"] == call.response_ids.tolist()
            assert step["metrics"]["prompt_token_ids"] == call.prompt_ids.tolist()
            assert len(step["metrics"]["logprobs"]) == len(call.response_ids)
            assert step["extra"]["call_id"] == call.call_id
            for result in step.get("observation", {}).get("results", []):
                assert result["source_call_id"] in {c["tool_call_id"]
                                                    for c in step["tool_calls"]}
        # The good add call's result is the observation of the step that made it.
        good = agent[-2]
        assert good["tool_calls"][0]["function_name"] == "add"
        assert good["tool_calls"][0]["arguments"] == {"a": int(steps[0]["message"].split()[2]),
                                                      "b": int(steps[0]["message"].split()[4]
                                                               .rstrip("?"))}
        assert good["observation"]["results"][-1]["content"] == str(
            good["tool_calls"][0]["arguments"]["a"] + good["tool_calls"][0]["arguments"]["b"])
        assert agent[-1]["message"].startswith("It is ")
        if recorded.failed_attempt:
            assert agent[0]["extra"]["rolled_back"] is True
            assert agent[0]["extra"]["attempt_failed"]["error_types"] == ["NameError"]
        else:
            assert all("rolled_back" not in s["extra"] for s in agent)
        assert doc["extra"]["reward"] == recorded.reward
        assert doc["extra"]["status"] == "completed"
        assert doc["final_metrics"]["total_steps"] == len(steps)
        assert doc["final_metrics"]["total_completion_tokens"] == sum(
            len(c.response_ids) for c in calls)
    best = _export(client, dataset, "atif", min_reward=1.0)
    assert [json.loads(line)["session_id"] for line in best.text.splitlines()] == [
        e.episode_id for e in finished if e.reward is not None and e.reward >= 1.0]


def test_atif_is_valid_for_harbor(client: TestClient, dataset: Dataset) -> None:
    """Harbor's own ATIF models accept every trajectory (skipped without ``harbor``)."""
    pytest.importorskip("harbor.models.trajectories")
    from harbor.models.trajectories import Trajectory

    for line in _export(client, dataset, "atif").text.splitlines():
        trajectory = Trajectory.model_validate(json.loads(line))
        assert trajectory.schema_version == "ATIF-v1.7"
        assert trajectory.final_metrics is not None
        assert trajectory.final_metrics.total_steps == len(trajectory.steps)


def test_sft_lines_above_the_reward_threshold(client: TestClient, dataset: Dataset) -> None:
    r = _export(client, dataset, "sft", min_reward=0.5)
    lines = [json.loads(line) for line in r.text.splitlines()]
    kept = [e for e in dataset.episodes if e.finished and (e.reward or 0) >= 0.5]
    assert [line["episode_id"] for line in lines] == [e.episode_id for e in kept]
    for line, recorded in zip(lines, kept, strict=True):
        assert line["tools"] == [ADD_TOOL]
        assert line["reward"] == recorded.reward
        messages = line["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[1]["tool_calls"][0]["function"]["name"] == "add"
        assert messages[2]["tool_call_id"] == messages[1]["tool_calls"][0]["id"]
        assert messages[3]["content"] == f"It is {messages[2]['content']}."
    # The failed, rolled-back call of the first episode is no line of its own.
    assert all(not any(c["function"]["arguments"].endswith("-1}")
                       for m in line["messages"] for c in m.get("tool_calls") or [])
               for line in lines)
    everything = _export(client, dataset, "sft")
    assert len(everything.text.splitlines()) == sum(e.finished for e in dataset.episodes)


def test_export_refuses_bad_requests(client: TestClient, dataset: Dataset,
                                     project: Project) -> None:
    headers = dataset.project.headers("read")
    url = f"/v1/runs/{dataset.run_id}/export"
    r = client.get(url, params={"format": "csv"}, headers=headers)
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert "format" in message
    for known in ("samples", "verl-prompts", "verl-batch", "atif", "sft"):
        assert known in message
    r = client.get(url, params={"format": "atif", "group_id": "g0"}, headers=headers)
    assert r.status_code == 422
    assert r.json()["error"]["message"] == ("format 'atif' does not take group_id (it takes: "
                                            "min_reward)")
    r = client.get(url, params={"format": "samples", "min_reward": 1}, headers=headers)
    assert r.status_code == 422 and "min_reward" in r.json()["error"]["message"]
    r = client.get(url, params={"format": "sft", "min_reward": "nan"}, headers=headers)
    assert r.status_code == 422 and "finite" in r.json()["error"]["message"]
    r = client.get(url, params={"format": "verl-batch", "pad_token_id": -1}, headers=headers)
    assert r.status_code == 422
    r = client.get(f"/v1/runs/{dataset.empty_run}/export", params={"format": "verl-batch"},
                   headers=headers)
    assert r.status_code == 404 and "has no rewarded samples" in r.json()["error"]["message"]
    r = client.get(url, params={"format": "verl-batch", "group_id": "nope"}, headers=headers)
    assert r.status_code == 404 and "matching the filters" in r.json()["error"]["message"]
    r = client.get("/v1/runs/no-such-run/export", params={"format": "atif"}, headers=headers)
    assert r.status_code in (403, 404)
    # Another project's key sees nothing of the run.
    r = client.get(url, params={"format": "sft"}, headers=project.headers("read"))
    assert r.status_code == 403
    # The old address still answers with the samples.
    r = client.get(f"/v1/runs/{dataset.run_id}/export.parquet", headers=headers)
    assert r.status_code == 200
    assert pq.read_table(io.BytesIO(r.content)).num_rows == len(_samples(client, dataset))


def test_cli_writes_each_format(cli: Any, dataset: Dataset, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "own.jsonl").write_text(json.dumps({
        "task_id": "own-task", "messages": [{"role": "user", "content": "What is 5 plus 6?"}],
        "tools": [ADD_TOOL], "ground_truth": "11", "reward": "final_answer"}) + "\n")
    out = tmp_path / "prompts.parquet"
    result = cli("--run", dataset.run_id, "--format", "verl-prompts", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (verl-prompts" in result.output
    rows = pq.read_table(out).to_pylist()
    truths = {r["extra_info"]["task_id"]: r["reward_model"] for r in rows}
    from workers.rollout.agent_tasks import builtin_task

    builtin = builtin_task("arith-0-0")
    assert builtin is not None
    assert truths["arith-0-0"] == {"style": "rule",
                                   "ground_truth": str(builtin.ground_truth)
                                   if isinstance(builtin.ground_truth, str)
                                   else json.dumps(builtin.ground_truth, sort_keys=True)}
    assert truths["own-task"] == {"style": "rule", "ground_truth": "11"}

    out = tmp_path / "batch.safetensors"
    result = cli("--run", dataset.run_id, "--format", "verl-batch", "-o", str(out),
                 "--pad-token-id", "7")
    assert result.exit_code == 0, result.output
    batch = load_file(out)
    assert batch["input_ids"].shape[0] >= 5 and (batch["input_ids"][batch["attention_mask"]
                                                                     == 0] == 7).all()

    for fmt in ("atif", "sft", "samples"):
        out = tmp_path / f"out.{fmt}"
        result = cli("--run", dataset.run_id, "--format", fmt, "-o", str(out))
        assert result.exit_code == 0, result.output
        assert out.stat().st_size > 0
    sft = [json.loads(line) for line in (tmp_path / "out.sft").read_text().splitlines()]
    assert len(sft) == 5

    out = tmp_path / "best.sft"
    result = cli("--run", dataset.run_id, "--format", "sft", "-o", str(out),
                 "--min-reward", "1")
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 3


def test_cli_refuses_bad_input(cli: Any, dataset: Dataset, tmp_path: Path) -> None:
    out = tmp_path / "x"
    result = cli("--run", dataset.run_id, "--format", "csv", "-o", str(out))
    assert result.exit_code == 2 and "csv" in result.output
    result = cli("--run", "no-such-run", "--format", "atif", "-o", str(out))
    assert result.exit_code == 1 and "no run 'no-such-run'" in result.output
    result = cli("--run", dataset.run_id, "--format", "samples", "-o", str(out),
                 "--min-reward", "1")
    assert result.exit_code == 2
    assert "format 'samples' does not take --min-reward (it takes: --group, --kind, --status)" \
        in " ".join(result.output.replace("│", " ").split())
    result = cli("--run", dataset.run_id, "--format", "atif", "-o",
                 str(tmp_path / "missing" / "x"))
    # Rich wraps the message in a box as wide as the terminal: a long temporary path moves
    # the words onto other lines, so compare the words, not the layout.
    assert result.exit_code == 2
    assert "does not exist" in " ".join(result.output.replace("│", " ").split())
    result = cli("--run", dataset.empty_run, "--format", "verl-batch", "-o", str(out),
                 "--pad-token-id", "0")
    assert result.exit_code == 1 and "has no rewarded samples" in result.output
    assert not out.exists() and not list(tmp_path.glob(".x.*"))


def test_verl_reads_the_prompts_and_the_batch(client: TestClient, dataset: Dataset, qwen3: Any,
                                              tmp_path: Path) -> None:
    """verl's own classes load both exports: ``RLHFDataset`` the prompt dataset, ``DataProto``
    the batch, and verl's GRPO advantage reads its scores, mask and uids."""
    pytest.importorskip("verl")
    import torch
    from omegaconf import OmegaConf
    from safetensors import safe_open
    from safetensors.torch import load_file
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.dataset.rl_dataset import RLHFDataset

    prompts = tmp_path / "prompts.parquet"
    prompts.write_bytes(_export(client, dataset, "verl-prompts").content)
    data = RLHFDataset(str(prompts), qwen3, OmegaConf.create({
        "max_prompt_length": 1024, "filter_overlong_prompts": True,
        "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "cache")}))
    assert len(data) == 3
    for index in range(3):
        item = data[index]
        assert item["index"] == index
        assert item["data_source"] == dataset.run_id
        assert item["raw_prompt"][0]["role"] == "user"
        assert "plus" in item["raw_prompt"][0]["content"]
        assert json.loads(item["extra_info"]["tools"]) == [ADD_TOOL]

    path = tmp_path / "batch.safetensors"
    path.write_bytes(_export(client, dataset, "verl-batch").content)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        uids = json.loads(f.metadata()["uids"])
    names = ("input_ids", "attention_mask", "position_ids", "prompts", "responses",
             "response_mask", "rollout_log_probs", "token_level_scores")
    batch = DataProto.from_dict(
        tensors={k: tensors[k] for k in names},
        non_tensors={"uid": np.array([uids[i] for i in tensors["uid"].tolist()],
                                     dtype=object)})
    assert len(batch) == tensors["input_ids"].shape[0]
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["token_level_scores"],
        response_mask=batch.batch["response_mask"], index=batch.non_tensor_batch["uid"])
    scores = tensors["token_level_scores"].sum(-1)
    groups = batch.non_tensor_batch["uid"]
    for i in range(len(batch)):
        same = torch.tensor([g == groups[i] for g in groups])
        if same.sum() > 1:
            expected = (scores[i] - scores[same].mean()) / (scores[same].std() + 1e-6)
        else:
            expected = scores[i]
        mask = batch.batch["response_mask"][i].bool()
        assert torch.allclose(advantages[i][mask], expected.expand(int(mask.sum())),
                              atol=1e-5)
        assert (advantages[i][~mask] == 0).all()


def test_a_project_streams_a_bounded_number_of_exports(client: TestClient, dataset: Dataset,
                                                      project: Project, qwen3: Any,
                                                      api_store: EventStore) -> None:
    """While a project streams ``TRAJSTORE_API_EXPORT_PROJECT_RUNNING`` exports (2), one more
    is a 429 naming the setting; another project's export passes; a place is free again once
    its export is read to the end, dropped unread, or refused."""
    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    headers = dataset.project.headers("read")
    url = f"/v1/runs/{dataset.run_id}/export"
    name = dataset.project.name
    # Two exports prepared and not yet read: what two clients reading slowly hold.
    streams = [exports_held(ctx, dataset), exports_held(ctx, dataset)]
    assert ctx.exports.running(name) == 2
    r = client.get(url, headers=headers)
    assert r.status_code == 429, r.text
    assert "TRAJSTORE_API_EXPORT_PROJECT_RUNNING" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "5"
    # Another project exports its own run meanwhile.
    theirs = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, theirs, project=project.name)
    episode_id = f"ep-{uuid.uuid4().hex[:6]}"
    api_store.append(episode_id, episode_events(qwen3, run_id=theirs, group_id="g0", a=1, b=2,
                                                reward=1.0), "no_stream")
    assert project_episode(api_store, episode_id).outcome == "written"
    r = client.get(f"/v1/runs/{theirs}/export", headers=project.headers("read"))
    assert r.status_code == 200 and pq.read_table(io.BytesIO(r.content)).num_rows == 1
    assert ctx.exports.running(project.name) == 0 and ctx.exports.running(name) == 2

    # One read to its end, one dropped unread: both places are free again.
    b"".join(streams.pop())
    assert ctx.exports.running(name) == 1
    streams.clear()
    gc.collect()
    assert ctx.exports.running(name) == 0
    r = client.get(url, headers=headers)
    assert r.status_code == 200 and pq.read_table(io.BytesIO(r.content)).num_rows > 0
    # A refused export (an option its format does not take) gives its place back.
    assert client.get(url, params={"format": "atif", "group_id": "g0"}, headers=headers
                      ).status_code == 422
    assert ctx.exports.running(name) == 0


def exports_held(ctx: Any, ds: Dataset) -> Held:
    """An export of ``ds``'s run prepared as the route prepares it, holding its place."""
    give_back = ctx.exports.take(ds.project.name, ctx.settings.api_export_project_running)
    made = exports.prepare(ctx.store, ds.run_id, "samples",
                           rows_per_group=ctx.settings.api_export_rows_per_group)
    return Held(made.chunks, give_back)
