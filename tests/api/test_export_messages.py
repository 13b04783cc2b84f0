"""Exports of episodes recorded without token ids (OTLP spans, a gateway in front of a
server that returns none): the SFT export is made from the messages alone; an export that
selects nothing says so and fails; files are written with the usual permissions."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.otlp.ingest import default_run
from tests.api.conftest import Project
from tests.api.test_otlp import T0, agent_spans, export, json_episode, json_span, post


def _otlp_run(client: TestClient, project: Project) -> tuple[str, list[str]]:
    """Two episodes captured through OTLP (messages, no token ids) in one run."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    run = f"run-{uuid.uuid4().hex[:8]}"
    episodes = [f"conv-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    for episode in episodes:
        spans = agent_spans(episode, run).get_finished_spans()
        body = encode_spans(spans).SerializeToString()
        answer = post(client, project, body, content_type="application/x-protobuf")
        assert answer.status_code == 200, answer.text
    return run, episodes


def _merging_episode(episode: str, run: str) -> dict[str, Any]:
    """OTLP JSON of two chats where the second's input is the first's history (its input,
    its tool call, the tool's answer): one timeline once merged."""
    trace, root, first, tool, second = (uuid.uuid4().hex[:16] for _ in range(5))
    trace = uuid.uuid4().hex
    asked = [{"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
             {"role": "user", "parts": [{"type": "text", "content": "2+3?"}]}]
    call = {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "calc",
                                            "arguments": {"expr": "2+3"}}]}
    answered = [*asked, call, {"role": "tool", "parts": [
        {"type": "tool_call_response", "id": "c1", "response": "5"}]}]
    return export(
        json_span(trace, root, "invoke_agent a", T0, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "calc-agent",
            "gen_ai.conversation.id": episode, "trajstore.run_id": run},
            end=T0 + 9_000_000),
        json_span(trace, first, "chat m", T0 + 1_000_000, {
            "gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(asked),
            "gen_ai.output.messages": json.dumps([{**call, "finish_reason": "tool_calls"}])},
            parent=root),
        json_span(trace, tool, "execute_tool calc", T0 + 2_000_000, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc",
            "gen_ai.tool.call.id": "c1", "gen_ai.tool.call.arguments": '{"expr": "2+3"}',
            "gen_ai.tool.call.result": "5"}, parent=root),
        json_span(trace, second, "chat m", T0 + 3_000_000, {
            "gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(answered),
            "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                {"type": "text", "content": "It is 5."}], "finish_reason": "stop"}])},
            parent=root))


def test_sft_from_messages_alone(client: TestClient, project: Project) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    episodes = [f"conv-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    for episode in episodes:
        body = json.dumps(_merging_episode(episode, run)).encode()
        answer = post(client, project, body, content_type="application/json")
        assert answer.status_code == 200, answer.text
    r = client.get(f"/v1/runs/{run}/export", params={"format": "sft"},
                   headers=project.headers("read"))
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    # One line per episode: the first call's history is a prefix of the second's, so it
    # merges into it, as replay merges timelines at text level.
    assert sorted(line["episode_id"] for line in lines) == sorted(episodes)
    line = lines[0]
    assert [m["role"] for m in line["messages"]] == ["system", "user", "assistant", "tool",
                                                     "assistant"]
    assert line["messages"][2]["tool_calls"][0]["function"]["name"] == "calc"
    assert line["messages"][-1]["content"] == "It is 5."
    assert line["status"] == "completed" and line["agent"] == "calc-agent"


def test_sft_keeps_histories_that_fork(client: TestClient, project: Project) -> None:
    """The instrumented agent's second chat leaves out the system prompt its first one sent:
    the two histories fork at the first message, so each is a line (replay would keep both
    timelines too)."""
    run, episodes = _otlp_run(client, project)
    r = client.get(f"/v1/runs/{run}/export", params={"format": "sft"},
                   headers=project.headers("read"))
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert sorted(line["episode_id"] for line in lines) == sorted(episodes * 2)
    first, second = (line for line in lines if line["episode_id"] == episodes[0])
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "tool",
                                                       "assistant"]
    assert second["messages"][-1]["content"] == "I could not count them."
    assert first["reward"] == 0.25


def test_an_export_that_selects_nothing_says_so(client: TestClient, project: Project,
                                                cli: Any, tmp_path: Path) -> None:
    run, _ = _otlp_run(client, project)
    r = client.get(f"/v1/runs/{run}/export", params={"format": "sft", "min_reward": 0.5},
                   headers=project.headers("read"))
    assert r.status_code == 404, r.text
    assert "no finished episode with reward >= 0.5" in r.json()["error"]["message"]
    out = tmp_path / "none.jsonl"
    result = cli("--run", run, "--format", "sft", "-o", str(out), "--min-reward", "0.5")
    assert result.exit_code == 1, result.output
    assert "no finished episode with reward >= 0.5" in result.output
    assert not out.exists()
    # Samples: OTLP without token ids makes none; said the same way.
    result = cli("--run", run, "--format", "samples", "-o", str(out))
    assert result.exit_code == 1 and "has no samples" in result.output, result.output
    assert not out.exists() and not list(tmp_path.glob(".none.jsonl.*"))


def test_exports_are_written_with_the_usual_permissions(client: TestClient, project: Project,
                                                        cli: Any, tmp_path: Path) -> None:
    run, _ = _otlp_run(client, project)
    out = tmp_path / "run.sft.jsonl"
    umask = os.umask(0o022)
    try:
        result = cli("--run", run, "--format", "sft", "-o", str(out))
    finally:
        os.umask(umask)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert len(out.read_text().splitlines()) == 4


def test_sft_of_a_default_run_captured_by_json_spans(client: TestClient,
                                                     project: Project) -> None:
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    body = json.dumps(json_episode(episode)).encode()
    assert post(client, project, body, content_type="application/json").status_code == 200
    r = client.get(f"/v1/runs/{default_run(project.name)}/export", params={"format": "sft"},
                   headers=project.headers("read"))
    assert r.status_code == 200, r.text
    mine = [json.loads(line) for line in r.text.splitlines()
            if json.loads(line)["episode_id"] == episode]
    assert len(mine) == 1
    assert [m["role"] for m in mine[0]["messages"]] == ["user", "assistant"]
