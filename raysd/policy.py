"""Choosing k: measured acceptance per segment × a measured cost model × a pressure gate.

With α the per-token acceptance of a segment, a round drafting k tokens emits in expectation
``E(α, k) = (1 − α^(k+1)) / (1 − α)`` tokens (Leviathan et al. 2023). Its cost, in target-step units at the
current batch, is ``k·c + v(k)``: c = one draft step / one target decode step, v(k) = one verify forward of
k + 1 tokens per row / one target decode step. Both come from an online fit of the rounds actually run.
For each sequence the policy picks k ∈ {0..k_max} maximising ``E / (k·c + v(k))`` and speculates only
when that beats plain decoding (k = 0, value 1) by ``min_gain``. A pressure gate with hysteresis turns
speculation off for everyone above ``pressure_high`` and back on below ``pressure_low``.

The decision is per round, not per sequence: a verify is as wide as its longest draft, so one row at k
makes the whole batch pay for k. The round's k maximises the batch's expected tokens (each row with its own
segment's α) per unit of cost; every row that may speculate gets it.

Every decision carries a reason: ``opt_out``, ``fixed``, ``warmup``, ``pressure``, ``low_acceptance``
(k = 0: nothing pays), ``probe`` (a k = 1 round to re-measure a segment held at k = 0) or ``adaptive``
(k ≥ 1 chosen by the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raysd.config import PolicyConfig, SpeculationMode


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by a round with k drafts at per-token acceptance ``alpha`` (bonus included)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class _SegmentAcceptance:
    successes: float = 0.0  # EMA-weighted accepted draft tokens
    trials: float = 0.0  # EMA-weighted accepted tokens + rejections
    rounds: int = 0


class AcceptanceTracker:
    """Per-segment per-token acceptance α as an EMA over rounds.

    A round that drafted k and accepted n is n successes and, when n < k, one failure (the prefix rule
    stops at the first rejection); α̂ = successes / trials.
    """

    def __init__(self, ema_decay: float, prior_alpha: float = 0.5, prior_weight: float = 2.0):
        self.ema_decay = ema_decay
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.segments: dict[str, _SegmentAcceptance] = {}

    def observe(self, segment: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        state = self.segments.setdefault(segment, _SegmentAcceptance())
        state.successes = self.ema_decay * state.successes + accepted
        state.trials = self.ema_decay * state.trials + accepted + (1 if accepted < drafted else 0)
        state.rounds += 1

    def alpha(self, segment: str) -> float:
        state = self.segments.get(segment, _SegmentAcceptance())
        return (state.successes + self.prior_alpha * self.prior_weight) / (state.trials + self.prior_weight)

    def rounds(self, segment: str) -> int:
        return self.segments.get(segment, _SegmentAcceptance()).rounds


class _OnlineLinearFit:
    """Exponentially forgetting least squares of ``y ≈ a + b·x`` (seeded with prior points)."""

    def __init__(self, decay: float, prior_points: list[tuple[float, float]]):
        self.decay = decay
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        for x, y in prior_points:
            self.add(x, y, weight=0.5)

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        d = self.decay
        self.sw = d * self.sw + weight
        self.sx = d * self.sx + weight * x
        self.sy = d * self.sy + weight * y
        self.sxx = d * self.sxx + weight * x * x
        self.sxy = d * self.sxy + weight * x * y

    def predict(self, x: float) -> float:
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var_x = self.sxx / self.sw - mean_x**2
        slope = (self.sxy / self.sw - mean_x * mean_y) / var_x if var_x > 1e-9 else 0.0
        slope = max(slope, 0.0)  # more tokens never make a step cheaper
        return max(mean_y + slope * (x - mean_x), 1e-6)


class CostModel:
    """Online fits of a target forward's time vs tokens in the batch, and a draft step's vs rows.

    Priors (replaced as rounds arrive) come from measurements on a 2-core CPU: a 5-token verify costs
    ≈ 1.8 decode steps at batch 1, a draft step ≈ 0.3 of a target step.
    """

    def __init__(self, decay: float = 0.98, target_step_seconds: float = 0.015):
        base = target_step_seconds
        self.decay = decay
        self.target = _OnlineLinearFit(decay, [(1, base), (5, 1.8 * base), (32, 3 * base)])
        self.draft = _OnlineLinearFit(decay, [(1, 0.3 * base), (32, 0.6 * base)])
        self.draft_call_seconds = 0.0  # fixed cost of asking for drafts at all (a remote call); 0 in-process
        self._draft_calls = 0

    def observe_target(self, batch_tokens: int, seconds: float) -> None:
        self.target.add(batch_tokens, seconds)

    def observe_draft(self, rows: int, seconds_per_step: float) -> None:
        self.draft.add(rows, seconds_per_step)

    def observe_draft_call(self, overhead_seconds: float) -> None:
        """Per-round overhead of the draft call beyond the drafting itself (paid once, whatever k)."""
        self._draft_calls += 1
        weight = max(1 - self.decay, 1 / self._draft_calls)  # a plain mean until the EMA takes over
        self.draft_call_seconds += weight * (max(overhead_seconds, 0.0) - self.draft_call_seconds)

    def round_cost(self, k: int, num_seqs: int) -> float:
        """A round drafting k tokens per row, in target decode steps at this batch (1.0 at k = 0)."""
        if k == 0:
            return 1.0
        call = self.draft_call_seconds / self.target.predict(num_seqs)
        return k * self.c(num_seqs) + call + self.v(k, num_seqs)

    def c(self, num_seqs: int) -> float:
        """Draft step / target decode step at this batch."""
        return self.draft.predict(num_seqs) / self.target.predict(num_seqs)

    def v(self, k: int, num_seqs: int) -> float:
        """Verify of k + 1 tokens per row / target decode step, at this batch."""
        return self.target.predict(num_seqs * (k + 1)) / self.target.predict(num_seqs)

    def speedup(self, alpha: float, k: int, num_seqs: int) -> float:
        """Leviathan bound ``E(α, k) / (k·c + v(k))`` at this batch (plus the draft call's overhead when
        drafting is remote); 1.0 at k = 0."""
        if k == 0:
            return 1.0
        return expected_tokens(alpha, k) / self.round_cost(k, num_seqs)


class PressureGate:
    """Speculation on/off from load, with hysteresis so it does not flap."""

    def __init__(self, high: float, low: float):
        self.high, self.low = high, low
        self.speculation_on = True

    def update(self, pressure: float) -> bool:
        if self.speculation_on and pressure > self.high:
            self.speculation_on = False
        elif not self.speculation_on and pressure < self.low:
            self.speculation_on = True
        return self.speculation_on


@dataclass
class Decision:
    ks: list[int]
    reasons: list[str]
    pressure: float = 0.0
    speculation_on: bool = True
    predicted_speedup: list[float] = field(default_factory=list)


class SpeculationPolicy:
    """Per round: k and a reason for each sequence. Owns the tracker, cost model and gate."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.acceptance = AcceptanceTracker(config.ema_decay)
        self.costs = CostModel(config.cost_decay)
        self.gate = PressureGate(config.pressure_high, config.pressure_low)
        self._rounds_without_drafts: dict[str, int] = {}

    def best_round_k(self, alphas: list[float], k_limits: list[int], num_seqs: int) -> tuple[int, float]:
        """One k for the round's speculating rows, maximising the batch's tokens per unit of verify cost.

        A verify forward is as wide as its longest draft (rows are padded to max k + 1) and a draft step runs
        over every row, so the round's cost is set by the largest k for everyone: ``k·c + v(k, num_seqs)``.
        Each speculating row i then emits ``E(α_i, min(k, limit_i))`` tokens, every other row 1. Returns
        ``(k, gain over plain decoding)``; (0, 1.0) unless the gain reaches ``min_gain``.
        """
        others = num_seqs - len(alphas)
        best_k, best_value = 0, float(num_seqs)
        for k in range(1, max(k_limits, default=0) + 1):
            emitted = others + sum(expected_tokens(alpha, min(k, limit)) for alpha, limit in zip(alphas, k_limits))
            value = emitted / self.costs.round_cost(k, num_seqs)
            if value > best_value:
                best_k, best_value = k, value
        gain = best_value / num_seqs
        if gain < self.config.min_gain:
            return 0, 1.0
        return best_k, gain

    def decide(self, segments: list[str], opt_out: list[bool], k_limits: list[int],
               pressure: float) -> Decision:
        """``k_limits[i]``: most drafts sequence i can use (room left in its budget and context).

        Adaptive mode decides once per round (see ``best_round_k``) from every row's segment acceptance;
        all rows that may speculate get that k. A segment still warming up raises it to ``k`` (reason
        ``warmup``); a segment held at k = 0 for ``probe_every`` rounds gets a k = 1 round (``probe``) so its
        acceptance stays measured — cheap, since a probe widens the verify by one token only.
        """
        speculation_on = self.gate.update(pressure)
        num_seqs = len(segments)
        ks, reasons = [0] * num_seqs, [""] * num_seqs
        eligible = []
        for row, (off, limit) in enumerate(zip(opt_out, k_limits)):
            if off or self.config.mode == SpeculationMode.off:
                reasons[row] = "opt_out" if off else "off"
            elif self.config.mode == SpeculationMode.on:
                ks[row], reasons[row] = max(0, min(self.config.k, limit)), "fixed"
            elif not speculation_on:
                reasons[row] = "pressure"
            else:
                eligible.append(row)
        gain = 1.0
        if eligible:
            limits = [min(self.config.k_max, k_limits[row]) for row in eligible]
            k_round, gain = self.best_round_k([self.acceptance.alpha(segments[row]) for row in eligible], limits,
                                              num_seqs)
            reason = "adaptive" if k_round else "low_acceptance"
            warming = {segments[row] for row in eligible
                       if self.acceptance.rounds(segments[row]) < self.config.warmup_rounds}
            idle = {segments[row] for row in eligible
                    if self._rounds_without_drafts.get(segments[row], 0) >= self.config.probe_every}
            if warming and k_round < self.config.k:
                k_round, reason = self.config.k, "warmup"
            elif idle and k_round == 0:
                k_round, reason = 1, "probe"
            for row, limit in zip(eligible, limits):
                ks[row], reasons[row] = max(0, min(k_round, limit)), reason
            for segment in {segments[row] for row in eligible}:
                drafted = any(ks[row] for row in eligible if segments[row] == segment)
                self._rounds_without_drafts[segment] = 0 if drafted else \
                    self._rounds_without_drafts.get(segment, 0) + 1
        return Decision(ks, reasons, pressure, speculation_on, [gain] * num_seqs)

    def observe_round(self, segments: list[str], drafted: list[int], accepted: list[int]) -> None:
        for segment, num_drafted, num_accepted in zip(segments, drafted, accepted):
            self.acceptance.observe(segment, num_drafted, num_accepted)
