"""A run's max_in_flight across processes, in a real Redis: never more slots held than the
bound however many holders race, a killed holder's slot freed after hold_s, an unreachable
broker leaves the rollout to its process's bound, and bad arguments are named."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from store.settings import Settings
from tests.workers.conftest import broker_url  # noqa: F401  (fixture)
from workers.rollout.run_slots import run_slot, slots_in_use


@pytest.fixture
def settings(broker_url: str, tmp_path: Path) -> Settings:  # noqa: F811
    return Settings(redis_url=broker_url, data_dir=tmp_path)


def test_holders_never_exceed_the_bound(settings: Settings) -> None:
    held: list[int] = []
    now = 0

    async def rollout(i: int) -> None:
        nonlocal now
        # Each holder opens its own connection's worth of waiting: the bound is Redis's.
        async with run_slot(settings, "run-a", 3, poll_s=0.01) as took:
            assert took
            now += 1
            held.append(now)
            await asyncio.sleep(0.05)
            now -= 1

    async def main() -> None:
        await asyncio.gather(*(rollout(i) for i in range(12)))

    asyncio.run(main())
    assert len(held) == 12 and max(held) == 3
    assert slots_in_use(settings, "run-a") == 0  # every slot given back
    # Another run's bound is its own.
    assert slots_in_use(settings, "run-b") == 0


def test_a_killed_holders_slot_frees_itself(settings: Settings, tmp_path: Path) -> None:
    held = tmp_path / "held"
    script = textwrap.dedent(f"""
        import asyncio, pathlib, sys
        sys.path.insert(0, {str(Path.cwd())!r})
        from store.settings import Settings
        from workers.rollout.run_slots import run_slot

        async def main():
            settings = Settings(redis_url={settings.redis_url!r}, data_dir={str(tmp_path)!r})
            async with run_slot(settings, "run-k", 1, hold_s=1.5):
                pathlib.Path({str(held)!r}).write_text("yes")
                await asyncio.sleep(600)

        asyncio.run(main())
    """)
    holder = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.exists()
        time.sleep(2.0)  # renewed while it lives: still held past hold_s
        assert slots_in_use(settings, "run-k") == 1
    finally:
        holder.kill()
        holder.wait()
    killed = time.monotonic()

    async def take() -> float:
        async with run_slot(settings, "run-k", 1, poll_s=0.05) as took:
            assert took
            return time.monotonic() - killed

    waited = asyncio.run(take())
    assert waited < 1.5 + 2.0, waited  # hold_s after the last renewal, with slack


def test_an_unreachable_broker_leaves_the_process_bound(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    gone = Settings(redis_url="redis://127.0.0.1:1/0", data_dir=tmp_path)

    async def play() -> bool:
        async with run_slot(gone, "run-x", 2) as took:
            return took

    assert asyncio.run(play()) is False
    assert "could not be reached for a slot of max_in_flight" in caplog.text


@pytest.mark.parametrize(("kwargs", "name"), [({"limit": 0}, "limit"),
                                              ({"limit": True}, "limit"),
                                              ({"limit": 2, "hold_s": 0}, "hold_s"),
                                              ({"limit": 2, "poll_s": -1.0}, "poll_s")])
def test_bad_arguments_are_named(settings: Settings, kwargs: dict, name: str) -> None:
    async def play() -> None:
        async with run_slot(settings, "run-z", **kwargs):
            pass

    with pytest.raises((ValueError, TypeError), match=name):
        asyncio.run(play())
