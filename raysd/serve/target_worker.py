"""Target worker (Serve deployment): leads one tensor-parallel group of ``tp_size`` rank actors.

The replica holds no model. It starts the ranks inside its placement group (one bundle per rank, STRICT_PACK),
sets them up concurrently (the DeepSpeed rendezvous needs every rank at once; tp_size 1 skips the
distributed set-up), and from then on only watches them: its health check pings every rank and heartbeats
the group to the cluster monitor, which is how routers find the ranks and call them directly each round.
A dead rank fails the health check; Serve then replaces the replica, which frees the group and starts a
fresh one. Sequences whose KV caches were on the lost group end with a retryable error at the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import ray

from raysd.serve.cluster import WorkerInfo, replica_tag
from raysd.serve.config import TargetWorkerConfig
from raysd.serve.placement import actor_options
from raysd.serve.target_rank import TargetRank

logger = logging.getLogger("raysd.target_worker")


class TargetWorker:
    def __init__(self, config: TargetWorkerConfig, monitor_handle=None):
        self.config = config
        self.monitor = monitor_handle
        self.worker_id = f"target-{replica_tag()}-{uuid.uuid4().hex[:6]}"
        self.draining = False
        self.ranks = [TargetRank.options(**actor_options(config.placement, rank)).remote(config, rank)
                      for rank in range(config.tp_size)]
        if config.tp_size > 1:
            address, port = ray.get(self.ranks[0].node_address.remote())
            setups = [rank.setup.remote(address, port) for rank in self.ranks]  # all at once: rendezvous
        else:
            setups = [self.ranks[0].setup.remote()]
        self.rank_info = ray.get(setups, timeout=config.rendezvous_timeout_s + 120)
        logger.info("target group %s ready: %s", self.worker_id, self.rank_info)

    def describe(self) -> dict:
        return {"worker_id": self.worker_id, "tp_size": self.config.tp_size, "ranks": self.rank_info}

    async def check_health(self) -> None:
        """Every rank answers (else Serve restarts this replica and its group); then heartbeat."""
        await asyncio.gather(*[rank.ping.remote() for rank in self.ranks])
        await self._heartbeat()

    async def _heartbeat(self) -> int:
        held = await self.ranks[0].num_sequences.remote()
        if self.monitor is not None:
            await self.monitor.heartbeat.remote(WorkerInfo(
                "target", self.worker_id, list(self.ranks), self.config.max_num_seqs,
                {"sequences": held, "draining": float(self.draining)}))
        return held

    async def __del__(self):
        """Serve is replacing this replica (redeploy, scale-down): take no new sequences, keep heartbeating so
        routers keep the ones pinned here, and let them finish (routers call the ranks directly) for up to
        ``drain_timeout_s``; then the group goes with the replica."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline:
            try:
                if await asyncio.wait_for(self.ranks[0].num_sequences.remote(), timeout=5) == 0:
                    return
            except Exception:  # the ranks are already gone: nothing left to drain
                return
            try:
                await asyncio.wait_for(self._heartbeat(), timeout=5)
            except Exception as error:  # the monitor is being replaced too (a redeploy): keep draining
                logger.info("target group %s: heartbeat while draining failed (%s)", self.worker_id, error)
            await asyncio.sleep(0.5)
        logger.warning("target group %s: drain timeout, %s s; remaining sequences end with a retryable error",
                       self.worker_id, self.config.drain_timeout_s)
