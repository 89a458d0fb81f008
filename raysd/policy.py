"""Choosing k: measured acceptance per segment × a measured cost model × a pressure gate.

With α the per-token acceptance of a segment, a round drafting k tokens emits in expectation
``E(α, k) = (1 − α^(k+1)) / (1 − α)`` tokens (Leviathan et al. 2023). Its cost, in units of a plain
(k = 0) round at the current batch, comes from an online fit of the wall time of the rounds actually run
(``CostModel``: the whole round, draft calls, verify and overheads together). The policy picks k ∈
{0..k_max} maximising expected tokens per unit of cost and speculates only when that beats plain decoding
(k = 0, value 1) by ``min_gain``; starting after plain rounds also pays for the draft catching up on what it
missed (``CatchUpCost``), spread over the stretch it should serve. A pressure gate with hysteresis turns
speculation off for everyone above ``pressure_high`` and back on once below ``pressure_low`` for
``pressure_reopen_s``.

The decision is per round, not per sequence: a verify is as wide as its longest draft, so one row at k
makes the whole batch pay for k. The round's k maximises the batch's expected tokens (each row with its own
segment's α) per unit of cost; every row that may speculate gets it.

A goodput check (``GoodputCheck``) then holds back speculation the model wants where rounds that drafted have
measurably delivered fewer tokens per second than plain rounds at this batch size, prefills included.

Every decision carries a reason: ``opt_out``, ``fixed``, ``warmup``, ``pressure``, ``low_acceptance``
(k = 0: nothing pays), ``measured_slower`` (k = 0: the model's choice, measured, lost to plain rounds),
``measure_plain`` (k = 0 for a few rounds, to re-measure plain rounds while speculating),
``probe`` (a short draft for one row, to re-measure a segment held at k = 0; run again the next round while
each one pays for itself, see ``SpeculationPolicy.observe_round``) or ``adaptive`` (k ≥ 1 chosen by the model).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from raysd.config import PolicyConfig, SpeculationMode
from raysd.round_costs import CatchUpCost, CostModel, GoodputCheck, expected_tokens

__all__ = ["AcceptanceTracker", "CatchUpCost", "CostModel", "Decision", "GoodputCheck", "PressureGate",
           "SpeculationPolicy", "expected_tokens"]


@dataclass
class _SegmentAcceptance:
    successes: float = 0.0  # EMA-weighted accepted draft tokens
    trials: float = 0.0  # EMA-weighted accepted tokens + rejections
    rounds: int = 0
    long_successes: float = 0.0  # the same over the long run (``AcceptanceTracker.LONG_DECAY``)
    long_trials: float = 0.0


class AcceptanceTracker:
    """Per-segment per-token acceptance α as an EMA over rounds.

    A row that drafted k and accepted n is n successes and, when n < k, one failure (the prefix rule
    stops at the first rejection); α̂ = successes / trials. The EMA decays once per round, whatever the
    number of the segment's rows in it: decaying per row made α̂ at batch 32 an average over barely one
    round's rows, noisy enough to flip a marginal decision every few rounds. Rounds the segment went
    without drafting age the evidence too, at a quarter of the rate (``IDLE_AGEING``): the text moves on
    meanwhile, so a probe after 32 plain rounds weighs as much as the last ~9 drafting rounds together, not
    one of ~20 (α̂ stayed where it was when drafting stopped, and a segment held at k = 0 by a bad stretch
    stayed there through text the draft predicts well). Not faster: each probe is one row and a few tokens,
    and α̂ would then swing with each one toward the prior.

    Two timescales: the recent estimate is shrunk towards the segment's long-run acceptance (an EMA over
    ~200 drafting rounds, ``LONG_DECAY``) with the weight of ``SHRINK_TRIALS`` trials, not towards a fixed 0.5.
    At batch 1 the recent EMA holds only ~70 trials (a few tokens a round), and text moves it far more than
    sampling would: served code read α̂ 0.62–0.93 after windows of the same prompts, around a long-run ≈ 0.75,
    against a start threshold ≈ 0.65. Each dip below stopped drafting, and as the evidence aged while held at
    k = 0 α̂ drifted towards 0.5, below the threshold, so only probes could lift it: code drafted in 45% of
    batch-1 rounds where always-on paid 1.26× plain. Anchored at the long run, ageing brings α̂ back to what
    the segment usually does (code: drafting again; prose, long-run below break-even: still not). At large
    batches a round brings ~100 trials and the anchor weighs next to nothing.
    """

    IDLE_AGEING = 0.25
    LONG_DECAY = 0.995  # per drafting round of the segment
    SHRINK_TRIALS = 20.0

    def __init__(self, ema_decay: float, prior_alpha: float = 0.5, prior_weight: float = 2.0):
        self.ema_decay = ema_decay
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.segments: dict[str, _SegmentAcceptance] = {}

    def observe(self, segment: str, drafted: int, accepted: int) -> None:
        """One round with one row of ``segment``."""
        self.observe_round(segment, [(drafted, accepted)])

    def observe_round(self, segment: str, rows: list[tuple[int, int]], elapsed_rounds: int = 1) -> None:
        """One round's ``(drafted, accepted)`` rows of ``segment``, ``elapsed_rounds`` after its previous
        drafting round; rows that drafted nothing say nothing."""
        rows = [(drafted, accepted) for drafted, accepted in rows if drafted > 0]
        if not rows:
            return
        state = self.segments.setdefault(segment, _SegmentAcceptance())
        decay = self.ema_decay ** (1 + self.IDLE_AGEING * max(0, elapsed_rounds - 1))
        successes = sum(accepted for _, accepted in rows)
        trials = sum(accepted + (1 if accepted < drafted else 0) for drafted, accepted in rows)
        state.successes = decay * state.successes + successes
        state.trials = decay * state.trials + trials
        state.long_successes = self.LONG_DECAY * state.long_successes + successes
        state.long_trials = self.LONG_DECAY * state.long_trials + trials
        state.rounds += 1

    def alpha(self, segment: str) -> float:
        """The recent α̂, shrunk towards ``long_run_alpha`` (see the class docstring)."""
        state = self.segments.get(segment, _SegmentAcceptance())
        return ((state.successes + self.SHRINK_TRIALS * self.long_run_alpha(segment))
                / (state.trials + self.SHRINK_TRIALS))

    def long_run_alpha(self, segment: str) -> float:
        """α̂ over the segment's last ~200 drafting rounds (the prior, ``prior_alpha``, before any)."""
        state = self.segments.get(segment, _SegmentAcceptance())
        return ((state.long_successes + self.prior_alpha * self.prior_weight)
                / (state.long_trials + self.prior_weight))

    def rounds(self, segment: str) -> int:
        return self.segments.get(segment, _SegmentAcceptance()).rounds


class PressureGate:
    """Speculation on/off from load, with hysteresis so it does not flap: off when pressure exceeds ``high``;
    back on when it is below ``low`` and no update saw it at ``low`` or above for ``reopen_s`` seconds
    (``clock``). The hold is for dips, not for quiet: after an idle spell longer than ``reopen_s`` the first
    round reopens it at once.

    Why hold: under closed-loop load requests that finish together are replaced within a round, and the
    round between sees the batch dip. Reopening there (served JSON at 32 users: batch 32 → 10 → 32) started
    drafting for a single round that fed the draft every row's missed tokens first: 0.5 s, six plain rounds."""

    def __init__(self, high: float, low: float, reopen_s: float = 0.0, clock=time.monotonic):
        self.high, self.low, self.reopen_s, self.clock = high, low, reopen_s, clock
        self.speculation_on = True
        self._busy_at = -math.inf  # when an update last saw pressure ≥ low

    def update(self, pressure: float) -> bool:
        now = self.clock()
        if self.speculation_on and pressure > self.high:
            self.speculation_on = False
        elif not self.speculation_on and pressure < self.low and now - self._busy_at >= self.reopen_s:
            self.speculation_on = True
        if pressure >= self.low:
            self._busy_at = now
        return self.speculation_on


@dataclass
class Decision:
    ks: list[int]
    reasons: list[str]
    pressure: float = 0.0
    speculation_on: bool = True
    predicted_speedup: list[float] = field(default_factory=list)
    catchup_tokens: list[int] = field(default_factory=list)  # per row: what the draft missed (see ``decide``)


class SpeculationPolicy:
    """Per round: k and a reason for each sequence. Owns the tracker, cost model and gate."""

    PROBE_BUDGET = 0.05  # a probe may cost this share of the ``probe_every`` rounds it serves (its length)
    PROBE_SHARE = 0.02  # probes cost at most this share of throughput on average (their spacing)
    SWITCH_HORIZON = 8  # fewest rounds a start's catch-up is spread over (see ``switch_cost``)
    NEAR_FREE_BUDGET = 0.01  # share of throughput probes more often than ``probe_every`` may cost
    PROBE_CHAIN = 8  # most probes in a row while each pays for itself (see ``observe_round``)

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.acceptance = AcceptanceTracker(config.ema_decay)
        self.costs = CostModel(config.cost_decay)
        self.gate = PressureGate(config.pressure_high, config.pressure_low, config.pressure_reopen_s)
        self.goodput = GoodputCheck()
        self.catchup = CatchUpCost()
        self._rounds_without_drafts: dict[str, int] = {}
        self._speculating = False  # did the last round draft for the batch (not just a probe)?
        self._goodput_speculating = False  # did the last round the goodput check saw draft?
        self._probes = 0
        self._idle_before: dict[str, int] = {}  # segment → plain rounds before this round's drafts
        self._probe_chain: dict[str, int] = {}  # segment → probes in a row that paid for themselves

    def best_round_k(self, alphas: list[float], k_limits: list[int], num_seqs: int,
                     switch_cost: float = 0.0) -> tuple[int, float]:
        """One k for the round's speculating rows, maximising the batch's tokens per unit of verify cost.

        A verify forward is as wide as its longest draft (rows are padded to max k + 1) and a draft step runs
        over every row, so the round's cost is set by the largest k for everyone: ``k·c + v(k, num_seqs)``.
        Each speculating row i then emits ``E(α_i, min(k, limit_i))`` tokens, every other row 1; ``switch_cost``
        (plain rounds) is added to every k ≥ 1: what starting costs once, spread over the rounds it should serve.
        Returns
        ``(k, gain over plain decoding)``; (0, 1.0) unless the gain reaches the switch threshold: ``min_gain``
        to start speculating, halfway between break-even and it to keep on. The band is hysteresis: starting
        makes the draft catch up on every row's tokens decoded meanwhile, a cost the fit does not price, so a
        gain hovering near ``min_gain`` must not toggle the batch on and off every few rounds (sweep run 7:
        1.5 tokens a chunk at code c=16, below both fixed policies).
        """
        others = num_seqs - len(alphas)
        best_k, best_value = 0, float(num_seqs)
        for k in range(1, max(k_limits, default=0) + 1):
            emitted = others + sum(expected_tokens(alpha, min(k, limit)) for alpha, limit in zip(alphas, k_limits))
            value = emitted / (self.costs.round_cost(k, num_seqs) + switch_cost)
            if value > best_value:
                best_k, best_value = k, value
        gain = best_value / num_seqs
        if gain < ((1.0 + self.config.min_gain) / 2 if self._speculating else self.config.min_gain):
            return 0, 1.0
        return best_k, gain

    def decide(self, segments: list[str], opt_out: list[bool], k_limits: list[int],
               pressure: float, catchup_tokens: list[int] | None = None) -> Decision:
        """``k_limits[i]``: most drafts sequence i can use (room left in its budget and context);
        ``catchup_tokens[i]``: tokens the draft must be fed for sequence i before it can draft for it (what it
        missed while the row did not draft; its whole prompt if it never drafted). None: not known (taken as 0).

        Adaptive mode decides once per round (see ``best_round_k``) from every row's segment acceptance;
        all rows that may speculate get that k. A segment still warming up raises it to ``k`` (reason
        ``warmup``); a segment held at k = 0 for ``probe_every`` rounds (fewer near break-even, see
        ``probe_interval``) gets a probe (``probe``): ``probe_k`` for its one row the draft is least behind on, so
        its acceptance stays measured. One row, not all: a draft that sat out k = 0 rounds must first catch up on
        every token it missed, and doing that for 32 rows every ``probe_every`` rounds cost the served path ~15%
        of its throughput at k = 0 (sweep run 7).

        Starting to draft after plain rounds (not while speculating) pays the catch-up of the rows that would
        draft: ``CatchUpCost`` seconds, spread over the stretch (``switch_cost``), added to the cost of every k ≥ 1.
        Unpriced, a gain hovering at the threshold started drafting every few rounds on served prose at batch 16,
        and each start (the draft fed ~30 missed tokens a row and the new prompts) took ~4 plain rounds.
        """
        speculation_on = self.gate.update(pressure)
        self._speculating = self._speculating and speculation_on
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
        catchup_tokens = catchup_tokens or [0] * num_seqs
        if eligible:
            limits = [min(self.config.k_max, k_limits[row]) for row in eligible]
            starting = [row for row, limit in zip(eligible, limits) if limit > 0 and not self._speculating]
            switch_cost = self.switch_cost(sum(catchup_tokens[row] for row in starting), num_seqs,
                                           [k_limits[row] + 1 for row in starting]) if starting else 0.0
            k_round, gain = self.best_round_k([self.acceptance.alpha(segments[row]) for row in eligible], limits,
                                              num_seqs, switch_cost)
            reason = "adaptive" if k_round else "low_acceptance"
            if k_round and self.goodput.speculation_slower(num_seqs):
                k_round, reason = 0, "measured_slower"
            elif k_round and self.goodput.plain_sample_due(num_seqs):
                k_round, reason = 0, "measure_plain"
            warming = {segments[row] for row in eligible
                       if self.acceptance.rounds(segments[row]) < self.config.warmup_rounds}
            idle = self._idle_segments(eligible, segments, limits, catchup_tokens, reason == "low_acceptance")
            if warming and k_round < self.config.k:
                k_round, reason = self.config.k, "warmup"
            for row, limit in zip(eligible, limits):
                ks[row], reasons[row] = max(0, min(k_round, limit)), reason
            if any(limits):  # a round of prefills only says nothing about the regime
                self._speculating = k_round > 0
            if idle and k_round == 0:
                self._probe_one_row_each(idle, eligible, segments, limits, catchup_tokens, ks, reasons)
            for segment in {segments[row] for row in eligible}:
                if not any(reasons[row] == "probe" for row in eligible if segments[row] == segment):
                    self._probe_chain.pop(segment, None)  # drafting for real, or no probe: the chain ends
                if any(ks[row] for row in eligible if segments[row] == segment):
                    self._idle_before[segment] = self._rounds_without_drafts.get(segment, 0)
                    self._rounds_without_drafts[segment] = 0
                else:
                    self._rounds_without_drafts[segment] = self._rounds_without_drafts.get(segment, 0) + 1
        return Decision(ks, reasons, pressure, speculation_on, [gain] * num_seqs, catchup_tokens)

    def switch_cost(self, catchup_tokens: int, num_seqs: int, remaining: list[int]) -> float:
        """What starting to draft costs once (the draft fed ``catchup_tokens`` first), in plain rounds at this
        batch, per round of the stretch it should serve: the rows' remaining tokens (``remaining``, mean) at
        ~2 tokens a drafting round, and at least ``SWITCH_HORIZON`` rounds. A new request's draft prefill is paid
        once in its life, so it is spread over that life (over 8 rounds, it kept batch-1 prose at k = 0)."""
        horizon = max(self.SWITCH_HORIZON, sum(remaining) / max(len(remaining), 1) / 2)
        return self.catchup.predict(catchup_tokens) / self.costs.round_seconds(0, num_seqs) / horizon

    def observe_catchup(self, catchup_tokens: int, seconds: float) -> None:
        """A drafting round's rows had ``catchup_tokens`` to feed (``Decision.catchup_tokens`` of the rows that
        drafted); the draft spent ``seconds`` feeding them (``DraftProposal.catchup_seconds``)."""
        self.catchup.observe(catchup_tokens, seconds)

    def _idle_segments(self, eligible: list[int], segments: list[str], limits: list[int],
                       catchup_tokens: list[int], model_holds: bool) -> set[str]:
        """The segments due a probe this round. Sooner than ``probe_every`` (``probe_interval``, and a chain of
        probes that paid) only where the model itself holds k = 0 (``model_holds``): where the goodput check
        holds speculation back, or plain rounds are being re-measured, the fitted costs those shortcuts price
        probes with are what is in doubt."""
        behind: dict[str, int] = {}  # per segment: what its probe row (the least behind) must catch up
        for row, limit in zip(eligible, limits):
            if limit > 0:
                behind[segments[row]] = min(behind.get(segments[row], catchup_tokens[row]), catchup_tokens[row])

        def due(segment: str) -> bool:
            idle_rounds = self._rounds_without_drafts.get(segment, 0)
            if segment not in behind:
                return idle_rounds >= self.config.probe_every  # no row can draft: a probe would find none
            alpha = self.acceptance.alpha(segment)
            if idle_rounds >= self.probe_spacing(alpha, len(segments)):
                return True
            if not model_holds:
                return False
            if segment in self._probe_chain:
                return True
            return idle_rounds > 0 and idle_rounds >= self.probe_interval(  # 0: drafting, nothing to price
                alpha, len(segments), behind[segment])
        return {segment for segment in {segments[row] for row in eligible} if due(segment)}

    def _probe_loss(self, alpha: float, num_seqs: int, catchup_tokens: int) -> float:
        """What a probe costs over a plain round, in plain rounds at this batch: its round's fitted cost at
        the probe's longest length and its row's draft catching up on ``catchup_tokens``, less the tokens it
        should bring (one row at ``alpha``, every other row one)."""
        k = self._longest_probe(num_seqs)
        catchup = self.catchup.predict(catchup_tokens) / self.costs.round_seconds(0, num_seqs)
        return self.costs.round_cost(k, num_seqs) + catchup - (num_seqs - 1 + expected_tokens(alpha, k)) / num_seqs

    def probe_spacing(self, alpha: float, num_seqs: int) -> int:
        """Rounds between probes of a segment held at k = 0: ``probe_every``, or more where one probe's round
        would cost more than ``PROBE_SHARE`` of them (``_probe_loss`` without the catch-up: the row pays that
        once before it can ever draft, and a probe only pays it sooner). At batch 16 one row's probe widens the
        whole batch's verify: served prose paid 2–3 plain rounds a probe (100–140 ms against 40–45), one every
        ~35 rounds, ~6% of throughput at k = 0 (sweep run 23: adaptive 0.85 of plain decoding at prose c = 16).
        At batch 1 a probe near break-even about pays for itself and stays ``probe_every`` apart or sooner."""
        loss = self._probe_loss(alpha, num_seqs, 0)
        return max(self.config.probe_every, math.ceil(loss / self.PROBE_SHARE))

    def probe_interval(self, alpha: float, num_seqs: int, catchup_tokens: int = 0) -> int:
        """Rounds a segment held at k = 0 (acceptance ``alpha``) waits for its next probe at this batch:
        ``probe_spacing``, or fewer where a probe is expected to cost little (``_probe_loss``, its row's catch-up
        on ``catchup_tokens`` included), kept within ``NEAR_FREE_BUDGET`` of the rounds between probes.

        Near break-even a probe at batch 1 is a drafting round that about pays for itself, and there one more
        measurement is the likeliest to change the decision; far below it (prose, or any large batch, where
        one row's drafts do not pay for the batch's wider verify) probes stay ``probe_spacing`` apart."""
        loss = self._probe_loss(alpha, num_seqs, catchup_tokens)
        return max(1, min(self.probe_spacing(alpha, num_seqs), math.ceil(loss / self.NEAR_FREE_BUDGET)))

    def _longest_probe(self, num_seqs: int) -> int:
        budget = 1.0 + self.PROBE_BUDGET * self.config.probe_every
        return max([k for k in range(1, self.config.k + 1) if self.costs.round_cost(k, num_seqs) <= budget],
                   default=1)

    def probe_k(self, num_seqs: int) -> int:
        """The draft length of the next probe at this batch: the longest k ≤ ``k`` whose predicted extra cost
        over a plain round stays within ``PROBE_BUDGET`` of the ``probe_every`` rounds it serves (at least 1),
        alternating with half of it (or with 2, when that is 1).

        Long where it is cheap (batch 1: a probe of 3–4 tokens measures acceptance over several positions and
        the cost of the k that would be used), 1–2 at large batches, where widening the whole batch's verify
        is dear. Two lengths let the cost fit tell what drafting costs once per round (the draft call, a wider
        verify) from what each further token costs; probes at one length left that split to the prior, which
        priced k = 4 at 4.3 plain rounds where it costs 2.4 and held the demo pair at k = 0 at batch 1."""
        longest = self._longest_probe(num_seqs)
        self._probes += 1
        other = longest // 2 if longest > 1 else 2  # a second length, however dear: the fit needs two
        return longest if self._probes % 2 else min(other, self.config.k)

    def _probe_one_row_each(self, idle: set[str], eligible: list[int], segments: list[str], limits: list[int],
                            catchup_tokens: list[int], ks: list[int], reasons: list[str]) -> None:
        """A probe (``probe_k``) for the row of each idle segment with least for the draft to catch up on."""
        k = self.probe_k(len(segments))
        for segment in idle:
            rows = [row for row, limit in zip(eligible, limits) if segments[row] == segment and limit > 0]
            if rows:
                row = min(rows, key=lambda r: catchup_tokens[r])
                ks[row], reasons[row] = min(k, limits[eligible.index(row)]), "probe"

    def describe(self, num_seqs: int) -> dict:
        """What the policy believes now, for /health: each segment's α and the cost model at ``num_seqs``
        rows (seconds, and in target-step units the round cost of each k; what feeding the draft a token it
        missed costs) — enough to see why k is what it is."""
        num_seqs = max(num_seqs, 1)
        return {
            "segments": {segment: {"alpha": round(self.acceptance.alpha(segment), 4),
                                   "alpha_long_run": round(self.acceptance.long_run_alpha(segment), 4),
                                   "rounds": self.acceptance.rounds(segment)}
                         for segment in self.acceptance.segments},
            "cost": {"batch": num_seqs,
                     "rounds_observed": self.costs.rounds,
                     "round_seconds": {k: round(self.costs.round_seconds(k, num_seqs), 5)
                                       for k in range(self.config.k_max + 1)},
                     "round_cost": {k: round(self.costs.round_cost(k, num_seqs), 3)
                                    for k in range(self.config.k_max + 1)},
                     "catchup_seconds_per_token": round(self.catchup.predict(1), 7)},
            "speculation_on": self.gate.speculation_on,
        }

    def observe_goodput(self, reasons: list[str], drafted: list[int], tokens: int, seconds: float) -> None:
        """A finished round's decoding rows (their ``reasons`` and ``drafted``; ``tokens`` they emitted in
        ``seconds`` of wall time, the draft's catch-up included, the target's prefill not; rows prefilled this
        round are the caller's to leave out) for the goodput check; probe rounds are left out (one row drafting
        says nothing about either arm), and so is a round that starts drafting after plain ones (what the draft
        replays there is the price of switching, not of drafting: ``decide`` prices it when it starts)."""
        if "probe" in reasons or not drafted:  # no rows: a round of prefills only
            return
        speculating = any(drafted)
        switching = speculating and not self._goodput_speculating
        self._goodput_speculating = speculating
        if not switching:
            num_seqs = len(drafted)
            self.goodput.observe(num_seqs, speculating, tokens, seconds, self.costs.round_seconds(0, num_seqs))

    def observe_round(self, segments: list[str], drafted: list[int], accepted: list[int],
                      reasons: list[str] | None = None) -> None:
        """A finished round's rows: segment, drafted and accepted tokens, and (when known) the reason each
        row's k was chosen (``Decision.reasons``).

        A probe that paid for itself — its row accepted every draft, and the round (that row's k + 1 tokens,
        every other row's one) delivered at least a plain round's tokens per unit of the round's fitted cost —
        is run again the next round, up to ``PROBE_CHAIN`` in a row; any other outcome ends the chain. One probe
        every ``probe_every`` rounds moves α̂ only a little (a few tokens against the evidence of the drafting
        rounds before), so a segment held at k = 0 by a bad stretch stayed there through hundreds of rounds of
        text the draft predicted well (served code at batch 1: probe after probe accepting everything, k = 0
        for whole requests, adaptive at 0.88 of always-on). At batch 1 such a probe is an ordinary drafting
        round that pays; at batch 16 one row's drafts do not pay for the batch's wider verify, so no chain."""
        if reasons is not None:
            self._extend_probe_chains(segments, drafted, accepted, reasons)
        by_segment: dict[str, list[tuple[int, int]]] = {}
        for segment, num_drafted, num_accepted in zip(segments, drafted, accepted):
            by_segment.setdefault(segment, []).append((num_drafted, num_accepted))
        for segment, rows in by_segment.items():
            self.acceptance.observe_round(segment, rows, 1 + self._idle_before.pop(segment, 0))

    def _extend_probe_chains(self, segments: list[str], drafted: list[int], accepted: list[int],
                             reasons: list[str]) -> None:
        """Mark each segment whose probe row paid for itself to be probed again (see ``observe_round``)."""
        num_seqs = len(segments)
        for row, reason in enumerate(reasons):
            if reason != "probe":
                continue
            segment, k = segments[row], drafted[row]
            paid = 0 < k == int(accepted[row]) and num_seqs + k >= num_seqs * self.costs.round_cost(k, num_seqs)
            chain = self._probe_chain.get(segment, 0) + 1
            if paid and chain <= self.PROBE_CHAIN:
                self._probe_chain[segment] = chain
            else:
                self._probe_chain.pop(segment, None)
