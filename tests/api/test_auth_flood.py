"""Wrong secrets cannot starve the API: a refused key is refused again from memory (no row
read, no scrypt), a key id past its budget of wrong secrets gets 429 with Retry-After for
unknown secrets, and the right secret keeps working through a flood."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.app import create_app
from api.keys import KeyFailureBudgetExceeded, KeyStore
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project

ME = "/v1/keys/me"


def wrong(token: str, n: int) -> str:
    """``token`` with another secret of the same length (the same key id)."""
    secret = token[21:]
    return token[:21] + f"{n:06d}" + secret[6:]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def guarded(api_settings: Settings, api_store: EventStore) -> Iterator[TestClient]:
    settings = api_settings.model_copy(update={"api_key_failure_cache_s": 60.0,
                                               "api_key_failure_budget": 3})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def test_a_wrong_secret_is_401_and_then_refused_from_memory(
        api_settings: Settings, api_store: EventStore, project: Project) -> None:
    # The default scrypt cost, so that a hash is measurably slower than a refusal from memory.
    settings = api_settings.model_copy(update={"api_key_scrypt_n": 2**14,
                                               "api_key_failure_budget": 0})
    keys = KeyStore(api_store.db, settings)
    token = keys.create(project=project.name, role="read").token
    bad = wrong(token, 1)
    t0 = time.perf_counter()
    assert keys.verify(bad) is None
    hashed = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        assert keys.verify(bad) is None
    remembered = time.perf_counter() - t0
    assert remembered < hashed, (remembered, hashed)  # 20 refusals cost less than one hash
    assert keys.verify(token) is not None  # the right secret is untouched
    keys.close()


def test_the_answers_over_http(guarded: TestClient, key_store: KeyStore,
                               project: Project) -> None:
    token = key_store.create(project=project.name, role="read").token
    assert guarded.get(ME, headers=bearer(token)).status_code == 200
    statuses = []
    for n in range(8):
        r = guarded.get(ME, headers=bearer(wrong(token, n)))
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            body = r.json()["error"]
            assert body["code"] == "too_many_requests" and "retry after" in body["message"]
            assert token[21:] not in r.text
        else:
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    # Three wrong secrets are checked (401), then one a second while over budget (401) and
    # 429 for every other unknown secret of that key id.
    assert statuses[:3] == [401, 401, 401] and statuses[3] == 401
    assert 429 in statuses[4:] and set(statuses) == {401, 429}
    # The same wrong secret again: still refused, from memory (401, not 429).
    assert guarded.get(ME, headers=bearer(wrong(token, 0))).status_code == 401
    # The right secret is never refused by the budget.
    for _ in range(3):
        assert guarded.get(ME, headers=bearer(token)).status_code == 200
    # Other keys' wrong secrets are not this key id's business.
    other = key_store.create(project=project.name, role="read").token
    assert guarded.get(ME, headers=bearer(wrong(other, 1))).status_code == 401
    assert guarded.get(ME, headers=bearer(other)).status_code == 200


def test_a_right_secret_this_process_never_saw_gets_in_on_a_retry(
        api_settings: Settings, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    settings = api_settings.model_copy(update={"api_key_failure_cache_s": 60.0,
                                               "api_key_failure_budget": 2})
    keys = KeyStore(api_store.db, settings)
    token = key_store.create(project=project.name, role="read").token
    for n in range(2):
        assert keys.verify(wrong(token, n)) is None
    assert keys.verify(wrong(token, 2)) is None  # the one check allowed this second
    with pytest.raises(KeyFailureBudgetExceeded) as info:
        keys.verify(wrong(token, 3))
    assert 1 <= info.value.retry_after_s <= 60
    time.sleep(1.05)
    assert keys.verify(token) is not None  # checked, right, and remembered
    with pytest.raises(KeyFailureBudgetExceeded):
        keys.verify(wrong(token, 4))
    with pytest.raises(KeyFailureBudgetExceeded):
        keys.verify(wrong(token, 5))
    assert keys.verify(token) is not None  # no hash: this process knows it is right
    keys.close()


def test_the_right_secret_works_during_a_flood(guarded: TestClient, key_store: KeyStore,
                                               project: Project) -> None:
    token = key_store.create(project=project.name, role="read").token
    assert guarded.get(ME, headers=bearer(token)).status_code == 200
    stop = threading.Event()
    flood: list[int] = []

    def attack(base: int) -> None:
        n = base
        while not stop.is_set():
            flood.append(guarded.get(ME, headers=bearer(wrong(token, n))).status_code)
            n += 1

    threads = [threading.Thread(target=attack, args=(i * 100_000,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        legit = [guarded.get(ME, headers=bearer(token)).status_code for _ in range(30)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert legit == [200] * 30
    assert set(flood) <= {401, 429} and 429 in flood


def test_without_protection_every_wrong_secret_is_checked(
        api_settings: Settings, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    settings = api_settings.model_copy(update={"api_key_failure_cache_s": 0.0,
                                               "api_key_failure_budget": 0})
    token = key_store.create(project=project.name, role="read").token
    with TestClient(create_app(settings, store=api_store)) as c:
        assert {c.get(ME, headers=bearer(wrong(token, n % 3))).status_code
                for n in range(12)} == {401}
        assert c.get(ME, headers=bearer(token)).status_code == 200
    assert settings.api_key_failure_cache_s == 0


@pytest.mark.parametrize(("env", "value"), [
    ("TRAJSTORE_API_KEY_FAILURE_CACHE_S", "-1"),
    ("TRAJSTORE_API_KEY_FAILURE_CACHE_S", "nan"),
    ("TRAJSTORE_API_KEY_FAILURE_CACHE_S", "86401"),
    ("TRAJSTORE_API_KEY_FAILURE_BUDGET", "-1"),
    ("TRAJSTORE_API_KEY_FAILURE_BUDGET", "2.5"),
    ("TRAJSTORE_API_KEY_FAILURE_BUDGET", "many"),
])
def test_bad_settings_are_refused_naming_them(monkeypatch: pytest.MonkeyPatch, env: str,
                                              value: Any) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert env.removeprefix("TRAJSTORE_").lower() in str(info.value)


def test_settings_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJSTORE_API_KEY_FAILURE_CACHE_S", "5")
    monkeypatch.setenv("TRAJSTORE_API_KEY_FAILURE_BUDGET", "7")
    s = Settings()
    assert (s.api_key_failure_cache_s, s.api_key_failure_budget) == (5.0, 7)


def test_a_flood_from_one_source_never_throttles_another_source(
        api_settings: Settings, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    """The budget is per key id and source address: a wrong-secret flood from one address
    leaves the right secret, never seen by this process, checked at once from another."""
    settings = api_settings.model_copy(update={"api_key_failure_cache_s": 60.0,
                                               "api_key_failure_budget": 3})
    token = key_store.create(project=project.name, role="read").token
    attacker = TestClient(create_app(settings, store=api_store), client=("203.0.113.9", 4000))
    with attacker, TestClient(attacker.app, client=("198.51.100.7", 5000)) as victim:
        flood = [attacker.get(ME, headers=bearer(wrong(token, n))).status_code
                 for n in range(24)]
        assert flood.count(429) >= 20  # the flooding source is throttled
        # The right secret from another address: in at the first try.
        assert victim.get(ME, headers=bearer(token)).status_code == 200
        # A wrong secret from that address is checked (401), not throttled by the flood.
        assert victim.get(ME, headers=bearer(wrong(token, 99))).status_code == 401
        # The flooding address stays throttled for unknown secrets...
        assert attacker.get(ME, headers=bearer(wrong(token, 100))).status_code == 429
        # ...but the right secret, now known right to this process, gets in from it too.
        assert attacker.get(ME, headers=bearer(token)).status_code == 200


def test_the_budget_is_kept_per_source_in_the_key_store(
        api_settings: Settings, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    settings = api_settings.model_copy(update={"api_key_failure_cache_s": 60.0,
                                               "api_key_failure_budget": 2})
    keys = KeyStore(api_store.db, settings)
    token = key_store.create(project=project.name, role="read").token
    for n in range(3):
        assert keys.verify(wrong(token, n), "10.0.0.1") is None
    with pytest.raises(KeyFailureBudgetExceeded):
        keys.verify(wrong(token, 3), "10.0.0.1")
    with pytest.raises(KeyFailureBudgetExceeded):
        keys.refused(wrong(token, 4), "10.0.0.1")
    assert keys.refused(token, "10.0.0.2") is False
    assert keys.verify(token, "10.0.0.2") is not None
    keys.close()
