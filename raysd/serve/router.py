"""Router: the continuous-batching round loop over draft actors and tensor-parallel target groups.

The loop is a background task (not any request's task). Each round it plans with the engine's policy,
sends each draft actor one ``propose`` for the sequences pinned to it, then each target group one
``verify`` (to every rank of the group at once) for its sequences, commits, and pushes each sequence's new
tokens to its request's queue. Calls go to the workers' actors directly (one actor hop, not a Serve hop).

Failures: a draft call that fails or times out turns its rows into plain decoding (k = 0) — output is
unchanged, the failure is counted, a dead draft actor is dropped and its sequences move to another draft
(or stay undrafted); after a timeout drafting resumes after ``draft_retry_s``. A target group that fails
ends the requests whose caches it held promptly with a retryable error; other groups carry on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from raysd.config import PolicyConfig, SamplingParams
from raysd.drafting import DraftProposal, empty_proposal, merge_proposals, select_rows
from raysd.engine import RoundPlan, SpecEngine
from raysd.sequence import Sequence
from raysd.serve.cluster import ClusterView
from raysd.serve.config import RouterConfig
from raysd.serve.round_trace import RoundTracer
from raysd.serve.workers import Worker, WorkerPool
from raysd.verify import VerifyResult, merge_results

logger = logging.getLogger("raysd.router")


class TargetUnavailableError(RuntimeError):
    """The target worker failed, timed out or is not up yet for this request (retryable)."""


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN/inf logits for this request (not retryable as is: greedy would repeat it)."""


@dataclass
class RequestStream:
    """What the round loop hands to a request: token bursts, then ``None`` at the end."""

    sequence: Sequence
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    error: Exception | None = None
    span: Any = None  # the request's OpenTelemetry span (round spans go under it); None when not traced


class RoundLoop:
    """Drives ``SpecEngine.plan/commit`` with remote draft/verify calls."""

    def __init__(self, config: RouterConfig, eos_token_id: int | None, pressure_source=None,
                 drafts_configured: bool = True):
        self.config = config
        self.targets = WorkerPool("target")
        self.drafts = WorkerPool("draft")
        self.drafts_configured = drafts_configured
        self.engine = SpecEngine(None, None, eos_token_id, config.engine, config.policy,
                                 pressure_source=pressure_source, drafting_available=lambda: self.drafting_available)
        self.streams: dict[str, RequestStream] = {}
        self.draft_failures = 0
        self.target_failures = 0
        self.aborted = 0  # requests whose client went away before the end
        self.orphan_origins: list[str] = []  # tags of routers gone silent: workers free their sequences
        self.draft_down_until = 0.0
        self.targets_missing_since: float | None = None
        self.pending_release: list[str] = []
        self.policy_version = 0  # the cluster's policy change last applied (0: the configured policy)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.round_tracer = RoundTracer()
        self.on_round: list = []  # callbacks(RoundStats) after each committed round (metrics exporters)

    # ----------------------------------------------------------------------------------- requests
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, segment: str,
               span: Any = None) -> RequestStream:
        sequence = self.engine.add(prompt_token_ids, params, segment)
        stream = RequestStream(sequence, span=span)
        self.streams[sequence.seq_id] = stream
        self._ensure_running()
        self._wakeup.set()
        return stream

    def cancel(self, seq_id: str) -> None:
        """Client gone: the sequence leaves the batch at the next round boundary; caches are freed."""
        stream = self.streams.pop(seq_id, None)
        if stream is None or stream.sequence.finished:
            return
        sequence = stream.sequence
        sequence.finish_reason = "abort"
        self.aborted += 1
        if sequence in self.engine.waiting:
            self.engine.waiting.remove(sequence)
            return
        if sequence in self.engine.running:
            self.engine.running.remove(sequence)
            self.pending_release.append(seq_id)

    def update_view(self, view: ClusterView) -> None:
        """New cluster view from the monitor: adopt new workers, unlist vanished ones (they finish the
        sequences pinned to them unless a call fails: see ``WorkerPool``)."""
        self.targets.update(view.workers)
        self.drafts.update(view.workers)
        if view.policy is not None and view.policy_version != self.policy_version:
            try:
                self.use_policy(PolicyConfig.model_validate(view.policy), view.policy_version)
            except ValueError as error:  # sized smaller than the router that accepted it: keep ours
                logger.error("cluster policy version %d not applied here: %s", view.policy_version, error)
                self.policy_version = view.policy_version
        self.orphan_origins = [source.removeprefix("router-") for source in view.departed
                               if source.startswith("router-")]
        if self.targets.available:
            self._wakeup.set()

    def use_policy(self, policy: PolicyConfig, version: int) -> None:
        """Decide rounds from the next one on with ``policy`` (the cluster's version ``version`` of it)."""
        self.engine.use_policy(policy)
        self.policy_version = version
        logger.info("policy %s (version %d)", policy.model_dump_json(), version)

    @property
    def drafting_available(self) -> bool:
        return self.drafts_configured and self.drafts.available and time.monotonic() >= self.draft_down_until

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    # -------------------------------------------------------------------------------------- loop
    async def _run(self) -> None:
        while True:
            try:
                if not self.engine.has_work:
                    self._wakeup.clear()  # clear before awaiting anything, so a submit meanwhile is not missed
                    await self._release_pending()
                    if not self.engine.has_work:
                        await self._wakeup.wait()
                    continue
                if not self.targets.available and not self.engine.running:
                    await self._wait_for_targets()
                    continue
                self.targets_missing_since = None
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: fail what was in flight, keep serving
                logger.exception("round failed")
                self._fail_pinned(list(self.engine.running), "internal error in the round loop")

    async def _wait_for_targets(self) -> None:
        """No target group registered (starting up or all restarting): hold requests, then fail them."""
        now = time.monotonic()
        self.targets_missing_since = self.targets_missing_since or now
        if now - self.targets_missing_since > self.config.target_timeout_s:
            waiting = list(self.engine.waiting) + list(self.engine.running)
            self.engine.waiting.clear()
            self._fail_pinned(waiting, "no target model worker is available (starting or restarting)")
            self.targets_missing_since = None
            return
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout=0.1)
        except asyncio.TimeoutError:
            pass

    async def _release_pending(self) -> None:
        if not self.pending_release:
            return
        ids, self.pending_release = self.pending_release, []
        by_worker: dict[str, tuple[Worker, list[str]]] = {}
        for seq_id in ids:
            for pool in (self.targets, self.drafts):
                worker = pool.forget(seq_id)
                if worker is not None:
                    by_worker.setdefault(worker.worker_id, (worker, []))[1].append(seq_id)
        calls = [actor.release.remote(seq_ids) for worker, seq_ids in by_worker.values() for actor in worker.actors]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                logger.warning("release of finished sequences failed: %s", result)

    async def _round(self) -> None:
        await self._release_pending()
        # only sequences pinned to unlisted workers are left (e.g. the monitor was just replaced): finish
        # them, admit nobody until a listed target group is back
        plan = self.engine.plan(admit=self.targets.available)
        if plan is None:
            return
        groups: dict[str, list[int]] = {}
        for row, sequence in enumerate(plan.batch):
            worker = self.targets.worker_of(sequence.seq_id)
            if worker is None:  # every group full: the engine admitted more than the targets hold
                self._fail_pinned([sequence], "no target model worker has room for another sequence")
                continue
            groups.setdefault(worker.worker_id, []).append(row)
        spans = self.round_tracer.start([self._request_span(s) for s in plan.batch])
        carrier = spans.carrier if spans is not None else None
        try:
            proposal = await self._draft(plan, groups, carrier)
            parts = await asyncio.gather(*[self._verify(plan, worker_id, rows, proposal, carrier)
                                           for worker_id, rows in groups.items()])
            parts = [part for part in parts if part is not None]
            for row, sequence in enumerate(plan.batch):
                if sequence.finished:
                    proposal.num_draft[row] = 0  # failed rows count no drafts in the acceptance figures
            result = merge_results(len(plan.batch), parts)
            self._commit(plan, proposal, result)
        except BaseException as error:
            self.round_tracer.end(spans, None, f"{type(error).__name__}: {error}")
            raise
        self.round_tracer.end(spans, self.engine.last_round)
        for callback in self.on_round:
            callback(self.engine.last_round)

    def _request_span(self, sequence: Sequence):
        stream = self.streams.get(sequence.seq_id)
        return stream.span if stream is not None else None

    async def _draft(self, plan: RoundPlan, groups: dict[str, list[int]],
                     carrier: dict[str, str] | None = None) -> DraftProposal:
        """One ``propose`` per draft actor for its rows with k > 0; failed rows fall back to k = 0."""
        ks, reasons = plan.decision.ks, plan.decision.reasons
        pinned_rows = {row for rows in groups.values() for row in rows}
        by_draft: dict[str, list[int]] = {}
        for row, sequence in enumerate(plan.batch):
            if ks[row] == 0 or row not in pinned_rows:
                ks[row] = 0
                continue
            pinned = self.drafts.assignment.get(sequence.seq_id)
            worker = self.drafts.worker_of(sequence.seq_id) if self.drafting_available else None
            if worker is None:
                ks[row], reasons[row] = 0, "draft_unavailable"
                continue
            if worker.worker_id != pinned:  # a draft worker that never saw this sequence (first use, failover)
                sequence.draft_cached = 0
            by_draft.setdefault(worker.worker_id, []).append(row)
        if not by_draft:
            return empty_proposal(len(plan.batch))
        workers = [self.drafts.workers[worker_id] for worker_id in by_draft]
        calls = []
        for worker, rows in zip(workers, by_draft.values()):
            observed, worker.pending_observe = worker.pending_observe, None
            call = worker.actors[0].propose.remote([plan.batch[r] for r in rows], [ks[r] for r in rows], observed,
                                                   carrier, self.orphan_origins)
            calls.append(asyncio.wait_for(call, timeout=self.config.draft_timeout_s))
        parts = []
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        for worker, rows, outcome in zip(workers, by_draft.values(), outcomes):
            if not isinstance(outcome, Exception):
                parts.append((rows, outcome))
                continue
            self.draft_failures += 1
            if isinstance(outcome, RayActorError):  # gone for good: its replacement registers anew
                self.drafts.drop(worker.worker_id)
            else:  # slow or erroring: give drafting a rest
                self.draft_down_until = time.monotonic() + self.config.draft_retry_s
            logger.warning("draft worker %s unavailable (%s); %d sequences continue without speculation",
                           worker.worker_id, type(outcome).__name__, len(rows))
            for row in rows:
                ks[row], reasons[row] = 0, "draft_unavailable"
        return merge_proposals(len(plan.batch), parts)

    async def _verify(self, plan: RoundPlan, worker_id: str, rows: list[int], proposal: DraftProposal,
                      carrier: dict[str, str] | None = None) -> tuple[list[int], VerifyResult] | None:
        """Verify ``rows`` on one target group (every rank gets the same call; rank 0's answer is used)."""
        worker = self.targets.workers[worker_id]
        sequences = [plan.batch[r] for r in rows]
        part = select_rows(proposal, rows)
        try:
            calls = [rank.verify.remote(sequences, part, carrier, self.orphan_origins) for rank in worker.actors]
            results = await asyncio.wait_for(asyncio.gather(*calls), timeout=self.config.target_timeout_s)
        except Exception as error:
            self.target_failures += 1
            logger.error("target group %s failed during a round (%s: %s)", worker_id, type(error).__name__, error)
            lost = set(self.targets.drop(worker_id))
            self._fail_pinned([s for s in self.engine.running if s.seq_id in lost] + sequences,
                              f"the target model worker failed ({type(error).__name__})")
            return None
        # greedy decisions are exact on every rank (same logits); the draft's observe rides on its next call
        for draft in self.drafts.workers.values():
            mine = [(s.seq_id, results[0].num_accepted[i]) for i, s in enumerate(sequences)
                    if self.drafts.assignment.get(s.seq_id) == draft.worker_id and int(part.num_draft[i]) > 0]
            if mine:
                ids, accepted = draft.pending_observe or ([], [])
                draft.pending_observe = (ids + [m[0] for m in mine], accepted + [m[1] for m in mine])
        return rows, results[0]

    def _commit(self, plan: RoundPlan, proposal: DraftProposal, result: VerifyResult) -> None:
        outputs, finished = self.engine.commit(plan, proposal, result)
        for output in outputs:
            stream = self.streams.get(output.sequence.seq_id)
            if stream is not None and output.new_token_ids:
                stream.queue.put_nowait(output.new_token_ids)
        for sequence in finished:
            stream = self.streams.pop(sequence.seq_id, None)
            if stream is not None:
                if sequence.finish_reason == "error":
                    stream.error = NonFiniteLogitsError(
                        "the target model produced non-finite (NaN/inf) logits for this request; the other "
                        "requests in its batch were not affected. Check the model weights and dtype")
                stream.queue.put_nowait(None)
            self.pending_release.append(sequence.seq_id)

    def _fail_pinned(self, sequences: list[Sequence], why: str) -> None:
        """End ``sequences`` now with a retryable error (their caches are gone or never existed)."""
        failing = {s.seq_id for s in sequences}
        for sequence in sequences:
            if sequence.finished:
                continue
            sequence.finish_reason = "error"
            stream = self.streams.pop(sequence.seq_id, None)
            if stream is not None:
                stream.error = TargetUnavailableError(f"{why}; retry the request")
                stream.queue.put_nowait(None)
            self.pending_release.append(sequence.seq_id)
        self.engine.running = [s for s in self.engine.running if s.seq_id not in failing]

    def state(self) -> dict:
        gate = self.engine.policy.gate
        last = self.engine.last_round
        return {
            "running": len(self.engine.running), "waiting": len(self.engine.waiting),
            "speculation_on": gate.speculation_on and self.drafting_available,
            "reason": ("draft_unavailable" if not self.drafting_available else
                       "pressure" if not gate.speculation_on else "ok"),
            "pressure": last.pressure if last else 0.0, "draft_failures": self.draft_failures,
            "target_failures": self.target_failures, "aborted": self.aborted,
            "workers": {"targets": self.targets.describe(), "drafts": self.drafts.describe()},
            "acceptance": self.engine.aggregator.summary(),
            "round_timing": self.engine.aggregator.timing(),
            "policy": self.engine.policy.describe(last.batch_size if last else 1),
        }
