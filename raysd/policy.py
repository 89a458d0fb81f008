"""Choosing k: measured acceptance per segment × a measured cost model × a pressure gate.

With α the per-token acceptance of a segment, a round drafting k tokens emits in expectation
``E(α, k) = (1 − α^(k+1)) / (1 − α)`` tokens (Leviathan et al. 2023). Its cost, in units of a plain
(k = 0) round at the current batch, comes from an online fit of the wall time of the rounds actually run
(``CostModel``: the whole round, draft calls, verify and overheads together). The policy picks k ∈
{0..k_max} maximising expected tokens per unit of cost and speculates only
when that beats plain decoding (k = 0, value 1) by ``min_gain``. A pressure gate with hysteresis turns
speculation off for everyone above ``pressure_high`` and back on below ``pressure_low``.

The decision is per round, not per sequence: a verify is as wide as its longest draft, so one row at k
makes the whole batch pay for k. The round's k maximises the batch's expected tokens (each row with its own
segment's α) per unit of cost; every row that may speculate gets it.

A goodput check (``GoodputCheck``) then holds back speculation the model wants where rounds that drafted have
measurably delivered fewer tokens per second than plain rounds at this batch size, prefills included.

Every decision carries a reason: ``opt_out``, ``fixed``, ``warmup``, ``pressure``, ``low_acceptance``
(k = 0: nothing pays), ``measured_slower`` (k = 0: the model's choice, measured, lost to plain rounds),
``measure_plain`` (k = 0 for a few rounds, to re-measure plain rounds while speculating),
``probe`` (a short draft for one row, to re-measure a segment held at k = 0) or ``adaptive`` (k ≥ 1 chosen by
the model).
"""

from __future__ import annotations

import math
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

    A row that drafted k and accepted n is n successes and, when n < k, one failure (the prefix rule
    stops at the first rejection); α̂ = successes / trials. The EMA decays once per round, whatever the
    number of the segment's rows in it: decaying per row made α̂ at batch 32 an average over barely one
    round's rows, noisy enough to flip a marginal decision every few rounds. Rounds the segment went
    without drafting age the evidence too, at a quarter of the rate (``IDLE_AGEING``): the text moves on
    meanwhile, so a probe after 32 plain rounds weighs as much as the last ~9 drafting rounds together, not
    one of ~20 (α̂ stayed where it was when drafting stopped, and a segment held at k = 0 by a bad stretch
    stayed there through text the draft predicts well). Not faster: each probe is one row and a few tokens,
    and α̂ would then swing with each one toward the prior.
    """

    IDLE_AGEING = 0.25

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
        state.successes = decay * state.successes + sum(accepted for _, accepted in rows)
        state.trials = decay * state.trials + sum(accepted + (1 if accepted < drafted else 0)
                                                  for drafted, accepted in rows)
        state.rounds += 1

    def alpha(self, segment: str) -> float:
        state = self.segments.get(segment, _SegmentAcceptance())
        return (state.successes + self.prior_alpha * self.prior_weight) / (state.trials + self.prior_weight)

    def rounds(self, segment: str) -> int:
        return self.segments.get(segment, _SegmentAcceptance()).rounds


class CostModel:
    """Online fit of what a whole round costs, measured end to end:
    ``T(n, k) ≈ a + b·n + [k > 0]·s + k·(c + d·n)`` seconds for a round over n rows drafting k tokens each
    (plan to commit, prefill and draft catch-up excluded). ``s`` is what any drafting round pays once — the
    call to the draft actor and back — which a fit linear in k would spread over k and so under-rate small k.

    Measuring the round itself — rather than adding up a draft step, a verify forward and a call overhead
    fitted separately — counts every cost a round really pays (remote hops, serialisation, the router's own
    work, the draft catching up) in the one place it is paid; the component sum under-rated large k by
    ~30% on the served path. The fit is exponentially forgetting least squares (of relative error) over
    the features ``[1, n, [k > 0], k, k·n]``, regularised towards a fixed prior so it is defined before the
    rounds seen span three values of k. The prior is the in-process demo pair on 2 CPU cores (engine rounds
    at batch 1: plain 10 ms, k = 1 16.6 ms, k = 4 24 ms, k = 8 36.6 ms): drafting at all ≈ 0.45 of a plain
    round, each drafted token ≈ 0.25 more at batch 1 and ≈ 0.45 at batch 16.
    """

    def __init__(self, decay: float = 0.98, target_step_seconds: float = 0.015, prior_weight: float = 0.02):
        self.decay = decay
        self.gram = [[0.0] * self.NUM_FEATURES for _ in range(self.NUM_FEATURES)]
        self.moment = [0.0] * self.NUM_FEATURES
        self.prior_gram = [[0.0] * self.NUM_FEATURES for _ in range(self.NUM_FEATURES)]
        self.prior_moment = [0.0] * self.NUM_FEATURES
        base = target_step_seconds
        for num_seqs in (1, 8, 32):
            for k in (0, 1, 2, 4, 8):
                seconds = (base * (1 + 0.05 * num_seqs) + (k > 0) * 0.45 * base
                           + k * base * (0.25 + 0.036 * num_seqs))
                self._accumulate(self.prior_gram, self.prior_moment, num_seqs, k, seconds, prior_weight)
        self.rounds = 0
        self._coefficients: list[float] | None = None

    NUM_FEATURES = 5

    @staticmethod
    def _features(num_seqs: int, k: int) -> list[float]:
        return [1.0, float(num_seqs), float(k > 0), float(k), float(k * num_seqs)]

    def _accumulate(self, gram, moment, num_seqs: int, k: int, seconds: float, weight: float) -> None:
        """Add one point, weighted by 1/seconds²: relative errors count, so the cheap small-batch rounds (where
        the plain round, the denominator of every ratio, is small) are fitted as well as the big ones."""
        weight /= seconds * seconds
        features = self._features(num_seqs, k)
        for i in range(len(features)):
            moment[i] += weight * features[i] * seconds
            for j in range(len(features)):
                gram[i][j] += weight * features[i] * features[j]

    def observe_round(self, num_seqs: int, k: int, seconds: float) -> None:
        """One finished round: ``num_seqs`` rows, longest draft ``k``, ``seconds`` wall time without prefill."""
        if num_seqs <= 0 or seconds <= 0:
            return
        for i in range(self.NUM_FEATURES):
            self.moment[i] *= self.decay
            for j in range(self.NUM_FEATURES):
                self.gram[i][j] *= self.decay
        self._accumulate(self.gram, self.moment, num_seqs, k, seconds, 1.0)
        self.rounds += 1
        self._coefficients = None

    def _solve(self) -> list[float]:
        if self._coefficients is None:
            import numpy

            gram = numpy.array(self.gram) + numpy.array(self.prior_gram)
            moment = numpy.array(self.moment) + numpy.array(self.prior_moment)
            self._coefficients = numpy.linalg.lstsq(gram, moment, rcond=None)[0].tolist()
        return self._coefficients

    def round_seconds(self, k: int, num_seqs: int) -> float:
        """Predicted wall time of a round; never below a plain round, never cheaper for a larger k."""
        a, b, once, c, d = self._solve()
        plain = max(a + b * num_seqs, 1e-4)
        if k <= 0:
            return plain
        per_draft = max(c + d * num_seqs, 1e-6)  # drafting more never makes a round cheaper
        # ``once`` may fit negative (costs seen at few k, convex in k): bounded by the plain round, not clamped
        # alone, which would price the small k it was fitted on wrongly
        return max(plain + once + k * per_draft, plain + 1e-6)

    def round_cost(self, k: int, num_seqs: int) -> float:
        """A round drafting k tokens per row, in plain-round units at this batch (1.0 at k = 0)."""
        return self.round_seconds(k, num_seqs) / self.round_seconds(0, num_seqs)

    def speedup(self, alpha: float, k: int, num_seqs: int) -> float:
        """Leviathan's ``E(α, k)`` over the round's measured cost; 1.0 at k = 0."""
        if k == 0:
            return 1.0
        return expected_tokens(alpha, k) / self.round_cost(k, num_seqs)


class GoodputCheck:
    """Measured output of whole rounds, speculating vs plain, per batch-size bucket.

    The cost model prices a round without the draft catching up, and as a function linear in the batch; a
    steady state still pays the catch-up (every new request is prefilled by the draft too, and a draft that
    sat out rounds replays them) and at large batches the fit misses by up to 2× (prose at batch 32: a round
    that starts drafting, the draft catching up on every row, took 4.4 plain rounds). This check looks at what
    rounds really delivered: tokens emitted per plain-round time at the round's batch size (the fit's plain
    round, ``plain_seconds``: so a bucket's batch sizes, which differ by up to 2×, compare as like for like).

    Decoding is compared, not prefill: the caller subtracts the target's prefill time and leaves out the rows
    it prefilled (their first token came from it). Every request pays that prefill once whichever arm runs,
    but it lands on whichever round admits, and rounds that admit lean plain (their new rows cannot draft,
    which lowers the model's gain); counted in, it made plain look slower than it is (served prose at batch
    16: a prefill round took 85 ms against 31, and plain rounds read 0.37 tokens/ms against drafting's 0.42,
    where plain rounds without a prefill delivered 0.50). The draft's catch-up is counted (a new request's
    draft prefill is a steady cost of drafting), except in a round that starts drafting after plain ones,
    which the caller leaves out: there the draft replays every row's tokens since it last drafted, a price of
    switching paid once, and it dominated the few rounds a re-measurement runs (served JSON at batch 16: 0.32
    tokens/ms measured against plain's 0.39, where steady always-on delivered 0.43–0.45).

    Kept as an EMA per arm ("speculating": rounds that drafted for the batch; "plain": rounds that drafted
    nothing; probe rounds, one row drafting, are neither) in buckets of the batch size centred on powers of two
    (12–22 rows is one, 23–45 the next: a served batch at 16 or 32 users dips a few rows below while requests turn
    over, and must stay in one bucket). Speculation the model wants is held back (reason ``measured_slower``)
    where both arms have recent evidence and speculating delivered less. Each arm is re-measured from scratch
    after ``RETRY_ROUNDS`` rounds of the other in a bucket (the text or the load may have changed): held back that
    long, the speculating evidence is dropped and the model's choice runs again for the few rounds a measurement
    takes; speculating that long, ``SAMPLE_ROUNDS`` plain rounds are run (reason ``measure_plain``). A round of
    the slower arm in every ~60: ≤ 1–2% of throughput where the two differ by 50%.

    Memory, evidence and retry periods count rounds of ``FULL_BATCH`` rows: a round of n < 16 rows weighs
    n / 16. A small batch pays once per request what a large one spreads over many rows (the draft prefilling
    a new prompt: at batch 1 one round in ~20 cost several), so ten rounds of memory at batch 1 swung with
    where the last request began (code at batch 1 read 2.0 then 0.94 of plain within a request) and held back
    speculation that paid 1.35× there. The price: at batch 1 an arm is believed after ~80 rounds, and a
    held-back bucket is retried after 4,800 rounds (about a minute of batch-1 traffic here).
    """

    DECAY = 0.9  # per full-batch round of the same arm and bucket: ~10 of them in memory
    MIN_WEIGHT = 4.0  # EMA-weighted full-batch rounds an arm needs before it is believed (5 of them)
    RETRY_ROUNDS = 300
    SAMPLE_ROUNDS = 5
    FULL_BATCH = 16

    def __init__(self):
        # (bucket, speculating) → EMA of [tokens emitted, tokens plain rounds would have emitted meanwhile, rounds]
        self.arms: dict[tuple[int, bool], list[float]] = {}
        # per bucket, in full-batch rounds: held back since its speculating arm was measured; speculating since
        # its plain arm was; plain still to run for a fresh measurement
        self.held_back: dict[int, float] = {}
        self.speculated: dict[int, float] = {}
        self.sampling: dict[int, float] = {}

    def weight(self, num_seqs: int) -> float:
        """A round of ``num_seqs`` rows in full-batch rounds (1.0 from ``FULL_BATCH`` rows)."""
        return min(num_seqs, self.FULL_BATCH) / self.FULL_BATCH

    @staticmethod
    def bucket(num_seqs: int) -> int:
        """round(log2 n): 1 → 0, 2 → 1, 3–5 → 2, 6–11 → 3, 12–22 → 4, 23–45 → 5, 46–90 → 6."""
        return round(math.log2(max(num_seqs, 1)))

    def observe(self, num_seqs: int, speculating: bool, tokens: int, seconds: float, plain_seconds: float) -> None:
        """A round of ``num_seqs`` rows emitted ``tokens`` in ``seconds``; a plain round at that batch is fitted
        at ``plain_seconds``."""
        if seconds <= 0 or num_seqs <= 0 or plain_seconds <= 0:
            return
        bucket = self.bucket(num_seqs)
        plain_tokens = num_seqs * seconds / plain_seconds
        arm = self.arms.setdefault((bucket, speculating), [0.0, 0.0, 0.0])
        weight = self.weight(num_seqs)
        decay = self.DECAY ** weight
        arm[:] = [decay * arm[0] + tokens, decay * arm[1] + plain_tokens, decay * arm[2] + weight]
        if speculating:
            self.held_back[bucket] = 0
            self.speculated[bucket] = self.speculated.get(bucket, 0) + weight
        else:
            self.speculated[bucket] = 0

    def rate(self, num_seqs: int, speculating: bool) -> float | None:
        """That arm's tokens per plain-round token at this batch size (prefills make plain rounds < 1);
        None without enough evidence."""
        arm = self.arms.get((self.bucket(num_seqs), speculating))
        if arm is None or arm[2] < self.MIN_WEIGHT or arm[1] <= 0:
            return None
        return arm[0] / arm[1]

    def speculation_slower(self, num_seqs: int) -> bool:
        """True: hold back the speculation the model wants this round (counted towards the retry)."""
        speculating, plain = self.rate(num_seqs, True), self.rate(num_seqs, False)
        if speculating is None or plain is None or speculating >= plain:
            return False
        bucket = self.bucket(num_seqs)
        self.held_back[bucket] = self.held_back.get(bucket, 0) + self.weight(num_seqs)
        if self.held_back[bucket] >= self.RETRY_ROUNDS:  # stale: measure speculation afresh
            del self.arms[(bucket, True)]
            self.held_back[bucket] = 0
        return True

    def plain_sample_due(self, num_seqs: int) -> bool:
        """True: run this round plain (the model wants to draft) to re-measure plain rounds here."""
        bucket = self.bucket(num_seqs)
        if self.speculated.get(bucket, 0) >= self.RETRY_ROUNDS:
            self.arms.pop((bucket, False), None)
            self.sampling[bucket] = self.SAMPLE_ROUNDS
            self.speculated[bucket] = 0
        if self.sampling.get(bucket, 0) > 0:
            self.sampling[bucket] -= self.weight(num_seqs)
            return True
        return False


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

    PROBE_BUDGET = 0.05  # share of throughput probes may cost while the policy holds k = 0

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.acceptance = AcceptanceTracker(config.ema_decay)
        self.costs = CostModel(config.cost_decay)
        self.gate = PressureGate(config.pressure_high, config.pressure_low)
        self.goodput = GoodputCheck()
        self._rounds_without_drafts: dict[str, int] = {}
        self._speculating = False  # did the last round draft for the batch (not just a probe)?
        self._goodput_speculating = False  # did the last round the goodput check saw draft?
        self._probes = 0
        self._idle_before: dict[str, int] = {}  # segment → plain rounds before this round's drafts

    def best_round_k(self, alphas: list[float], k_limits: list[int], num_seqs: int) -> tuple[int, float]:
        """One k for the round's speculating rows, maximising the batch's tokens per unit of verify cost.

        A verify forward is as wide as its longest draft (rows are padded to max k + 1) and a draft step runs
        over every row, so the round's cost is set by the largest k for everyone: ``k·c + v(k, num_seqs)``.
        Each speculating row i then emits ``E(α_i, min(k, limit_i))`` tokens, every other row 1. Returns
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
            value = emitted / self.costs.round_cost(k, num_seqs)
            if value > best_value:
                best_k, best_value = k, value
        gain = best_value / num_seqs
        if gain < ((1.0 + self.config.min_gain) / 2 if self._speculating else self.config.min_gain):
            return 0, 1.0
        return best_k, gain

    def decide(self, segments: list[str], opt_out: list[bool], k_limits: list[int],
               pressure: float, lengths: list[int] | None = None) -> Decision:
        """``k_limits[i]``: most drafts sequence i can use (room left in its budget and context);
        ``lengths[i]``: its tokens so far (prompt + generated), which bounds what the draft must catch up on
        before it can draft for it again.

        Adaptive mode decides once per round (see ``best_round_k``) from every row's segment acceptance;
        all rows that may speculate get that k. A segment still warming up raises it to ``k`` (reason
        ``warmup``); a segment held at k = 0 for ``probe_every`` rounds gets a probe (``probe``): ``probe_k`` for
        its one shortest row, so its acceptance stays measured. One row, not all: a draft that sat out k = 0
        rounds must first catch up on every token it missed, and doing that for a whole batch of 32 rows
        every ``probe_every`` rounds cost the served path ~15% of its throughput at k = 0 (sweep run 7).
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
        if eligible:
            limits = [min(self.config.k_max, k_limits[row]) for row in eligible]
            k_round, gain = self.best_round_k([self.acceptance.alpha(segments[row]) for row in eligible], limits,
                                              num_seqs)
            reason = "adaptive" if k_round else "low_acceptance"
            if k_round and self.goodput.speculation_slower(num_seqs):
                k_round, reason = 0, "measured_slower"
            elif k_round and self.goodput.plain_sample_due(num_seqs):
                k_round, reason = 0, "measure_plain"
            warming = {segments[row] for row in eligible
                       if self.acceptance.rounds(segments[row]) < self.config.warmup_rounds}
            idle = {segments[row] for row in eligible
                    if self._rounds_without_drafts.get(segments[row], 0) >= self.config.probe_every}
            if warming and k_round < self.config.k:
                k_round, reason = self.config.k, "warmup"
            for row, limit in zip(eligible, limits):
                ks[row], reasons[row] = max(0, min(k_round, limit)), reason
            if any(limits):  # a round of prefills only says nothing about the regime
                self._speculating = k_round > 0
            if idle and k_round == 0:
                self._probe_one_row_each(idle, eligible, segments, limits, lengths, ks, reasons)
            for segment in {segments[row] for row in eligible}:
                if any(ks[row] for row in eligible if segments[row] == segment):
                    self._idle_before[segment] = self._rounds_without_drafts.get(segment, 0)
                    self._rounds_without_drafts[segment] = 0
                else:
                    self._rounds_without_drafts[segment] = self._rounds_without_drafts.get(segment, 0) + 1
        return Decision(ks, reasons, pressure, speculation_on, [gain] * num_seqs)

    def probe_k(self, num_seqs: int) -> int:
        """The draft length of the next probe at this batch: the longest k ≤ ``k`` whose predicted extra cost
        over a plain round stays within ``PROBE_BUDGET`` of the ``probe_every`` rounds it serves (at least 1),
        alternating with half of it (or with 2, when that is 1).

        Long where it is cheap (batch 1: a probe of 3–4 tokens measures acceptance over several positions and
        the cost of the k that would be used), 1–2 at large batches, where widening the whole batch's verify
        is dear. Two lengths let the cost fit tell what drafting costs once per round (the draft call, a wider
        verify) from what each further token costs; probes at one length left that split to the prior, which
        priced k = 4 at 4.3 plain rounds where it costs 2.4 and held the demo pair at k = 0 at batch 1."""
        budget = 1.0 + self.PROBE_BUDGET * self.config.probe_every
        longest = max([k for k in range(1, self.config.k + 1) if self.costs.round_cost(k, num_seqs) <= budget],
                      default=1)
        self._probes += 1
        other = longest // 2 if longest > 1 else 2  # a second length, however dear: the fit needs two
        return longest if self._probes % 2 else min(other, self.config.k)

    def _probe_one_row_each(self, idle: set[str], eligible: list[int], segments: list[str], limits: list[int],
                            lengths: list[int] | None, ks: list[int], reasons: list[str]) -> None:
        """A probe (``probe_k``) for the shortest row (least for the draft to catch up on) of each idle
        segment."""
        k = self.probe_k(len(segments))
        for segment in idle:
            rows = [row for row, limit in zip(eligible, limits) if segments[row] == segment and limit > 0]
            if rows:
                row = min(rows, key=lambda r: lengths[r] if lengths else 0)
                ks[row], reasons[row] = min(k, limits[eligible.index(row)]), "probe"

    def describe(self, num_seqs: int) -> dict:
        """What the policy believes now, for /health: each segment's α and the cost model at ``num_seqs``
        rows (seconds, and in target-step units the round cost of each k) — enough to see why k is what it is."""
        num_seqs = max(num_seqs, 1)
        return {
            "segments": {segment: {"alpha": round(self.acceptance.alpha(segment), 4),
                                   "rounds": self.acceptance.rounds(segment)}
                         for segment in self.acceptance.segments},
            "cost": {"batch": num_seqs,
                     "rounds_observed": self.costs.rounds,
                     "round_seconds": {k: round(self.costs.round_seconds(k, num_seqs), 5)
                                       for k in range(self.config.k_max + 1)},
                     "round_cost": {k: round(self.costs.round_cost(k, num_seqs), 3)
                                    for k in range(self.config.k_max + 1)}},
            "speculation_on": self.gate.speculation_on,
        }

    def observe_goodput(self, reasons: list[str], drafted: list[int], tokens: int, seconds: float) -> None:
        """A finished round's decoding rows (their ``reasons`` and ``drafted``; ``tokens`` they emitted in
        ``seconds`` of wall time, the draft's catch-up included, the target's prefill not; rows prefilled this
        round are the caller's to leave out) for the goodput check; probe rounds are left out (one row drafting
        says nothing about either arm), and so is a round that starts drafting after plain ones (what the draft
        replays there is the price of switching, not of drafting)."""
        if "probe" in reasons or not drafted:  # no rows: a round of prefills only
            return
        speculating = any(drafted)
        switching = speculating and not self._goodput_speculating
        self._goodput_speculating = speculating
        if not switching:
            num_seqs = len(drafted)
            self.goodput.observe(num_seqs, speculating, tokens, seconds, self.costs.round_seconds(0, num_seqs))

    def observe_round(self, segments: list[str], drafted: list[int], accepted: list[int]) -> None:
        by_segment: dict[str, list[tuple[int, int]]] = {}
        for segment, num_drafted, num_accepted in zip(segments, drafted, accepted):
            by_segment.setdefault(segment, []).append((num_drafted, num_accepted))
        for segment, rows in by_segment.items():
            self.acceptance.observe_round(segment, rows, 1 + self._idle_before.pop(segment, 0))
