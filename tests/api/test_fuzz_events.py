"""Property tests over event payloads sent to the REST events route: strings with NUL and
lone surrogates, deep nesting, non-finite and huge numbers, booleans where numbers go.

For every input the answer is either a 4xx whose error names a field, or a stored event
that reads back identically through the episode read route; never a 5xx, and the listings
(runs, episodes, the episode itself) keep answering 200 afterwards."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.conftest import Project
from tests.api.test_ingest import create_run, start_episode

FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

_BAD = st.sampled_from(["", "", "", "\x00", "\ud800", "\udfff", "a\x00", "\U0001f600"])
text = st.builds(lambda a, b, c: a + b + c, st.text(max_size=6), _BAD, st.text(max_size=6))
keys = st.one_of(st.text(max_size=6), text)
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63 - 1, 2**63, -(2**63) + 1, -(2**63), 2**64, 1e308, -1e-320]),
    st.booleans(),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=12,
)


def nest(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


deep = st.builds(nest, st.integers(min_value=55, max_value=80), scalars)
free_form = st.one_of(st.dictionaries(keys, json_values, max_size=4),
                      st.builds(lambda v: {"deep": v}, deep),
                      st.builds(lambda v: {"n": [v]}, numbers))

tool_returned = st.fixed_dictionaries({
    "type": st.just("tool_returned"), "name": text, "output": text,
    "arguments": free_form,
}, optional={"duration_ms": numbers, "error_type": text, "is_error": st.booleans()})
checkpoint = st.fixed_dictionaries({
    "type": st.just("checkpoint_created"), "checkpoint_id": text,
    "position_key": st.just("turn_1"), "retry_count": st.one_of(numbers, st.just(1)),
})
reward = st.fixed_dictionaries({
    "type": st.just("reward_assigned"), "value": numbers,
}, optional={"components": st.dictionaries(keys, numbers, max_size=3), "source": text})
logprob = st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=True),
                    st.sampled_from([-1e39, -3.4e38, -1e-45, -0.0, -math.inf, math.nan]))
llm_called = st.builds(
    lambda lps, response, messages: {
        "type": "llm_called", "call_id": uuid.uuid4().hex, "prompt_ids": [1, 2, 3],
        "response_ids": list(range(7, 7 + len(lps))), "logprobs": lps,
        "response": response, "messages": messages,
    },
    st.lists(logprob, min_size=1, max_size=4), free_form,
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": text}), max_size=2),
)
events = st.one_of(tool_returned, checkpoint, reward, llm_called)


@pytest.fixture
def episode(client: TestClient, project: Project) -> tuple[str, str]:
    run_id = create_run(client, project)
    return run_id, start_episode(client, project, run_id)


def same_json(sent: Any, got: Any) -> bool:
    """Whether ``got`` is what a JSON round trip of ``sent`` gives (an integer sent for a
    number field of the schema comes back as the equal float)."""
    if (isinstance(sent, int | float) and not isinstance(sent, bool)
            and isinstance(got, float)):
        return float(sent) == got
    if isinstance(sent, dict):
        return (isinstance(got, dict) and sent.keys() == got.keys()
                and all(same_json(v, got[k]) for k, v in sent.items()))
    if isinstance(sent, list):
        return (isinstance(got, list) and len(sent) == len(got)
                and all(same_json(a, b) for a, b in zip(sent, got, strict=True)))
    return type(sent) is type(got) and sent == got


def check_readable(client: TestClient, project: Project, run_id: str, episode_id: str) -> Any:
    read = project.headers("read")
    assert client.get("/v1/runs", headers=read).status_code == 200
    listing = client.get("/v1/episodes", params={"run_id": run_id}, headers=read)
    assert listing.status_code == 200, listing.text
    detail = client.get(f"/v1/episodes/{episode_id}", headers=read)
    assert detail.status_code == 200, detail.text
    return detail.json()


def post_event(client: TestClient, project: Project, episode_id: str,
               event: dict[str, Any]) -> Any:
    # Python's JSON writer escapes lone surrogates and writes NaN/Infinity as the server's
    # parser reads them: the body carries exactly the hostile value.
    body = json.dumps({"expected_version": "any", "events": [event]})
    return client.post(f"/v1/episodes/{episode_id}/events", content=body.encode(),
                       headers={**project.headers("ingest"),
                                "Content-Type": "application/json"})


def test_every_event_is_refused_naming_a_field_or_reads_back_identically(
        client: TestClient, project: Project, episode: tuple[str, str]) -> None:
    run_id, episode_id = episode
    seen = {"stored": 0, "refused": 0}

    @FUZZ
    @given(event=events)
    def check(event: dict[str, Any]) -> None:
        event = {**event, "event_id": str(uuid.uuid4())}
        r = post_event(client, project, episode_id, event)
        assert r.status_code < 500, (r.status_code, r.text[:500])
        if r.status_code != 200:
            assert 400 <= r.status_code < 500
            error = r.json()["error"]
            assert error.get("field"), error
            seen["refused"] += 1
        else:
            seen["stored"] += 1
        detail = check_readable(client, project, run_id, episode_id)
        if r.status_code != 200:
            assert event["event_id"] not in {e["event_id"] for e in detail["events"]}
            return
        (stored,) = [e for e in detail["events"] if e["event_id"] == event["event_id"]]
        for name, value in event.items():
            if name in ("type", "event_id", "prompt_ids", "response_ids", "logprobs"):
                continue
            assert same_json(value, stored["data"][name]), (name, value, stored["data"][name])
        if event["type"] == "llm_called":
            sent = np.asarray(event["logprobs"], dtype=np.float32)
            assert np.array_equal(sent, np.asarray(stored["tokens"]["logprobs"],
                                                   dtype=np.float32))

    check()
    # Both outcomes occurred: the strategies reach the store's rules and its happy path.
    assert seen["stored"] > 0 and seen["refused"] > 0, seen


@FUZZ
@given(name=text, config_value=st.one_of(st.just(0.5), json_values),
       group_size=st.one_of(st.just(2), numbers))
def test_runs_are_refused_naming_a_field_or_listed(client: TestClient, project: Project,
                                                   name: str, config_value: Any,
                                                   group_size: Any) -> None:
    run_id = f"fz-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"run_id": run_id, "config": {
        "model": name, "chat_template": name, "group_size": group_size,
        "rollout": {"temperature": config_value}}})
    r = client.post("/v1/runs", content=body.encode(), headers={
        **project.headers("ingest"), "Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 201:
        assert r.json()["error"].get("field"), r.text
    runs = client.get("/v1/runs", headers=project.headers("read"))
    assert runs.status_code == 200, runs.text
    listed = {x["run_id"]: x for x in runs.json()["runs"]}
    assert (run_id in listed) == (r.status_code == 201)
    if r.status_code == 201:
        assert listed[run_id]["config"]["model"] == name
