"""SpecEngine: the in-process round loop (no Ray). The only place drafter, verifier and policy meet.

A round: admit waiting sequences (continuous batching), ask the policy for k per sequence, draft, verify
in one batched target forward, append ``accepted + 1`` tokens per sequence (cut at EOS / max_tokens),
feed the measured acceptance and timings back, and retire finished sequences from both caches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from raysd.config import EngineConfig, PolicyConfig, SamplingParams, SpeculationMode
from raysd.drafting import Drafter, DraftProposal, empty_proposal, merge_proposals
from raysd.metrics import RoundStats, SpecDecodeAggregator
from raysd.policy import Decision, SpeculationPolicy
from raysd.sequence import Sequence
from raysd.verify import TargetVerifier, VerifyResult

logger = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """A request's prompt + max_tokens do not fit the engine's max_model_len."""


@dataclass
class RoundPlan:
    """A round in flight: its batch and the policy's decision."""

    batch: list[Sequence]
    decision: Decision
    started: float


@dataclass
class StepOutput:
    """Tokens a sequence gained this round (a burst of ``accepted + 1`` at most)."""

    sequence: Sequence
    new_token_ids: list[int]


class SpecEngine:
    """Continuous-batching speculative decoding over one target and (optionally) one drafter.

    ``pressure_source`` returns the pressure the policy's gate reads; by default the engine's own load
    (running + waiting sequences). The serving layer passes the cluster-wide figure instead, and
    ``drafting_available`` (is the draft worker healthy?) in place of "a drafter is attached".
    """

    def __init__(self, target_model, drafter: Drafter | None, eos_token_id: int | None,
                 engine_config: EngineConfig, policy_config: PolicyConfig,
                 pressure_source: Callable[[], float] | None = None,
                 drafting_available: Callable[[], bool] | None = None):
        if engine_config.threads:
            torch.set_num_threads(engine_config.threads)
        self.config = engine_config
        # target_model None: the caller verifies elsewhere (the Serve router drives plan/commit itself)
        self.verifier = None if target_model is None else TargetVerifier(
            target_model, engine_config.max_num_seqs, engine_config.max_model_len,
            max(policy_config.k_max, policy_config.k))
        self.drafter = drafter
        self.eos_token_id = eos_token_id
        self.policy = SpeculationPolicy(policy_config)
        self._policies = {policy_config.model_dump_json(): self.policy}  # every policy used, by its config
        self.k_capacity = max(policy_config.k_max, policy_config.k)  # caches were sized for this many drafts
        self._drafting_available = drafting_available or (lambda: self.drafter is not None)
        self.pressure_source = pressure_source or (lambda: float(len(self.running) + len(self.waiting)))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.aggregator = SpecDecodeAggregator()
        self.last_round: RoundStats | None = None

    # ------------------------------------------------------------------------------------ requests
    def add(self, prompt_token_ids: list[int], params: SamplingParams, segment: str = "default") -> Sequence:
        """Queue a request; it joins the batch at the next round with room."""
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {self.config.max_model_len}; shorten the prompt or lower max_tokens")
        sequence = Sequence(list(prompt_token_ids), params, segment)
        self.waiting.append(sequence)
        return sequence

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence now (client gone); frees its cache rows. True if it was known."""
        for sequence in list(self.waiting):
            if sequence.seq_id == seq_id:
                self.waiting.remove(sequence)
                sequence.finish_reason = "abort"
                return True
        for sequence in self.running:
            if sequence.seq_id == seq_id:
                sequence.finish_reason = "abort"
                self.running.remove(sequence)
                self._retire([sequence])
                return True
        return False

    def use_policy(self, config: PolicyConfig) -> SpeculationPolicy:
        """Decide later rounds with ``config`` (from the next ``plan``); returns the policy now in use.

        Each distinct config keeps its own state (acceptance per segment, cost fit, pressure gate): switching
        back resumes what that policy had learned, and no policy learns from rounds another one chose. Output
        does not change with the policy (every k is lossless). Raises ``ValueError`` for a k the caches were
        not sized for (``k_capacity``, set by the config the engine started with)."""
        needed = max(config.k, config.k_max if config.mode == SpeculationMode.adaptive else 0)
        if needed > self.k_capacity:
            raise ValueError(f"k = {needed} exceeds the {self.k_capacity} drafts per round the caches were sized "
                             f"for at startup; choose k ≤ {self.k_capacity} (or restart with a larger k_max)")
        key = config.model_dump_json()
        self.policy = self._policies.setdefault(key, SpeculationPolicy(config))
        return self.policy

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------------- round
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            sequence = self.waiting.popleft()
            sequence.admitted_at = time.perf_counter()
            self.running.append(sequence)

    def _retire(self, finished: list[Sequence]) -> None:
        ids = [s.seq_id for s in finished]
        self.verifier.release(ids)
        if self.drafter is not None:
            self.drafter.release(ids)

    def plan(self, admit: bool = True) -> RoundPlan | None:
        """Start a round: admit waiting sequences (unless ``admit`` is False) and choose k for each running
        one (None when nothing runs)."""
        started = time.perf_counter()
        if admit:
            self._admit()
        batch = list(self.running)
        if not batch:
            return None
        opt_out = [s.params.speculation == SpeculationMode.off or not self.can_draft for s in batch]
        # A sequence's first round is its prefill: it emits the first token alone, as without speculation,
        # so time to first token does not pay for drafting (vLLM does the same). It can draft nothing, and
        # the policy weighs the round knowing that.
        prefilling = [s.num_generated == 0 and not self.policy.config.speculate_prefill for s in batch]
        k_limits = [0 if prefill else max(0, s.remaining - 1) for s, prefill in zip(batch, prefilling)]
        decision = self.policy.decide([s.segment for s in batch], opt_out, k_limits, self.pressure_source(),
                                      [s.draft_behind for s in batch])
        for row, prefill in enumerate(prefilling):
            if prefill and not opt_out[row] and decision.reasons[row] != "off":
                decision.ks[row], decision.reasons[row] = 0, "prefill"
        return RoundPlan(batch, decision, started)

    def commit(self, plan: RoundPlan, proposal: DraftProposal, result: VerifyResult) -> tuple[list[StepOutput],
                                                                                            list[Sequence]]:
        """Finish a round: append emitted tokens, record stats, feed the policy, drop finished sequences
        from the running batch. Returns ``(outputs, finished)``; the caller frees the finished ones' caches."""
        batch, decision = plan.batch, plan.decision
        drafted = proposal.num_draft.tolist()
        decoding_rows = [row for row, s in enumerate(batch) if s.num_generated > 0]  # not prefilled this round
        outputs, finished, emitted_counts = [], [], []
        for i, sequence in enumerate(batch):
            if sequence.finished:  # aborted while the round was in flight
                finished.append(sequence)
                emitted_counts.append(0)
                continue
            if result.failed[i]:
                logger.error("target produced non-finite logits for %s; failing that request", sequence.seq_id)
                sequence.finish_reason = "error"
                finished.append(sequence)
                emitted_counts.append(0)
                continue
            accepted = result.num_accepted[i]
            if drafted[i] > 0:  # the draft fed everything before its drafts and kept the accepted ones but the last
                sequence.draft_cached = len(sequence.token_ids) + min(accepted, drafted[i] - 1)
            kept = sequence.append(proposal.token_ids[i, :accepted].tolist() + [result.bonus_token_ids[i]],
                                   self.eos_token_id)
            sequence.stats.record_round(decision.reasons[i], drafted[i], accepted)
            outputs.append(StepOutput(sequence, kept))
            emitted_counts.append(len(kept))
            if sequence.finished:
                finished.append(sequence)

        self.policy.observe_round([s.segment for s in batch], drafted, result.num_accepted, decision.reasons)
        if any(drafted):
            self.policy.observe_catchup(sum(behind for behind, k in zip(decision.catchup_tokens, drafted) if k),
                                        proposal.catchup_seconds)
        # the cost model learns what a whole round pays (in the server: remote calls and their overheads too),
        # less prefill and less the draft catching up on tokens decoded while it sat out: a steady state does
        # not repeat that work, and learning from what is left keeps k > 0 measured by the probes
        # while the policy holds k = 0 (else the fit of k > 0 only decays and the policy can stick at k = 0)
        round_seconds = time.perf_counter() - plan.started - result.prefill_seconds - proposal.catchup_seconds
        self.policy.costs.observe_round(len(batch), max(drafted, default=0), round_seconds)
        now = time.perf_counter()
        for sequence in finished:
            sequence.finished_at = now
        gone = {s.seq_id for s in finished}
        self.running = [s for s in self.running if s.seq_id not in gone]
        self.last_round = RoundStats(
            segments=[s.segment for s in batch], ks=decision.ks, drafted=drafted,
            accepted=result.num_accepted, emitted=emitted_counts, reasons=decision.reasons,
            draft_seconds=proposal.seconds, verify_seconds=result.seconds,
            prefill_seconds=result.prefill_seconds, round_seconds=now - plan.started,
            pressure=decision.pressure, speculation_on=decision.speculation_on,
            verify_tokens=result.batch_tokens)
        self.aggregator.add(self.last_round)
        # the goodput check compares decoding: without the target's prefill, and so without the first tokens
        # that prefill produced (see ``GoodputCheck``)
        self.policy.observe_goodput([decision.reasons[row] for row in decoding_rows],
                                    [drafted[row] for row in decoding_rows],
                                    sum(emitted_counts[row] for row in decoding_rows),
                                    now - plan.started - result.prefill_seconds)
        return outputs, finished

    @property
    def can_draft(self) -> bool:
        return self._drafting_available()

    def step(self) -> list[StepOutput]:
        """Run one round over the running batch; returns the tokens each sequence gained."""
        plan = self.plan()
        if plan is None:
            return []
        # like the served router: the drafter sees only the rows that draft (others need not catch up)
        rows = [row for row, k in enumerate(plan.decision.ks) if k > 0]
        proposal = empty_proposal(len(plan.batch))
        if rows:
            part = self.drafter.propose([plan.batch[row] for row in rows], [plan.decision.ks[row] for row in rows])
            proposal = merge_proposals(len(plan.batch), [(rows, part)])
        result = self.verifier.verify(plan.batch, proposal)
        if rows:
            self.drafter.observe([plan.batch[row].seq_id for row in rows], [result.num_accepted[row] for row in rows])
        outputs, finished = self.commit(plan, proposal, result)
        self._retire(finished)
        return outputs

    def run_to_completion(self) -> None:
        while self.has_work:
            self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 segments: list[str] | None = None) -> list[Sequence]:
        """Decode ``prompts`` together to completion; returns the finished sequences in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        segments = segments or ["default"] * len(prompts)
        sequences = [self.add(p, sp, seg) for p, sp, seg in zip(prompts, params_list, segments)]
        self.run_to_completion()
        return sequences
