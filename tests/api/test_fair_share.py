"""The fair share of the API's time (``api.limits.FairShare``, ``store.shares.Shares``): while
the machine is busy, a project over its share of the process's request time waits before its
request is served, as long as its requests take on average (``API_SHARE_MAX_DELAY_S`` at
most), and then until the other projects' requests in flight are answered; a project alone,
a project within its share and every project on an idle machine are served at once.

The rule with explicit clocks; the wait for the others' requests with an ASGI app of requests
that end when the test says; and the real app on PostgreSQL, where a project sending requests
back to back waits and its neighbour does not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.limits import SHARE_MARGIN, SHARE_WINDOW_S, FairShare
from store.eventlog import EventStore
from store.settings import Settings
from store.shares import MIN_COST_S, Shares
from tests.api.conftest import Project, make_project
from tests.workers.conftest import wait_for


def _fair(max_delay_s: float = 0.25, busy: float = 1.0, busy_from: float = 0.5) -> FairShare:
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        return None

    return FairShare(inner, max_delay_s=max_delay_s, busy_from=busy_from, busy=lambda: busy)


def test_only_a_project_over_its_share_on_a_busy_machine_waits() -> None:
    fair = _fair()
    for _ in range(10):
        fair.shares.add("flood", 0.02)
    assert fair.delay_s("flood") == 0.0  # alone: nothing to give way to
    fair.shares.add("neighbour", 0.005)
    assert fair.delay_s("flood") == 0.0  # what it took alone is not held against it
    for _ in range(10):
        fair.shares.add("flood", 0.02)
    assert fair.delay_s("flood") == pytest.approx(0.02)  # its requests' mean time
    assert fair.delay_s("neighbour") == 0.0
    assert fair.delay_s("never-seen") == 0.0
    idle = _fair(busy=0.2)
    idle.shares.add("neighbour", 0.001)
    idle.shares.add("flood", 0.5)
    assert idle.delay_s("flood") == 0.0  # the machine has CPU to spare
    always = _fair(busy=0.0, busy_from=0.0)
    always.shares.add("neighbour", 0.001)
    always.shares.add("flood", 2.0)
    assert always.delay_s("flood") == 0.25  # at most API_SHARE_MAX_DELAY_S


def test_shares_decay_forget_idle_projects_and_charge_at_least_a_millisecond() -> None:
    s = Shares(SHARE_WINDOW_S, SHARE_MARGIN)
    s.add("neighbour", 0.0, now=0.0)  # costs MIN_COST_S
    s.add("flood", 1.0, now=0.0)
    assert s.mean_cost("neighbour") == MIN_COST_S
    assert s.over("flood", now=0.0) and s.projects(now=0.0) == 2
    assert s.projects(now=SHARE_WINDOW_S + 0.1) == 0  # both idle past the window
    s.add("flood", 1.0, now=SHARE_WINDOW_S + 0.2)
    assert not s.over("flood", now=SHARE_WINDOW_S + 0.2)  # alone again
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="window_s must be > 0"):
            Shares(bad, 1.25)
    with pytest.raises(ValueError, match="margin >= 1"):
        Shares(5, 0.9)


def test_a_project_is_over_its_share_only_while_a_neighbour_is_there() -> None:
    """Once the flood stops, the project that goes on is not held back against the flood's
    fading sum; it is once the flood comes back."""
    s = Shares(SHARE_WINDOW_S, SHARE_MARGIN, active_s=1.0)
    s.add("victim", 0.01, now=0.0)
    s.add("flood", 1.0, now=0.0)
    for t in range(1, 40):
        s.add("victim", 0.05, now=t / 10)
    assert not s.over("victim", now=3.9)  # the flood has been quiet for 3.9 s
    s.add("flood", 0.001, now=3.9)
    # The flood is back: what the victim took meanwhile, alone, is not held against it.
    assert not s.over("victim", now=3.9)
    for t in range(40, 50):
        s.add("victim", 0.05, now=t / 10)
        s.add("flood", 0.001, now=t / 10)
    assert s.over("victim", now=4.9)  # now it takes more than its share beside the flood
    with pytest.raises(ValueError, match="active_s must be > 0"):
        Shares(5, 1.25, active_s=0)


def test_bad_settings_of_the_middleware_are_refused() -> None:
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_delay_s must be a number of seconds"):
            _fair(max_delay_s=bad)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="busy_from must be a fraction from 0 to 1"):
            _fair(busy_from=bad)
    with pytest.raises(Exception, match="api_share_busy"):
        Settings(api_share_busy=2)
    with pytest.raises(Exception, match="api_share_max_delay_s"):
        Settings(api_share_max_delay_s=-1)


class _Keys:
    """The key lookup the middleware makes before a request is read: a token is its
    project's name here."""

    @staticmethod
    def trusted(token: str) -> Any:
        return SimpleNamespace(project=token)


def _scope(project: str) -> dict[str, Any]:
    ctx = SimpleNamespace(keys=_Keys(), local_key=None)
    return {"type": "http", "app": SimpleNamespace(state=SimpleNamespace(ctx=ctx)),
            "headers": [(b"authorization", f"Bearer {project}".encode())]}


def test_a_project_over_its_share_waits_for_the_others_requests_in_flight() -> None:
    """The neighbour's request is in flight when the flood's arrives: the flood's is served
    only once the neighbour's is answered."""
    order: list[str] = []

    async def main() -> None:
        release = asyncio.Event()

        async def inner(scope: Any, receive: Any, send: Any) -> None:
            project = scope["headers"][0][1].decode().split()[1]
            order.append(f"{project} starts")
            if project == "neighbour":
                await release.wait()
            order.append(f"{project} ends")

        fair = FairShare(inner, max_delay_s=30, busy_from=0.0)
        fair.shares.add("neighbour", 0.001)
        fair.shares.add("flood", 0.05)
        neighbour = asyncio.create_task(fair(_scope("neighbour"), None, None))
        await asyncio.sleep(0)
        flood = asyncio.create_task(fair(_scope("flood"), None, None))
        # Well past the flood's own delay (its mean time, 50 ms): it still waits.
        await asyncio.sleep(0.5)
        assert order == ["neighbour starts"]
        release.set()
        await asyncio.gather(neighbour, flood)
        assert fair.waits["flood"][0] == 1 and "neighbour" not in fair.waits

    asyncio.run(main())
    assert order == ["neighbour starts", "neighbour ends", "flood starts", "flood ends"]


def test_the_wait_for_the_others_ends_at_the_longest_delay() -> None:
    async def main() -> list[str]:
        order: list[str] = []
        never = asyncio.Event()

        async def inner(scope: Any, receive: Any, send: Any) -> None:
            project = scope["headers"][0][1].decode().split()[1]
            order.append(project)
            if project == "neighbour":
                await never.wait()

        fair = FairShare(inner, max_delay_s=0.2, busy_from=0.0)
        fair.shares.add("neighbour", 0.001)
        fair.shares.add("flood", 0.05)
        neighbour = asyncio.create_task(fair(_scope("neighbour"), None, None))
        await asyncio.sleep(0)
        await asyncio.wait_for(fair(_scope("flood"), None, None), 30)
        neighbour.cancel()
        return order

    assert asyncio.run(main()) == ["neighbour", "flood"]


@pytest.fixture
def fair_client(api_settings: Settings, api_store: EventStore) -> Iterator[TestClient]:
    settings = api_settings.model_copy(update={"api_share_busy": 0.0,
                                               "api_share_max_delay_s": 0.25})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def _middleware(client: TestClient) -> FairShare:
    layer: Any = client.app.middleware_stack  # type: ignore[attr-defined]
    while layer is not None and not isinstance(layer, FairShare):
        layer = getattr(layer, "app", None)
    assert layer is not None
    return layer


def _trusted(client: TestClient, *projects: Project) -> None:
    """A key's first request is checked by its route; once the process trusts the key (its
    key cache listens to PostgreSQL), it knows the project of the next ones before reading
    them (``api.keys.KeyStore.trusted``), and counts those."""
    keys = client.app.state.ctx.keys  # type: ignore[attr-defined]
    for p in projects:
        def trusted(p: Project = p) -> bool:
            return client.get("/v1/runs", headers=p.headers("read")).status_code == 200 \
                and keys.trusted(p.read) is not None

        wait_for(trusted, what=f"the key cache to trust {p.name}'s key")


def test_on_the_app_the_project_sending_back_to_back_waits_and_its_neighbour_does_not(
        fair_client: TestClient, key_store: Any) -> None:
    flood, neighbour = make_project(key_store), make_project(key_store)
    _trusted(fair_client, neighbour, flood)
    for _ in range(2):
        assert fair_client.get("/v1/runs", headers=neighbour.headers("read")).status_code == 200
    for _ in range(25):
        assert fair_client.get("/v1/runs", headers=flood.headers("read")).status_code == 200
    for _ in range(3):
        assert fair_client.get("/v1/runs", headers=neighbour.headers("read")).status_code == 200
    fair = _middleware(fair_client)
    assert fair.waits.get(flood.name, (0, 0.0))[0] > 0, fair.waits
    assert neighbour.name not in fair.waits


def test_on_the_app_a_project_alone_never_waits(fair_client: TestClient,
                                                key_store: Any) -> None:
    alone: Project = make_project(key_store)
    _trusted(fair_client, alone)
    for _ in range(25):
        assert fair_client.get("/v1/runs", headers=alone.headers("read")).status_code == 200
    assert _middleware(fair_client).waits == {}


def test_zero_turns_the_fair_share_off(api_settings: Settings, api_store: EventStore,
                                       key_store: Any) -> None:
    settings = api_settings.model_copy(update={"api_share_busy": 0.0,
                                               "api_share_max_delay_s": 0.0})
    flood, neighbour = make_project(key_store), make_project(key_store)
    with TestClient(create_app(settings, store=api_store)) as client:
        _trusted(client, neighbour, flood)
        for _ in range(2):
            client.get("/v1/runs", headers=neighbour.headers("read"))
        for _ in range(25):
            client.get("/v1/runs", headers=flood.headers("read"))
        assert _middleware(client).waits == {}


def test_a_request_is_charged_its_share_of_the_time_it_was_in_flight() -> None:
    """Two requests in flight together are each charged about half of that time; one alone
    the whole of it: a neighbour slowed by a flood beside it is charged for what it was
    served, not for the time the flood made it wait."""

    async def main() -> FairShare:
        async def inner(scope: Any, receive: Any, send: Any) -> None:
            await asyncio.sleep(0.3)

        fair = FairShare(inner, max_delay_s=0.25, busy_from=0.0)
        await asyncio.gather(fair(_scope("a"), None, None), fair(_scope("b"), None, None))
        await fair(_scope("c"), None, None)
        return fair

    fair = asyncio.run(main())
    a, b, c = (fair.shares.mean_cost(p) for p in "abc")
    assert a == pytest.approx(b, rel=0.3), (a, b)
    assert a + b == pytest.approx(c, rel=0.3) and a < 0.7 * c, (a, b, c)


def test_on_the_app_a_neighbour_that_had_the_api_alone_is_not_held_back_for_a_flood(
        fair_client: TestClient, key_store: Any) -> None:
    flood, neighbour = make_project(key_store), make_project(key_store)
    _trusted(fair_client, flood, neighbour)
    time.sleep(1.2)  # the flood's first requests are over a second old: the neighbour is alone
    for _ in range(25):
        assert fair_client.get("/v1/runs", headers=neighbour.headers("read")).status_code == 200
    for _ in range(15):
        for _ in range(3):
            assert fair_client.get("/v1/runs", headers=flood.headers("read")).status_code == 200
        assert fair_client.get("/v1/runs", headers=neighbour.headers("read")).status_code == 200
    fair = _middleware(fair_client)
    assert neighbour.name not in fair.waits, fair.waits
    assert fair.waits.get(flood.name, (0, 0.0))[0] > 0, fair.waits
