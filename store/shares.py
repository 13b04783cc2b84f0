"""Each project's share of a shared resource lately, to tell which project takes more than
its share (``Shares``): the replay worker's CPU (``workers.replay.jobs.shares``) and the API's
time (``api.limits.FairShare``).

A project's use is an exponentially decayed sum of what its work cost (seconds), with the
time constant ``window_s``; a project that used nothing for ``window_s`` seconds is forgotten.
A project is *over its share* when another project used the resource within the last
``active_s`` seconds (a neighbour is there now) and its sum exceeds ``margin`` times the mean
of the sums of the projects used within the window. A project alone, or one whose neighbours
have gone quiet, is never over its share, so a rule built on it leaves nothing idle.

Use while nobody else wanted the resource is not charged: a project's work counts toward its
sum only while another project used the resource within the last ``active_s`` seconds.
Otherwise a neighbour that had the resource to itself a moment ago would be over its share
the moment a flood arrived, and held back for the flood. Each step costs O(1) (amortized)
whatever the number of projects.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

__all__ = ["MIN_COST_S", "Shares"]

#: What one piece of work is charged at least (seconds): no work is free, so a project that
#: sends many cheap ones is seen.
MIN_COST_S = 0.001


def _last_two(used: OrderedDict[str, tuple[float, float, float, float]]) -> list[str]:
    found = []
    for project in reversed(used):
        found.append(project)
        if len(found) == 2:
            break
    return found


class Shares:
    """Decayed use per project (module docstring). Thread-safe. Raises ValueError when
    ``window_s`` or ``active_s`` is not a positive finite number, or ``margin`` is below
    1."""

    def __init__(self, window_s: float, margin: float, active_s: float = 1.0) -> None:
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s)
                and window_s > 0) or not (isinstance(margin, (int, float))
                                          and math.isfinite(margin) and margin >= 1):
            raise ValueError(f"window_s must be > 0 and margin >= 1, got {window_s!r}, "
                             f"{margin!r}")
        if not (isinstance(active_s, (int, float)) and math.isfinite(active_s)
                and active_s > 0):
            raise ValueError(f"active_s must be > 0, got {active_s!r}")
        self.window_s = float(window_s)
        self.margin = float(margin)
        self.active_s = float(active_s)
        #: project -> (decayed sum, decayed count, time they were decayed to, decayed cost
        #: of its own work: the sum less the credit it came in with), the project used
        #: longest ago first.
        self._used: OrderedDict[str, tuple[float, float, float, float]] = OrderedDict()
        self._total = 0.0
        self._total_at = 0.0
        self._lock = threading.Lock()

    def _decay(self, at: float, now: float) -> float:
        return math.exp(-max(0.0, now - at) / self.window_s)

    def _advance(self, now: float) -> None:
        """Decay the total to ``now`` and forget the projects idle past the window."""
        self._total *= self._decay(self._total_at, now)
        self._total_at = max(self._total_at, now)
        while self._used:
            project, (cost, _, at, _) = next(iter(self._used.items()))
            if now - at <= self.window_s:
                break
            del self._used[project]
            self._total = max(0.0, self._total - cost * self._decay(at, now))
        if not self._used:
            self._total = 0.0

    def add(self, project: str, cost_s: float, *, now: float | None = None) -> None:
        """Charge ``project`` ``cost_s`` seconds (at least ``MIN_COST_S``; a negative or
        non-finite cost, a clock gone back, is charged that)."""
        now = time.monotonic() if now is None else now
        cost_s = float(cost_s)
        cost_s = cost_s if math.isfinite(cost_s) and cost_s > MIN_COST_S else MIN_COST_S
        with self._lock:
            self._advance(now)
            cost, count, at, own = self._used.pop(project, (0.0, 0.0, now, 0.0))
            keep = self._decay(at, now)
            # Charged only while a neighbour is there (module docstring).
            charged = cost_s if self._neighbour_since(project, now - self.active_s) else 0.0
            self._used[project] = (cost * keep + charged, count * keep + 1.0, now,
                                   own * keep + cost_s)
            self._total += charged

    def over(self, project: str, *, now: float | None = None) -> bool:
        """Whether ``project`` is over its share now (module docstring)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._advance(now)
            found = self._used.get(project)
            if found is None or len(self._used) < 2 or not self._neighbour_since(
                    project, now - self.active_s):
                return False
            cost = found[0] * self._decay(found[2], now)
            return cost > self.margin * self._total / len(self._used)

    def _neighbour_since(self, project: str, since: float) -> bool:
        """Whether a project other than ``project`` used the resource at ``since`` or
        later (the two used last: the dict is in the order of last use)."""
        for other in _last_two(self._used):
            if other != project:
                return self._used[other][2] >= since
        return False

    def mean_cost(self, project: str) -> float:
        """The decayed mean cost of ``project``'s work lately (seconds; 0.0 when it has
        none)."""
        with self._lock:
            found = self._used.get(project)
        return found[3] / found[1] if found is not None and found[1] > 0 else 0.0

    def projects(self, *, now: float | None = None) -> int:
        """How many projects used the resource within the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._advance(now)
            return len(self._used)
