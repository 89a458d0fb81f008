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
from raysd.drafting import Drafter, DraftProposal
from raysd.metrics import RoundStats, SpecDecodeAggregator
from raysd.policy import SpeculationPolicy
from raysd.sequence import Sequence
from raysd.verify import TargetVerifier

logger = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """A request's prompt + max_tokens do not fit the engine's max_model_len."""


@dataclass
class StepOutput:
    """Tokens a sequence gained this round (a burst of ``accepted + 1`` at most)."""

    sequence: Sequence
    new_token_ids: list[int]


class SpecEngine:
    """Continuous-batching speculative decoding over one target and (optionally) one drafter.

    ``pressure_source`` returns the pressure the policy's gate reads; by default the engine's own load
    (running + waiting sequences). The serving layer passes the cluster-wide figure instead.
    """

    def __init__(self, target_model, drafter: Drafter | None, eos_token_id: int | None,
                 engine_config: EngineConfig, policy_config: PolicyConfig,
                 pressure_source: Callable[[], float] | None = None):
        if engine_config.threads:
            torch.set_num_threads(engine_config.threads)
        self.config = engine_config
        self.verifier = TargetVerifier(target_model, engine_config.max_num_seqs, engine_config.max_model_len,
                                       max(policy_config.k_max, policy_config.k))
        self.drafter = drafter
        self.eos_token_id = eos_token_id
        self.policy = SpeculationPolicy(policy_config)
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
                self._retire([sequence])
                return True
        return False

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
        now = time.perf_counter()
        for sequence in finished:
            sequence.finished_at = now
        self.verifier.release(ids)
        if self.drafter is not None:
            self.drafter.release(ids)
        gone = set(ids)
        self.running = [s for s in self.running if s.seq_id not in gone]

    def step(self) -> list[StepOutput]:
        """Run one round over the running batch; returns the tokens each sequence gained."""
        round_started = time.perf_counter()
        self._admit()
        batch = list(self.running)
        if not batch:
            return []
        opt_out = [s.params.speculation == SpeculationMode.off or self.drafter is None for s in batch]
        k_limits = [max(0, s.remaining - 1) for s in batch]
        decision = self.policy.decide([s.segment for s in batch], opt_out, k_limits, self.pressure_source())

        if any(decision.ks):
            proposal = self.drafter.propose(batch, decision.ks)
        else:
            proposal = DraftProposal(torch.zeros(len(batch), 0, dtype=torch.long),
                                     torch.zeros(len(batch), dtype=torch.long), None)
        result = self.verifier.verify(batch, proposal)
        drafted = proposal.num_draft.tolist()
        if any(decision.ks):
            self.drafter.observe(batch, result.num_accepted)

        outputs, finished = [], []
        for i, sequence in enumerate(batch):
            if result.failed[i]:
                logger.error("target produced non-finite logits for %s; failing that request", sequence.seq_id)
                sequence.finish_reason = "error"
                finished.append(sequence)
                continue
            accepted = result.num_accepted[i]
            emitted = proposal.token_ids[i, :accepted].tolist() + [result.bonus_token_ids[i]]
            kept = sequence.append(emitted, self.eos_token_id)
            stats = sequence.stats
            stats.rounds += 1
            stats.last_reason = decision.reasons[i]
            if drafted[i] > 0:
                stats.spec_rounds += 1
                stats.drafted_tokens += drafted[i]
                stats.accepted_tokens += accepted
                stats.accepted_per_position.extend([0] * (accepted - len(stats.accepted_per_position)))
                for position in range(accepted):
                    stats.accepted_per_position[position] += 1
            outputs.append(StepOutput(sequence, kept))
            if sequence.finished:
                finished.append(sequence)

        self.policy.observe_round([s.segment for s in batch], drafted, result.num_accepted)
        self.policy.costs.observe_target(result.batch_tokens, result.seconds)
        if proposal.forward_steps:
            self.policy.costs.observe_draft(len(batch), proposal.seconds / proposal.forward_steps)
        self._retire(finished)
        self.last_round = RoundStats(
            segments=[s.segment for s in batch], ks=decision.ks, drafted=drafted,
            accepted=result.num_accepted, emitted=[len(o.new_token_ids) for o in outputs],
            reasons=decision.reasons, draft_seconds=proposal.seconds, verify_seconds=result.seconds,
            prefill_seconds=result.prefill_seconds, round_seconds=time.perf_counter() - round_started,
            pressure=decision.pressure, speculation_on=decision.speculation_on,
            verify_tokens=result.batch_tokens)
        self.aggregator.add(self.last_round)
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
