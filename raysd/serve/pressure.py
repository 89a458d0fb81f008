"""Cluster-wide pressure: every router reports its load; every router reads the sum.

Routers report from a background task a few times a second and read the total in the same call, so no
request waits on it. Pressure = sequences per verify step summed over the cluster (running + waiting):
the number of tokens each target step must serve at k = 0, independent of the policy's own choice of k.
"""

from __future__ import annotations

import time


class PressureMonitor:
    def __init__(self, stale_after_s: float = 5.0):
        self.stale_after_s = stale_after_s
        self.reports: dict[str, tuple[float, float]] = {}  # source → (pressure, when)

    def report(self, source: str, pressure: float) -> float:
        """Record ``source``'s current load; returns the cluster total (stale sources dropped)."""
        now = time.monotonic()
        self.reports[source] = (float(pressure), now)
        self.reports = {k: v for k, v in self.reports.items() if now - v[1] <= self.stale_after_s}
        return sum(value for value, _ in self.reports.values())

    def total(self) -> float:
        now = time.monotonic()
        return sum(value for value, when in self.reports.values() if now - when <= self.stale_after_s)

    def check_health(self) -> None:
        return None
