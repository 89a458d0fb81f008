"""Router: the HTTP ingress and the continuous-batching round loop over the draft and target workers.

The loop is a background task (not any request's task): each round it plans with the engine's policy,
awaits one draft call and one verify call, commits, and pushes each sequence's new tokens to its
request's queue. A draft failure or timeout turns that round into plain decoding (k = 0) — output is
unchanged, the failure is counted, drafting resumes after ``draft_retry_s``. A target failure ends the
round's requests promptly with a retryable error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from raysd.config import SamplingParams
from raysd.drafting import empty_proposal
from raysd.engine import SpecEngine
from raysd.sequence import Sequence
from raysd.serve.config import RouterConfig

logger = logging.getLogger("raysd.router")


class TargetUnavailableError(RuntimeError):
    """The target worker failed or timed out during this request's round (retryable)."""


@dataclass
class RequestStream:
    """What the round loop hands to a request: token bursts, then ``None`` at the end."""

    sequence: Sequence
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    error: Exception | None = None


class RoundLoop:
    """Drives ``SpecEngine.plan/commit`` with remote draft/verify calls."""

    def __init__(self, config: RouterConfig, draft_handle, target_handle, eos_token_id: int | None,
                 pressure_source=None):
        self.config = config
        self.draft = draft_handle
        self.target = target_handle
        self.engine = SpecEngine(None, None, eos_token_id, config.engine, config.policy,
                                 pressure_source=pressure_source, drafting_available=lambda: self.drafting_available)
        self.streams: dict[str, RequestStream] = {}
        self.draft_failures = 0
        self.draft_down_until = 0.0
        self.pending_observe: tuple[list[str], list[int]] | None = None
        self.pending_release: list[str] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ----------------------------------------------------------------------------------- requests
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, segment: str) -> RequestStream:
        sequence = self.engine.add(prompt_token_ids, params, segment)
        stream = RequestStream(sequence)
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
        if sequence in self.engine.waiting:
            self.engine.waiting.remove(sequence)
            return
        if sequence in self.engine.running:
            self.engine.running.remove(sequence)
            self.pending_release.append(seq_id)

    @property
    def drafting_available(self) -> bool:
        return self.draft is not None and time.monotonic() >= self.draft_down_until

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
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: fail what was in flight, keep serving
                logger.exception("round failed")
                for sequence in list(self.engine.running):
                    self._finish_with_error(sequence, TargetUnavailableError("internal error in the round loop"))
                self.engine.running.clear()

    async def _release_pending(self) -> None:
        if not self.pending_release:
            return
        ids, self.pending_release = self.pending_release, []
        calls = [self.target.release.remote(ids)]
        if self.draft is not None:
            calls.append(self.draft.release.remote(ids))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                logger.warning("release of %d sequences failed: %s", len(ids), result)

    async def _round(self) -> None:
        await self._release_pending()
        plan = self.engine.plan()
        if plan is None:
            return
        proposal = empty_proposal(len(plan.batch))
        if any(plan.decision.ks):
            try:
                call = self.draft.propose.remote(plan.batch, plan.decision.ks, self.pending_observe)
                proposal = await asyncio.wait_for(call, timeout=self.config.draft_timeout_s)
                self.pending_observe = None
            except Exception as error:  # replica died, restarting, or too slow: this round decodes plainly
                self.draft_failures += 1
                self.draft_down_until = time.monotonic() + self.config.draft_retry_s
                self.pending_observe = None
                logger.warning("draft worker unavailable (%s); continuing without speculation",
                               type(error).__name__)
                plan.decision.ks = [0] * len(plan.batch)
                plan.decision.reasons = ["draft_unavailable"] * len(plan.batch)
        try:
            call = self.target.verify.remote(plan.batch, proposal)
            result = await asyncio.wait_for(call, timeout=self.config.target_timeout_s)
        except Exception as error:
            logger.error("target worker failed during a round: %s", error)
            for sequence in plan.batch:
                self._finish_with_error(sequence, TargetUnavailableError(
                    f"the target model worker failed ({type(error).__name__}); retry the request"))
            self.engine.running = [s for s in self.engine.running if s not in plan.batch]
            self.pending_release.extend(s.seq_id for s in plan.batch)
            return
        if any(plan.decision.ks):
            self.pending_observe = ([s.seq_id for s in plan.batch], result.num_accepted)
        outputs, finished = self.engine.commit(plan, proposal, result)
        for output in outputs:
            stream = self.streams.get(output.sequence.seq_id)
            if stream is not None and output.new_token_ids:
                stream.queue.put_nowait(output.new_token_ids)
        for sequence in finished:
            stream = self.streams.pop(sequence.seq_id, None)
            if stream is not None:
                if sequence.finish_reason == "error":
                    stream.error = RuntimeError("the target produced non-finite logits for this request")
                stream.queue.put_nowait(None)
            self.pending_release.append(sequence.seq_id)

    def _finish_with_error(self, sequence: Sequence, error: Exception) -> None:
        sequence.finish_reason = "error"
        stream = self.streams.pop(sequence.seq_id, None)
        if stream is not None:
            stream.error = error
            stream.queue.put_nowait(None)

    def state(self) -> dict:
        gate = self.engine.policy.gate
        last = self.engine.last_round
        return {
            "running": len(self.engine.running), "waiting": len(self.engine.waiting),
            "speculation_on": gate.speculation_on and self.drafting_available,
            "reason": ("draft_unavailable" if not self.drafting_available else
                       "pressure" if not gate.speculation_on else "ok"),
            "pressure": last.pressure if last else 0.0, "draft_failures": self.draft_failures,
            "acceptance": self.engine.aggregator.summary(),
        }
