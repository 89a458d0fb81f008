"""The router's view of the workers it can use, and which sequence lives where.

A sequence is pinned to one target group (its KV cache lives there) and one draft actor for its life;
new sequences go to the least-loaded live worker with room. The view is refreshed from the cluster
monitor; a worker that fails a call is dropped at once and never re-adopted under the same id (a replaced
replica registers under a new one). Losing a draft actor moves its sequences to another draft (which
re-prefills lazily) or leaves them undrafted; losing a target group loses its sequences' caches.

Only a failed call proves a worker dead. One that merely drops out of the monitor's view (a replaced monitor
that has not heard from it yet, missed heartbeats during a redeploy) is *unlisted*: it takes no new sequences
but keeps serving the ones pinned to it — every round calls it, with a timeout, so a worker that is really
gone is found within a round — and is forgotten once it holds none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raysd.serve.cluster import WorkerInfo


@dataclass
class Worker:
    worker_id: str
    actors: list[Any]
    capacity: int
    reported_load: float = 0.0
    sequences: set[str] = field(default_factory=set)
    draining: bool = False  # being replaced: keeps its sequences, takes new ones only if nothing else can
    listed: bool = True  # in the monitor's latest view; unlisted workers only finish their pinned sequences
    pending_observe: tuple[list[str], list[int]] | None = None  # draft: last round's acceptance, not yet sent

    @property
    def load(self) -> float:
        return max(self.reported_load, len(self.sequences))


class WorkerPool:
    def __init__(self, kind: str):
        self.kind = kind
        self.workers: dict[str, Worker] = {}
        self.assignment: dict[str, str] = {}  # seq_id → worker_id
        self.dead: set[str] = set()

    def update(self, infos: dict[str, WorkerInfo]) -> None:
        """Adopt newly registered workers; unlist those the monitor no longer lists (they may come back: a
        late heartbeat is not a death) and forget the unlisted ones that hold no sequences."""
        live = {i.worker_id: i for i in infos.values() if i.kind == self.kind and i.worker_id not in self.dead}
        for worker_id, info in live.items():
            worker = self.workers.get(worker_id)
            if worker is None:
                worker = self.workers[worker_id] = Worker(worker_id, list(info.actors), info.capacity)
            worker.reported_load = float(info.load.get("sequences", 0.0))
            worker.draining = bool(info.load.get("draining", 0.0))
            worker.listed = True
        for worker_id in [w for w in self.workers if w not in live]:
            if self.workers[worker_id].sequences:
                self.workers[worker_id].listed = False
            else:
                self.drop(worker_id, dead=False)

    @property
    def available(self) -> bool:
        """Some listed worker can take new sequences."""
        return any(w.listed for w in self.workers.values())

    def worker_of(self, seq_id: str) -> Worker | None:
        """The worker pinned to ``seq_id``; assigns the least-loaded one with room on first use."""
        worker_id = self.assignment.get(seq_id)
        if worker_id is not None and worker_id in self.workers:
            return self.workers[worker_id]
        with_room = [w for w in self.workers.values() if w.listed and len(w.sequences) < w.capacity]
        candidates = [w for w in with_room if not w.draining] or with_room
        if not candidates:
            return None
        chosen = min(candidates, key=lambda w: (w.load, w.worker_id))
        chosen.sequences.add(seq_id)
        self.assignment[seq_id] = chosen.worker_id
        return chosen

    def forget(self, seq_id: str) -> Worker | None:
        """``seq_id`` is finished; returns the worker that held it (to free its cache there)."""
        worker = self.workers.get(self.assignment.pop(seq_id, ""))
        if worker is not None:
            worker.sequences.discard(seq_id)
            if not worker.listed and not worker.sequences:
                self.workers.pop(worker.worker_id)  # its last pinned sequence is done
        return worker

    def drop(self, worker_id: str, dead: bool = True) -> list[str]:
        """A worker failed (``dead``: never re-adopt that id) or vanished from the view: stop using it;
        returns the sequences that were pinned to it."""
        if dead:
            self.dead.add(worker_id)
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return []
        for seq_id in worker.sequences:
            self.assignment.pop(seq_id, None)
        return sorted(worker.sequences)

    def describe(self) -> list[dict]:
        return [{"worker_id": w.worker_id, "actors": len(w.actors), "sequences": len(w.sequences),
                 "held_by_worker": w.reported_load, "capacity": w.capacity,
                 "draining": w.draining, "listed": w.listed} for w in self.workers.values()]
