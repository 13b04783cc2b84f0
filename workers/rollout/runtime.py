"""The rollout worker process's event loop: every group it plays, at once, on one engine.

A rollout worker runs Celery's thread pool (``rollout_groups`` threads: the most groups at
once). Each ``rollout_group`` task hands its group to the process's :class:`RolloutRuntime`,
whose event loop runs in one thread and plays the episodes of all groups concurrently: at most
``rollout_concurrency`` episodes in flight in the process, all sharing the process's engine,
which batches their requests. The task's thread waits for its group's result, so Celery's
acknowledgement, retries and redelivery work as before.

Policy updates while episodes are in flight: an episode finishes on the weights it started
with. A group needing other weights (a newer policy, another run) waits until the episodes
on the current weights have finished, then the weights are loaded and it starts; groups that
arrive for the current weights while another group waits for new ones queue behind it, so a
new policy is never starved. Every ``llm_called`` records the policy version that generated
it.

A run with ``rollout.continue_across_updates`` lets its episodes in flight take up a newer
policy of the run (:meth:`WeightsGate.calling`): before each LLM call the worker reads the
run's newest policy; when the engine holds an older version of the same run, the call waits
until no call is generating, the new weights are loaded, and every later call of every episode
on this engine is made with them. Weights of another run are never replaced that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from store.arguments import whole_number

__all__ = ["RolloutRuntime", "WeightsGate", "worker_runtime"]

T = TypeVar("T")

_lock = threading.Lock()
_runtime: RolloutRuntime | None = None


class WeightsGate:
    """Which weights the engine holds while groups play on it (module docstring).

    ``hold(target, load)`` is an async context manager: it waits until the engine holds
    ``target`` (calling ``load()`` in a thread, when no episode uses other weights) and keeps
    them while the block runs. ``load`` raising leaves the gate as it was and propagates.
    """

    def __init__(self) -> None:
        self.current: Any = None
        self.users = 0
        self.waiting_other = 0
        self.calls = 0
        self._condition = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, target: Any, load: Callable[[], None]) -> AsyncIterator[None]:
        async with self._condition:
            other = target != self.current
            if other:
                self.waiting_other += 1
            try:
                while True:
                    if target == self.current and not (self.waiting_other and not other):
                        break
                    if target != self.current and self.users == 0:
                        await asyncio.to_thread(load)
                        self.current = target
                        break
                    await self._condition.wait()
            finally:
                if other:
                    self.waiting_other -= 1
                    self._condition.notify_all()
            self.users += 1
        try:
            yield
        finally:
            async with self._condition:
                self.users -= 1
                self._condition.notify_all()

    @contextlib.asynccontextmanager
    async def calling(self, target: Any, load: Callable[[], None], *,
                      follows: Callable[[Any], bool]) -> AsyncIterator[None]:
        """One LLM call of an episode that continues across policy updates (module
        docstring), inside a :meth:`hold`: while the engine holds other weights than
        ``target`` that ``follows(current)`` says ``target`` replaces (an older version of
        the same run), wait until no call made through here is generating, then call
        ``load()`` in a thread and hold ``target``; the block runs with the call counted.
        ``load`` raising leaves the weights as they were and propagates."""
        async with self._condition:
            while target != self.current and follows(self.current):
                if self.calls == 0:
                    await asyncio.to_thread(load)
                    self.current = target
                    self._condition.notify_all()
                    break
                await self._condition.wait()
            self.calls += 1
        try:
            yield
        finally:
            async with self._condition:
                self.calls -= 1
                self._condition.notify_all()


class RolloutRuntime:
    """An event loop in a thread, a bound on episodes in flight and the weights gate.

    ``concurrency`` (>= 1) the most episodes in flight; raises ValueError otherwise.
    """

    def __init__(self, *, concurrency: int) -> None:
        whole_number("rollout_concurrency", concurrency)
        self.concurrency = concurrency
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop",
                                        daemon=True)
        self._thread.start()
        self.episodes: asyncio.Semaphore = self.call(self._semaphore)
        self.weights: WeightsGate = self.call(self._gate)

    async def _semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.concurrency)

    async def _gate(self) -> WeightsGate:
        return WeightsGate()

    def call(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the coroutine ``factory()`` on the runtime's loop and wait for its result (from
        any thread but the loop's own)."""
        return asyncio.run_coroutine_threadsafe(factory(), self.loop).result()

    def close(self) -> None:
        """Stop the loop (groups still playing are abandoned; redelivery completes them)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def worker_runtime(concurrency: int) -> RolloutRuntime:
    """The process's runtime (made on first use with ``concurrency`` episodes in flight)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = RolloutRuntime(concurrency=concurrency)
        return _runtime
