"""The cluster view: load pressure summed over all routers, and the directory of live workers.

Routers report their load a few times a second and get the whole view back in the same call, so no
request waits on it. Pressure = sequences per verify step summed over the cluster (running + waiting):
the tokens each target step must serve at k = 0, independent of the policy's own choice of k.

Worker replicas (draft and target) heartbeat from their health checks with the handles of the actors
that hold their models; a worker that stops heartbeating drops out after ``stale_after_s``. A restarted
replica registers under a new id, so routers never mistake it for the one that died.

An operator's policy change (``PUT /v1/admin/policy`` on any router) is kept here with a version number and
travels in the view, so every router switches within one report interval, not only the one that was asked.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def replica_tag() -> str:
    """This Serve replica's unique id (a random one outside Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:
        return uuid.uuid4().hex[:8]


@dataclass
class WorkerInfo:
    """One worker replica as routers see it."""

    kind: str  # "target" | "draft"
    worker_id: str
    actors: list[Any]  # target: its rank actors, rank 0 first; draft: [its draft actor]
    capacity: int  # sequences it can hold
    load: dict[str, float] = field(default_factory=dict)  # e.g. sequences held
    seen: float = 0.0


@dataclass
class ClusterView:
    pressure: float
    workers: dict[str, WorkerInfo]
    sources: dict[str, float]  # router id → its reported pressure
    departed: list[str] = field(default_factory=list)  # routers gone silent: their sequences are orphans
    policy: dict | None = None  # the operator's policy (PolicyConfig fields) when one was set, else None
    policy_version: int = 0  # bumped by each change, so a router applies each change once


DEPARTED_MEMORY_S = 600.0  # how long a silent router's id is announced (its orphans get freed meanwhile)


class ClusterMonitor:
    def __init__(self, stale_after_s: float = 5.0):
        self.stale_after_s = stale_after_s
        self.reports: dict[str, tuple[float, float]] = {}  # source → (pressure, when)
        self.workers: dict[str, WorkerInfo] = {}
        self.departed: dict[str, float] = {}  # source that went silent → when it was noticed
        self.policy: dict | None = None
        self.policy_version = 0

    def _prune(self, now: float) -> None:
        for source, (_, when) in self.reports.items():
            if now - when > self.stale_after_s:
                self.departed[source] = now
        self.departed = {k: t for k, t in self.departed.items() if now - t <= DEPARTED_MEMORY_S}
        self.reports = {k: v for k, v in self.reports.items() if now - v[1] <= self.stale_after_s}
        self.workers = {k: w for k, w in self.workers.items() if now - w.seen <= self.stale_after_s}

    def report(self, source: str, pressure: float) -> ClusterView:
        """Record ``source``'s current load; returns the cluster view (stale entries dropped)."""
        now = time.monotonic()
        self.reports[source] = (float(pressure), now)
        self.departed.pop(source, None)  # back after a long stall
        return self.view()

    def view(self) -> ClusterView:
        self._prune(time.monotonic())
        sources = {k: value for k, (value, _) in self.reports.items()}
        return ClusterView(sum(sources.values()), dict(self.workers), sources, sorted(self.departed), self.policy,
                           self.policy_version)

    def set_policy(self, policy: dict) -> int:
        """Make ``policy`` (PolicyConfig fields, validated by the router that was asked) every router's
        policy; returns its version."""
        self.policy = dict(policy)
        self.policy_version += 1
        return self.policy_version

    def total(self) -> float:
        return self.view().pressure

    def heartbeat(self, info: WorkerInfo) -> None:
        info.seen = time.monotonic()
        self.workers[info.worker_id] = info

    def check_health(self) -> None:
        return None
