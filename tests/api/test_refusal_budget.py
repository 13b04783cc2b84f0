"""The refusal budget (``api.limits.RefusalBudget``): a project whose requests a limit refused
``API_REFUSAL_BUDGET`` times within ``API_REFUSAL_WINDOW_S`` is answered 429 at once, naming
the setting, without its body being read, until the window has passed; another project is
served meanwhile. Through a running ``trajstore serve`` and the real PostgreSQL."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from tests.api.conftest import Project, Server

MAX_BODY = 2 * 1024 * 1024


def _oversized(server: Server, project: Project) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/episodes/ep-{uuid.uuid4().hex[:8]}/events",
                      content=b"x" * (MAX_BODY + 1), timeout=30,
                      headers={**project.headers("ingest"), "Content-Type": "application/json"})


def _raw_answer(server: Server, project: Project, *, chunked: bool) -> tuple[bytes, float]:
    """The status line of an ingest request whose headers announce a body that is never sent
    (1 MiB by Content-Length, or chunked), and how long it took: answered without waiting for
    the body only when the server does not read it."""
    token = project.headers("ingest")["Authorization"]
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: 1048576"
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        started = time.perf_counter()
        s.sendall(b"POST /v1/episodes/ep-raw/events HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nAuthorization: " + token.encode() +
                  b"\r\n" + framing + b"\r\n\r\n")
        answer = s.recv(65536)
        return answer.split(b"\r\n", 1)[0], time.perf_counter() - started


@pytest.mark.timeout(120)
def test_a_project_over_its_refusal_budget_is_answered_429_unread(
        start_server: Callable[..., Server], project: Project, other_project: Project
) -> None:
    server = start_server(TRAJSTORE_API_REFUSAL_BUDGET="3", TRAJSTORE_API_REFUSAL_WINDOW_S="3",
                          TRAJSTORE_API_MAX_REQUEST_BYTES=str(MAX_BODY))
    # The key is checked at the first refusal (no route saw it: the size limit answered).
    for _ in range(3):
        assert _oversized(server, project).status_code == 413
    started = time.monotonic()
    refused = _oversized(server, project)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert "TRAJSTORE_API_REFUSAL_BUDGET" in error["message"] and error["limit"] == 3
    assert 1 <= int(refused.headers["Retry-After"]) <= 3
    # Every request of the project is refused so, its body unread: a chunked body that never
    # comes, or a declared one within the size limit, is answered at once.
    for chunked in (True, False):
        status, took = _raw_answer(server, project, chunked=chunked)
        assert status.endswith(b"429 Too Many Requests"), status
        assert took < 5
    # The other project is served meanwhile.
    assert httpx.get(f"{server.url}/v1/runs", headers=other_project.headers("read"),
                     timeout=30).status_code == 200
    assert _oversized(server, other_project).status_code == 413
    # Once the window has passed, the project is served again.
    time.sleep(max(0.0, 3.2 - (time.monotonic() - started)))
    assert httpx.get(f"{server.url}/v1/runs", headers=project.headers("read"),
                     timeout=30).status_code == 200


@pytest.mark.timeout(120)
def test_with_the_budget_off_every_refusal_is_by_its_limit(
        start_server: Callable[..., Server], project: Project) -> None:
    server = start_server(TRAJSTORE_API_REFUSAL_BUDGET="0",
                          TRAJSTORE_API_MAX_REQUEST_BYTES=str(MAX_BODY))
    assert httpx.get(f"{server.url}/v1/runs", headers=project.headers("read"),
                     timeout=30).status_code == 200
    assert [_oversized(server, project).status_code for _ in range(8)] == [413] * 8
