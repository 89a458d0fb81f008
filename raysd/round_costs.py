"""What rounds cost, measured: the fitted cost of a round (``CostModel``), the draft's catch-up
(``CatchUpCost``) and the goodput each arm really delivered (``GoodputCheck``). No decisions here: the policy
(``raysd.policy``) reads these to choose k.
"""

from __future__ import annotations

import math


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by a round with k drafts at per-token acceptance ``alpha`` (bonus included)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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


class CatchUpCost:
    """Seconds the draft spends feeding tokens it missed, per token: an EMA ratio of measured catch-up time to
    the tokens fed, learned from every round that drafted.

    A row that sat out rounds (or never drafted: its prompt) must be fed to the draft before the draft can
    propose for it; a steady drafting state feeds at most one such token a row. The policy prices starting to
    draft with it (``SpeculationPolicy.best_round_k``). The prior, 0.1 ms a token, is the middle of what the
    demo draft served on 2 CPU cores measured: 0.18 ms at batch 1 (a new prompt prefilled alone) down to
    0.02 ms at batch 16 (many rows fed in one ragged forward). The EMA follows the regime it is in.
    """

    DECAY = 0.9  # per round that fed tokens
    PRIOR_SECONDS_PER_TOKEN = 1e-4
    PRIOR_TOKENS = 256.0

    def __init__(self):
        self.seconds = self.PRIOR_SECONDS_PER_TOKEN * self.PRIOR_TOKENS
        self.tokens = self.PRIOR_TOKENS

    def observe(self, tokens: int, seconds: float) -> None:
        """A drafting round fed ``tokens`` missed tokens in ``seconds`` (rounds that fed none say nothing)."""
        if tokens <= 0 or seconds < 0:
            return
        self.seconds = self.DECAY * self.seconds + seconds
        self.tokens = self.DECAY * self.tokens + tokens

    def predict(self, tokens: int) -> float:
        """Seconds to feed ``tokens`` missed tokens."""
        return tokens * self.seconds / self.tokens


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
