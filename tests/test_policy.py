"""The policy on synthetic acceptance and load: k follows acceptance, 0 when it cannot pay, no flapping."""

import json
import random
from pathlib import Path

import pytest

from raysd.config import PolicyConfig, SpeculationMode
from raysd.policy import AcceptanceTracker, CostModel, PressureGate, SpeculationPolicy, expected_tokens


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def _cheap_round_seconds(num_seqs: int, k: int) -> float:
    """Rounds where drafting is cheap (a GPU-like world): each extra drafted token ≈ 15% of a plain round."""
    return 0.020 + 0.0002 * num_seqs + k * (0.003 + 0.0002 * num_seqs)


def _accepted_of(k: int, alpha: float, rng: random.Random) -> int:
    """Drafts of ``k`` the target accepts, each with probability ``alpha`` until the first rejection."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


def _simulate(policy: SpeculationPolicy, alpha: float, rounds: int, segment: str, rng: random.Random,
              num_seqs: int = 1) -> list[tuple[int, str]]:
    decisions = []
    for _ in range(rounds):
        decision = policy.decide([segment] * num_seqs, [False] * num_seqs, [16] * num_seqs, pressure=num_seqs)
        drafted, accepted = [], []
        for k in decision.ks:
            drafted.append(k)
            accepted.append(_accepted_of(k, alpha, rng))
        policy.observe_round([segment] * num_seqs, drafted, accepted)
        policy.costs.observe_round(num_seqs, max(drafted), _cheap_round_seconds(num_seqs, max(drafted)))
        decisions.append((decision.ks[0], decision.reasons[0]))
    return decisions


def test_k_rises_with_acceptance_and_is_zero_when_it_cannot_pay():
    rng = random.Random(0)
    chosen = {}
    for alpha in (0.1, 0.65, 0.85, 0.97):
        policy = SpeculationPolicy(PolicyConfig(warmup_rounds=5, k_max=8))
        decisions = _simulate(policy, alpha, 200, "s", rng)
        assert decisions[0][1] == "warmup"
        steady = [k for k, reason in decisions[-50:] if reason != "probe"]
        chosen[alpha] = sum(steady) / len(steady)
    assert chosen[0.1] == 0  # low acceptance: plain decoding
    assert chosen[0.1] < chosen[0.65] < chosen[0.85] < chosen[0.97]


def test_low_acceptance_segment_is_reprobed_and_recovers():
    rng = random.Random(1)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=4, probe_every=10))
    decisions = _simulate(policy, 0.05, 100, "prose", rng)
    assert decisions[-1][0] == 0 and any(reason == "probe" for _, reason in decisions)
    recovered = _simulate(policy, 0.95, 200, "prose", rng)  # same segment, text became predictable
    assert recovered[-1][0] > 0 and recovered[-1][1] == "adaptive"


def test_segments_are_tracked_separately_and_decide_the_round_together():
    rng = random.Random(2)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=3))
    _simulate(policy, 0.9, 100, "json", rng)
    _simulate(policy, 0.1, 100, "prose", rng)
    assert policy.acceptance.alpha("json") > 0.8 > 0.3 > policy.acceptance.alpha("prose")
    prose_only = policy.decide(["prose", "prose"], [False, False], [16, 16], pressure=2)
    assert prose_only.ks == [0, 0] and prose_only.reasons[0] in ("low_acceptance", "probe")
    # one verify is as wide as its longest draft: once json makes the round speculate, prose rides along
    mixed = policy.decide(["json", "prose"], [False, False], [16, 16], pressure=2)
    assert mixed.ks[0] > 0 and mixed.ks[0] == mixed.ks[1] and set(mixed.reasons) == {"adaptive"}
    # ... but one json row does not make 31 prose rows pay for a wide verify
    crowd = policy.decide(["json"] + ["prose"] * 31, [False] * 32, [16] * 32, pressure=2)
    assert set(crowd.ks) == {0}


def test_a_probe_does_not_widen_every_round_of_a_big_batch():
    """Regression: probes were counted per sequence, so at batch 32 every round had a k=4 row."""
    rng = random.Random(4)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=2, probe_every=16, pressure_high=64, pressure_low=32))
    _simulate(policy, 0.05, 60, "prose", rng, num_seqs=32)
    widths = [max(policy.decide(["prose"] * 32, [False] * 32, [16] * 32, pressure=32).ks) for _ in range(64)]
    assert widths.count(0) >= 60 and max(widths) <= 2  # about one short probe per 16 rounds


def test_a_probe_drafts_for_one_row_the_one_with_least_to_catch_up():
    """Regression: a probe drafted for every row of the segment, and a draft that sat out k = 0 rounds must
    first catch up on every token it missed — 32 rows' worth each probe cost ~15% of throughput at k = 0."""
    rng = random.Random(5)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=2, probe_every=8, pressure_high=64, pressure_low=32))
    policy.PROBE_SHARE = 1.0  # probes every probe_every rounds, however dear: this test is about which row
    _simulate(policy, 0.05, 60, "prose", rng, num_seqs=32)
    behind = [200 + 7 * row for row in range(32)]
    limits = [16] * 32
    limits[3], behind[3] = 0, 50  # least behind, but prefilling (no room to draft): never the probe
    behind[17] = 60
    probes = [policy.decide(["prose"] * 32, [False] * 32, limits, pressure=32, catchup_tokens=behind)
              for _ in range(40)]
    probes = [d for d in probes if any(d.ks)]
    assert len(probes) >= 4
    for decision in probes:
        assert decision.ks[17] in (1, 2) and sum(decision.ks) == decision.ks[17] and decision.reasons[17] == "probe"
    assert {decision.ks[17] for decision in probes} == {1, 2}  # two lengths: the fit can split its cost


def test_pressure_gate_has_hysteresis_and_does_not_flap():
    gate = PressureGate(high=10, low=5)
    states = [gate.update(p) for p in [1, 9, 11, 9, 7, 6, 11, 5.5, 4, 6, 9, 10]]
    assert states == [True, True, False, False, False, False, False, False, True, True, True, True]
    flips = sum(a != b for a, b in zip(states, states[1:]))
    noisy = PressureGate(high=10, low=5)
    noisy_states = [noisy.update(8 + 3 * ((i % 2) * 2 - 1) * 0.9) for i in range(100)]  # 5.3 ↔ 10.7
    assert flips == 2 and sum(a != b for a, b in zip(noisy_states, noisy_states[1:])) == 1


class _Clock:
    """A clock the test moves (seconds)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pressure_turns_speculation_off_for_everyone_and_back_on():
    policy = SpeculationPolicy(PolicyConfig(mode=SpeculationMode.adaptive, warmup_rounds=0,
                                            pressure_high=8, pressure_low=4, pressure_reopen_s=0.5))
    policy.gate.clock = clock = _Clock()
    for _ in range(30):
        policy.observe_round(["code"], [4], [4])
    assert policy.decide(["code"], [False], [16], pressure=2).ks == [policy.decide(["code"], [False], [16], 2).ks[0]]
    high = policy.decide(["code"] * 3, [False] * 3, [16] * 3, pressure=9)
    assert high.ks == [0, 0, 0] and set(high.reasons) == {"pressure"} and not high.speculation_on
    clock.now += 2.0
    assert policy.decide(["code"], [False], [16], pressure=6).reasons == ["pressure"]  # still above low
    clock.now += 0.1
    assert policy.decide(["code"], [False], [16], pressure=3).reasons == ["pressure"]  # below, 0.1 s only
    clock.now += 0.5
    back = policy.decide(["code"], [False], [16], pressure=3)
    assert back.ks[0] > 0 and back.reasons == ["adaptive"]


def test_a_one_round_dip_in_load_does_not_restart_drafting_and_quiet_does():
    """Closed-loop load at 32 users: requests that finish together are replaced within a round, and the round
    between sees the batch dip below ``pressure_low`` (served JSON: 32 → 10 → 32). Reopening there drafted for
    one round after hundreds of plain ones, the draft catching up on every row first (0.5 s, ~6 plain rounds
    at batch 32); held for ``pressure_reopen_s``, dips do nothing, a load that stays low reopens the gate, and
    after an idle spell so does the first round."""
    instant, held = (PressureGate(high=28, low=16, reopen_s=reopen, clock=_Clock()) for reopen in (0.0, 0.5))
    states = {"instant": [], "held": []}
    for round_index in range(300):  # rounds of 80 ms; every 60th round the batch dips to 10 for that round
        pressure = 10 if round_index % 60 == 59 else 32
        for name, gate in (("instant", instant), ("held", held)):
            gate.clock.now += 0.08
            states[name].append(gate.update(pressure))
    assert states["instant"][1:].count(True) == 5 and states["held"][1:].count(True) == 0
    load_falls = []
    for _ in range(10):  # the load falls for good (after the last round's dip): 0.5 s of it reopens the gate
        held.clock.now += 0.08
        load_falls.append(held.update(10))
    assert load_falls == [False] * 5 + [True] * 5
    quiet = PressureGate(high=28, low=16, reopen_s=0.5, clock=_Clock())
    quiet.update(32)
    quiet.clock.now += 30.0  # idle: no rounds, then one request
    assert quiet.update(1)


def _round_seconds(num_seqs: int, k: int) -> float:
    """A served round on a small CPU: fixed hops, verify work per token in the batch, draft work per step."""
    return 0.010 + 0.0004 * num_seqs * (k + 1) + k * (0.001 + 0.0001 * num_seqs)


def test_cost_model_learns_that_big_batches_make_verification_expensive():
    costs = CostModel(decay=0.95)
    for _ in range(40):
        for num_seqs in (1, 4, 16, 32):
            for k in (0, 1, 4):
                costs.observe_round(num_seqs, k, _round_seconds(num_seqs, k))
    assert costs.round_cost(4, 1) == pytest.approx(_round_seconds(1, 4) / _round_seconds(1, 0), rel=0.02)
    assert costs.round_cost(4, 32) == pytest.approx(_round_seconds(32, 4) / _round_seconds(32, 0), rel=0.02)
    assert costs.speedup(0.8, 4, 1) > 1.5 > 1.0 > costs.speedup(0.8, 4, 32)


def test_tracker_estimates_alpha_from_prefix_outcomes():
    rng = random.Random(3)
    tracker = AcceptanceTracker(ema_decay=0.999)
    for _ in range(3000):
        n = 0
        while n < 4 and rng.random() < 0.7:
            n += 1
        tracker.observe("s", 4, n)
    assert tracker.alpha("s") == pytest.approx(0.7, abs=0.03)


def test_the_chosen_k_is_the_measured_optimum_not_the_largest():
    """Regression: costs fitted per component (draft step, verify, call overhead) under-rated a k = 8 round
    on the served path by ~30%, so the policy drafted 8 where 2–3 paid best (0.76× always-on k=4 on JSON).
    Fitted on whole rounds seen at the values of k a running policy produces (plain rounds, k = 1 probes, a
    large k), the policy's k is the one that maximises tokens per second under the true costs — which here
    include a once-per-round cost of drafting at all (the call to the draft actor)."""
    def true_seconds(num_seqs, k):  # hop-heavy rounds whose cost grows steeply with k
        return 0.020 + 0.002 * num_seqs + (k > 0) * 0.006 + k * (0.011 + 0.001 * num_seqs)

    policy = SpeculationPolicy(PolicyConfig(k_max=8, min_gain=1.0))
    for _ in range(60):
        for num_seqs in (1, 2):
            for k in (0, 1, 8):
                policy.costs.observe_round(num_seqs, k, true_seconds(num_seqs, k))
    for alpha in (0.6, 0.8, 0.9):
        for num_seqs in (1, 2):
            best = max(range(9), key=lambda k: expected_tokens(alpha, k) / true_seconds(num_seqs, k))
            chosen, _ = policy.best_round_k([alpha] * num_seqs, [8] * num_seqs, num_seqs)
            assert chosen == best, (alpha, num_seqs, chosen, best)


def test_describe_shows_what_the_decision_rests_on():
    policy = SpeculationPolicy(PolicyConfig(k_max=4))
    for _ in range(20):
        policy.observe_round(["json", "prose"], [4, 4], [4, 0])
    view = policy.describe(num_seqs=2)
    assert view["segments"]["json"]["alpha"] > 0.9 > 0.2 > view["segments"]["prose"]["alpha"]
    assert view["segments"]["json"]["rounds"] == 20
    assert view["cost"]["round_cost"][0] == 1.0 and list(view["cost"]["round_cost"]) == [0, 1, 2, 3, 4]
    assert view["cost"]["round_cost"][4] == pytest.approx(policy.costs.round_cost(4, 2), abs=1e-3)
    policy.observe_catchup(100, 0.05)
    assert policy.describe(num_seqs=2)["cost"]["catchup_seconds_per_token"] > view["cost"]["catchup_seconds_per_token"]


def _policy_with_cheap_costs(**config) -> SpeculationPolicy:
    policy = SpeculationPolicy(PolicyConfig(**config))
    for _ in range(50):
        for k in (0, 1, 4):
            policy.costs.observe_round(1, k, _cheap_round_seconds(1, k))
    return policy


def test_a_marginal_gain_neither_starts_nor_stops_speculation():
    """Hysteresis: a gain just below ``min_gain`` keeps whatever the batch was doing, so a
    segment whose worth hovers near the threshold does not toggle (each start makes the draft catch up)."""
    marginal = next(alpha / 100 for alpha in range(1, 100)
                    if 1.03 < _policy_with_cheap_costs().costs.speedup(alpha / 100, 1, 1) < 1.045)
    for warm_alpha, expect_speculating in ((0.95, True), (0.02, False)):
        policy = _policy_with_cheap_costs(warmup_rounds=0, min_gain=1.05)
        for _ in range(40):  # one segment's rounds set the regime: speculating on code, plain on noise
            policy.acceptance.observe("warm", 4, 4 if warm_alpha > 0.5 else 0)
        decision = policy.decide(["warm"], [False], [8], pressure=1)
        assert (decision.ks[0] > 0) == expect_speculating
        k, gain = policy.best_round_k([marginal], [8], 1)
        assert (k > 0) == expect_speculating, (marginal, k, gain)


def test_starting_to_draft_pays_for_the_drafts_catch_up_and_keeping_on_does_not():
    """A segment worth ~1.2× a round starts drafting when the draft is nearly in step, not when it must first be
    fed rounds' worth of missed tokens on every row (each start cost ~4 plain rounds on served prose at batch
    16, and drafting toggled every few rounds); once drafting, a new row's catch-up does not stop the batch."""
    policy = _policy_with_cheap_costs(warmup_rounds=0, min_gain=1.05)
    for _ in range(60):  # held at k = 0 by text the draft could not predict ...
        policy.acceptance.observe("prose", 4, 0)
        reasons = policy.decide(["prose"], [False], [8], pressure=1).reasons
    assert reasons == ["low_acceptance"]
    for _ in range(40):  # ... then its probes find α ≈ 0.5
        policy.acceptance.observe("prose", 4, 1)
    alpha = policy.acceptance.alpha("prose")
    _, gain = policy.best_round_k([alpha], [8], 1)
    assert 1.1 < gain < 1.5, gain  # the model alone would start
    policy.observe_catchup(1000, 0.2)  # feeding a missed token costs 0.2 ms: ~1% of a plain round here
    plain_seconds = policy.costs.round_seconds(0, 1)
    far_behind = round(4 * plain_seconds / policy.catchup.predict(1))  # four plain rounds' worth of catch-up
    held = policy.decide(["prose"], [False], [8], pressure=1, catchup_tokens=[far_behind])
    assert held.ks == [0] and held.reasons == ["low_acceptance"]
    started = policy.decide(["prose"], [False], [8], pressure=1, catchup_tokens=[2])
    assert started.ks[0] > 0 and started.reasons == ["adaptive"]
    kept = policy.decide(["prose"], [False], [8], pressure=1, catchup_tokens=[far_behind])
    assert kept.ks[0] > 0  # speculating already: the catch-up is the steady price, which the goodput check sees


def test_a_policy_held_at_k0_relearns_what_drafting_costs_from_its_probes():
    """Regression: drafting had looked dear (a burst of contention), so the policy held k = 0; its only
    drafting rounds were k = 1 probes, which the cost fit skipped (draft catch-up), so k > 0 was never
    re-measured and the policy stayed at k = 0 on a segment worth 1.35×. Probes are now learned from: within a
    few probes the policy drafts again."""
    rng = random.Random(3)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0, probe_every=8))
    for _ in range(100):
        policy.costs.observe_round(1, 0, _cheap_round_seconds(1, 0))
        policy.costs.observe_round(1, 4, 6 * _cheap_round_seconds(1, 4))
    stuck = _simulate(policy, 0.85, 8, "json", rng)
    assert all(k == 0 for k, _ in stuck)
    recovered = _simulate(policy, 0.85, 96, "json", rng)
    assert recovered[-1][0] > 0 and recovered[-1][1] == "adaptive"


def test_one_bad_round_of_a_big_batch_does_not_erase_what_acceptance_was():
    """α̂ decays per round, not per row: at batch 32 one round's rows are one round of evidence (decaying
    per row, a single unlucky round took α̂ from 0.8 to below 0.3 and flipped the policy)."""
    tracker = AcceptanceTracker(ema_decay=0.95)
    rng = random.Random(5)
    for _ in range(100):
        rows = []
        for _ in range(32):
            accepted = 0
            while accepted < 4 and rng.random() < 0.8:
                accepted += 1
            rows.append((4, accepted))
        tracker.observe_round("code", rows)
    before = tracker.alpha("code")
    tracker.observe_round("code", [(4, 0)] * 32)
    assert before == pytest.approx(0.8, abs=0.03)
    assert tracker.alpha("code") > 0.7 and tracker.rounds("code") == 101


def test_probes_are_long_where_cheap_and_short_where_dear():
    """A probe's draft length is what ``probe_every`` rounds can afford: several tokens at batch 1 (where
    acceptance over several positions and the cost of a useful k are what need measuring), one or two at batch
    32 (where one longer draft widens the whole batch's verify), and two lengths in turn for the cost fit."""
    policy = SpeculationPolicy(PolicyConfig(probe_every=32, k=4))
    for _ in range(50):
        for num_seqs in (1, 32):
            for k in (0, 1, 4):
                policy.costs.observe_round(num_seqs, k, _cheap_round_seconds(num_seqs, k) * (1 + k * num_seqs / 8))
    small = {policy.probe_k(1) for _ in range(4)}
    large = {policy.probe_k(32) for _ in range(4)}
    assert max(small) == 4 and len(small) == 2
    assert large == {1, 2}


def _run_world(policy: SpeculationPolicy, rounds: int, hidden_spec_seconds: float, rng: random.Random,
               alpha: float = 0.6, num_seqs: int = 16) -> list[str]:
    """Rounds whose cost the fit sees as ``_cheap_round_seconds`` while a drafting round really takes
    ``hidden_spec_seconds`` more (prefills and catch-up the fit leaves out); returns row 0's reasons."""
    reasons = []
    for _ in range(rounds):
        decision = policy.decide(["s"] * num_seqs, [False] * num_seqs, [16] * num_seqs, pressure=num_seqs)
        accepted = []
        for k in decision.ks:
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            accepted.append(n)
        policy.observe_round(["s"] * num_seqs, decision.ks, accepted)
        seen = _cheap_round_seconds(num_seqs, max(decision.ks))
        policy.costs.observe_round(num_seqs, max(decision.ks), seen)
        policy.observe_goodput(decision.reasons, decision.ks, sum(accepted) + num_seqs,
                               seen + (hidden_spec_seconds if any(decision.ks) else 0.0))
        reasons.append(decision.reasons[0])
    return reasons


def test_speculation_measured_slower_than_plain_rounds_is_held_back_and_retried_later():
    """The model prices drafting cheap, but whole rounds say otherwise: the goodput check holds speculation
    back at that batch size, keeps re-measuring now and then, and lets it back when it pays again."""
    rng = random.Random(4)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=2))
    for _ in range(6):  # plain rounds seen earlier (prefills, a low-acceptance stretch)
        policy.observe_goodput(["low_acceptance"] * 16, [0] * 16, 16, _cheap_round_seconds(16, 0))
    dear = _run_world(policy, 600, hidden_spec_seconds=0.08, rng=rng)
    assert dear[:10].count("adaptive") + dear[:10].count("warmup") >= 4  # the model alone wants to draft
    assert dear[-300:].count("measured_slower") > 250, dear[-300:]
    assert 0 < dear[100:].count("adaptive") < 30  # re-measured now and then, not kept
    assert policy.goodput.rate(16, True) < policy.goodput.rate(16, False)
    assert policy.goodput.rate(4, True) is None  # another batch size has no evidence: the model decides there
    cheap = _run_world(policy, 1500, hidden_spec_seconds=0.0, rng=rng)
    assert cheap[-200:].count("adaptive") > 180, cheap[-200:]
    # while speculating, plain rounds are re-measured now and then: a few in every few hundred
    assert 5 <= cheap.count("measure_plain") <= 30, cheap.count("measure_plain")


def test_goodput_check_leaves_probe_rounds_out_and_buckets_by_batch():
    from raysd.policy import GoodputCheck

    check = GoodputCheck()
    # centred on powers of two: a batch that dips a few rows below 16 or 32 stays in its bucket
    assert [check.bucket(n) for n in (1, 2, 3, 6, 12, 16, 22, 23, 32, 45, 64)] == [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 6]
    policy = SpeculationPolicy(PolicyConfig())
    for _ in range(10):
        policy.observe_goodput(["probe"] + ["low_acceptance"] * 7, [2] + [0] * 7, 9, 0.05)
    assert policy.goodput.arms == {}  # a probe round is neither arm
    for _ in range(20):  # a round of 8 rows weighs half a full-batch round
        policy.observe_goodput(["adaptive"] * 8, [3] * 8, 20, 0.05)
    plain_tokens = 8 * 0.05 / policy.costs.round_seconds(0, 8)  # what plain rounds emit in 0.05 s at batch 8
    assert policy.goodput.rate(8, True) == pytest.approx(20 / plain_tokens)
    assert policy.goodput.rate(8, False) is None
    assert not policy.goodput.speculation_slower(8)  # one arm alone proves nothing


def test_goodput_check_leaves_out_the_round_that_starts_drafting():
    """The first drafting round after plain ones pays for the draft replaying every row's tokens since it last
    drafted: a price of switching, paid once. Counted, it decided the few rounds a re-measurement runs and held
    back speculation that paid (served JSON at batch 16). The rounds after it count; a probe in between (one
    row drafting) neither counts nor restarts the stretch."""
    policy = SpeculationPolicy(PolicyConfig())
    for _ in range(6):
        policy.observe_goodput(["low_acceptance"] * 16, [0] * 16, 16, 0.030)
    policy.observe_goodput(["adaptive"] * 16, [2] * 16, 40, 0.500)  # the draft catches up on 16 rows
    assert (4, True) not in policy.goodput.arms
    for _ in range(6):
        policy.observe_goodput(["adaptive"] * 16, [2] * 16, 40, 0.060)
    plain_tokens = 16 * 0.060 / policy.costs.round_seconds(0, 16)
    assert policy.goodput.rate(16, True) == pytest.approx(40 / plain_tokens)
    assert not policy.goodput.speculation_slower(16)  # 40 tokens in two plain rounds' time beats 16 in one
    weight = policy.goodput.arms[(4, True)][2]
    policy.observe_goodput(["probe"] + ["low_acceptance"] * 15, [2] + [0] * 15, 18, 0.050)
    policy.observe_goodput(["adaptive"] * 16, [2] * 16, 40, 0.060)
    assert policy.goodput.arms[(4, True)][2] > weight  # still the same drafting stretch: counted
    policy.observe_goodput(["measured_slower"] * 16, [0] * 16, 16, 0.030)
    policy.observe_goodput(["adaptive"] * 16, [2] * 16, 40, 0.500)  # a new stretch starts: left out again
    assert policy.goodput.rate(16, True) == pytest.approx(40 / plain_tokens)


def test_goodput_check_ignores_rounds_of_prefills_only():
    """A round whose rows were all prefilled has no decoding rows to count (at batch 1, every request's first
    round): it leaves both arms and the drafting stretch as they were."""
    policy = SpeculationPolicy(PolicyConfig())
    for _ in range(6):
        policy.observe_goodput(["adaptive"], [3], 4, 0.020)
    assert policy.goodput.rate(1, True) is None  # 6 rounds of one row are not yet evidence (6 of 16 rows would be)
    before = {arm: list(state) for arm, state in policy.goodput.arms.items()}
    policy.observe_goodput([], [], 0, 0.004)
    assert policy.goodput.arms == before
    policy.observe_goodput(["adaptive"], [3], 4, 0.020)  # not a switch: counted
    assert policy.goodput.arms[(0, True)][2] > before[(0, True)][2]


def test_goodput_memory_counts_rows_so_a_small_batch_averages_over_requests():
    """At batch 1 the draft prefills each new prompt in one round of ~20: ten rounds of memory swung with it
    (code at batch 1 read 2.0, then 0.94 of plain within one request). Memory counts rounds of 16 rows, so
    batch 1 averages over ~160 rounds while batch 16 keeps its ~10."""
    policy = SpeculationPolicy(PolicyConfig())
    plain_seconds = policy.costs.round_seconds(0, 1)
    for _ in range(200):
        policy.observe_goodput(["measured_slower"], [0], 1, plain_seconds)
    for round_index in range(200):  # three tokens a round, and every 20th round the draft prefills a prompt
        catching_up = round_index % 20 == 1
        policy.observe_goodput(["adaptive"], [4], 3, plain_seconds * (25.0 if catching_up else 1.5))
        if round_index > 100:
            assert policy.goodput.rate(1, True) > policy.goodput.rate(1, False)  # never swings below plain
    assert policy.goodput.rate(1, True) == pytest.approx(3 * 20 / (19 * 1.5 + 25), rel=0.1)


def _served_round_seconds(num_seqs: int, k: int) -> float:
    """Rounds priced like the served demo pair on 2 CPU cores: at batch 1 a plain round 20 ms, drafting at all
    15 ms more and each drafted token 3 ms (k = 4 ≈ 2.4 plain rounds); dearer per row as the batch grows."""
    return 0.020 * (1 + 0.05 * (num_seqs - 1)) + (k > 0) * 0.015 + k * (0.003 + 0.0012 * (num_seqs - 1))


def _served_costs_policy(**config) -> SpeculationPolicy:
    policy = SpeculationPolicy(PolicyConfig(**config))
    for _ in range(60):
        for num_seqs in (1, 16):
            for k in (0, 1, 2, 4):
                policy.costs.observe_round(num_seqs, k, _served_round_seconds(num_seqs, k))
    return policy


def test_probes_come_sooner_near_break_even_at_batch_1_and_stay_spaced_elsewhere():
    """A probe that about pays for itself costs nothing to run early, and near break-even it is the likeliest
    to change the decision; one far below it, or one row's drafts at batch 16, waits ``probe_spacing``
    (``probe_every`` or more)."""
    policy = _served_costs_policy(probe_every=32)
    near, far = 0.68, 0.3
    assert policy.probe_interval(near, 1) <= 4
    assert policy.probe_interval(far, 1) == policy.probe_spacing(far, 1) > 32
    for alpha in (near, 0.95):
        assert policy.probe_interval(alpha, 16) == policy.probe_spacing(alpha, 16) > 32


def test_probes_of_a_big_batch_held_at_k_0_cost_at_most_their_share_of_throughput():
    """At batch 16 one row's probe widens the whole batch's verify (served prose: 2–3 plain rounds a probe, one
    every ~35 rounds, adaptive 0.85 of plain decoding in sweep run 23). Spaced by their fitted cost, probes
    cost ≤ ``PROBE_SHARE`` of the rounds; at batch 1 near break-even they stay ``probe_every`` apart or
    sooner."""
    policy = _served_costs_policy(warmup_rounds=0, probe_every=32)
    for num_seqs in (16, 32):
        k = policy._longest_probe(num_seqs)
        spacing = policy.probe_spacing(0.45, num_seqs)
        assert spacing > 32 and (policy.costs.round_cost(k, num_seqs) - 1) / spacing <= policy.PROBE_SHARE + 0.001
    assert policy.probe_spacing(0.68, 1) == 32 and policy.probe_interval(0.68, 1) <= 4
    for share, most in ((1.0, 0.07), (policy.PROBE_SHARE, 0.025)):  # 1.0: every probe_every rounds, as before
        held = _served_costs_policy(warmup_rounds=0, probe_every=32)
        held.PROBE_SHARE = share
        rng, extra, probes = random.Random(3), 0.0, 0
        for _ in range(640):  # prose at batch 16, drafts accepted at 45%: held at k = 0 but for its probes
            decision = held.decide(["prose"] * 16, [False] * 16, [40] * 16, pressure=16, catchup_tokens=[30] * 16)
            accepted = [_accepted_of(k, 0.45, rng) for k in decision.ks]
            held.observe_round(["prose"] * 16, decision.ks, accepted, decision.reasons)
            seconds = _served_round_seconds(16, max(decision.ks))
            held.costs.observe_round(16, max(decision.ks), seconds)
            extra += seconds / _served_round_seconds(16, 0) - 1
            probes += "probe" in decision.reasons
            assert set(decision.reasons) <= {"low_acceptance", "probe"}
        assert probes >= 640 / 80 and extra / 640 <= most, (share, probes, extra / 640)


def test_a_probe_that_pays_is_run_again_the_next_round_and_a_rejection_ends_it():
    policy = _served_costs_policy(warmup_rounds=0, probe_every=32)
    for _ in range(40):  # a bad stretch: the segment is held at k = 0
        policy.observe_round(["code"], [4], [0])
    assert policy.acceptance.alpha("code") < 0.2

    def next_round(accept_all: bool) -> str:
        decision = policy.decide(["code"], [False], [16], pressure=1)
        k = decision.ks[0]
        policy.observe_round(["code"], [k], [k if accept_all else 0], decision.reasons)
        return decision.reasons[0]

    spacing = policy.probe_spacing(policy.acceptance.alpha("code"), 1)
    reasons = [next_round(accept_all=False) for _ in range(spacing + 8)]
    assert reasons.count("probe") == 1 and set(reasons) == {"low_acceptance", "probe"}  # one per probe_spacing
    while next_round(accept_all=True) != "probe":
        pass
    chained = [next_round(accept_all=True) for _ in range(3)]
    assert chained[0] == "probe"  # it paid: probed again at once, not 32 rounds later
    assert policy.acceptance.alpha("code") > 0.2
    while next_round(accept_all=False) != "probe":  # a rejection ends the chain
        pass
    assert [next_round(accept_all=False) for _ in range(5)] == ["low_acceptance"] * 5
    # at batch 16 a fully accepted probe row does not pay for the batch's wider verify: no chain
    policy._probe_chain.clear()
    policy._extend_probe_chains(["code"] * 16, [2] + [0] * 15, [2] + [0] * 15, ["probe"] + ["low_acceptance"] * 15)
    assert "code" not in policy._probe_chain


def _batch_1_world(policy: SpeculationPolicy, alpha: float, rounds: int, seed: int,
                   bursty: float = 0.0) -> tuple[float, float]:
    """Served-like batch-1 rounds at acceptance ``alpha``: (share of rounds at k = 0, tokens per plain-round
    time). ``bursty`` > 0: text in stretches (~40 tokens on average) that draft well or badly, α ± ``bursty``
    around ``alpha``, as real code does (per-prompt draft/target agreement of the demo pair on held-out code:
    0.48–0.94)."""
    rng = random.Random(seed)
    plain_rounds, tokens, seconds = 0, 0, 0.0
    stretch_alpha = alpha
    for _ in range(rounds):
        decision = policy.decide(["code"], [False], [16], pressure=1)
        k = decision.ks[0]
        accepted = 0
        while accepted < k and rng.random() < stretch_alpha:
            accepted += 1
        if bursty and rng.random() < (accepted + 1) / 40:
            stretch_alpha = alpha + rng.choice((-bursty, bursty))
        policy.observe_round(["code"], [k], [accepted], decision.reasons)
        policy.costs.observe_round(1, k, _served_round_seconds(1, k))
        plain_rounds += k == 0
        tokens += accepted + 1
        seconds += _served_round_seconds(1, k)
    return plain_rounds / rounds, tokens * _served_round_seconds(1, 0) / seconds


def _anchored_at_the_prior(policy: SpeculationPolicy) -> SpeculationPolicy:
    """The tracker as it was before the long-run anchor: recent α̂ shrunk towards a fixed 0.5 (weight 2)."""
    policy.acceptance.SHRINK_TRIALS = policy.acceptance.prior_weight
    policy.acceptance.long_run_alpha = lambda segment: policy.acceptance.prior_alpha
    return policy


def test_near_break_even_at_batch_1_a_dip_in_acceptance_does_not_park_speculation_for_long():
    """Served code at batch 1 (iid α ≈ 0.72, always-on k = 4 ≈ 1.2× plain): α̂ dips below break-even now and
    then, and with one probe every 32 rounds the policy sat at k = 0 for whole requests (about half the rounds
    here; adaptive 0.88–0.96 of always-on at served code c = 1 in sweeps 15–18). Probed sooner near break-even,
    and again at once while probes pay, it is back within a few rounds; anchored at the long run, the dips
    themselves are rarer and end as the evidence ages."""
    spaced = _anchored_at_the_prior(_served_costs_policy())
    spaced.NEAR_FREE_BUDGET, spaced.PROBE_CHAIN = 1e-9, 0  # probes only every probe_every rounds, as before
    spaced_plain, spaced_rate = _batch_1_world(spaced, 0.72, 3000, seed=1)
    probed_plain, probed_rate = _batch_1_world(_anchored_at_the_prior(_served_costs_policy()), 0.72, 3000, seed=1)
    plain, rate = _batch_1_world(_served_costs_policy(), 0.72, 3000, seed=1)
    assert spaced_plain > 0.4 and probed_plain < 0.25 and plain < 0.1, (spaced_plain, probed_plain, plain)
    assert rate > probed_rate > spaced_rate
    prose_plain, prose_rate = _batch_1_world(_served_costs_policy(), 0.36, 3000, seed=1)
    assert prose_plain > 0.9 and prose_rate > 0.96  # far below break-even: probes stay rare and cheap


AGREEMENT = Path(__file__).parent / "data" / "demo_agreement.json"  # bench/agreement_traces.py


def _measured_batch_1_seconds(k: int) -> float:
    """Batch-1 rounds as the served policy fitted them on 2026-12-07 (``bench/policy_beliefs.py``): k = 1 ≈ 1.9
    plain rounds, k = 4 ≈ 2.5."""
    return 0.020 + (k > 0) * 0.0144 + k * 0.0039


def _served_text_world(policy: SpeculationPolicy, workload: str, requests: int, seed: int) -> tuple[float, float]:
    """Batch-1 requests replaying the demo pair's recorded agreement on the held-out prompts (greedy: a round
    drafting k at position i accepts the run of agreements from i), with their prefills and the draft's catch-up
    (the prompt and every plain round's token, 0.18 ms each) and round times (``_measured_batch_1_seconds``) that
    vary ±30%: (share of decoding rounds that drafted, output tokens per second)."""
    rng = random.Random(seed)
    traces = json.loads(AGREEMENT.read_text())["agreement"][workload]
    prompt_tokens, tokens, seconds, drafting, decoding = 40, 0, 0.0, 0, 0
    for request in range(requests):
        agrees = traces[request % len(traces)]
        policy.decide([workload], [False], [0], pressure=1, catchup_tokens=[prompt_tokens])  # its prefill
        policy.observe_round([workload], [0], [0], ["prefill"])
        generated, behind = 1, prompt_tokens + 1
        seconds, tokens = seconds + 0.030, tokens + 1
        while generated < len(agrees):
            decision = policy.decide([workload], [False], [len(agrees) - generated - 1], pressure=1,
                                     catchup_tokens=[behind])
            k = decision.ks[0]
            accepted = 0
            while accepted < k and agrees[generated + accepted]:
                accepted += 1
            round_seconds = _measured_batch_1_seconds(k) * rng.lognormvariate(0, 0.3)
            catchup_seconds = behind * 0.00018 if k else 0.0
            behind = (accepted + 1) - min(accepted, k - 1) if k else behind + 1
            policy.observe_round([workload], [k], [accepted], decision.reasons)
            if k:
                policy.observe_catchup(decision.catchup_tokens[0], catchup_seconds)
            policy.costs.observe_round(1, k, round_seconds)
            policy.observe_goodput(decision.reasons, [k], accepted + 1, round_seconds + catchup_seconds)
            generated, tokens = generated + accepted + 1, tokens + accepted + 1
            seconds += round_seconds + catchup_seconds
            drafting, decoding = drafting + (k > 0), decoding + 1
    return drafting / decoding, tokens / seconds


def test_on_real_text_at_batch_1_adaptive_keeps_up_with_the_best_fixed_policy():
    """The demo pair's own agreement on held-out code, JSON and prose (not acceptance independent from token
    to token: real text drafts well and badly in stretches, and per prompt from 0.48 to 0.94 on code). Anchored
    at a fixed 0.5, α̂ fell below break-even in bad stretches and aged towards 0.5 while held at k = 0, so code
    drafted in about half the rounds and delivered ~0.94 of always-on (served code c = 1: 45%, and 0.82–1.01
    in sweeps 19–22). Anchored at the segment's long run, adaptive stays within a few % of the better fixed
    policy on all three, drafting on code and JSON, hardly on prose (below break-even at these costs), and
    α̂'s anchor is the text's acceptance."""
    for workload in ("code", "json", "prose"):
        rates = {}
        for name, make in (("off", lambda: _served_costs_policy(mode="off")),
                           ("on", lambda: _served_costs_policy(mode="on", k=4)),
                           ("prior", lambda: _anchored_at_the_prior(_served_costs_policy())),
                           ("adaptive", _served_costs_policy)):
            policy = make()
            runs = [_served_text_world(policy, workload, 48, seed) for seed in range(3)]
            rates[name] = (sum(rate for _, rate in runs) / 3, sum(share for share, _ in runs) / 3, policy)
        best = max(rates["off"][0], rates["on"][0])
        assert rates["adaptive"][0] >= 0.97 * best, (workload, {n: r[:2] for n, r in rates.items()})
        if workload == "code":  # the served symptom, reproduced, and gone
            assert rates["prior"][0] < 0.95 * best and rates["prior"][1] < 0.6 < 0.75 < rates["adaptive"][1]
        if workload == "prose":
            assert rates["adaptive"][1] < 0.3
        agreement = json.loads(AGREEMENT.read_text())["agreement"][workload]
        tracker = rates["adaptive"][2].acceptance
        if workload != "prose":  # prose hardly drafts: its long run is mostly probes' first tokens
            assert tracker.long_run_alpha(workload) == pytest.approx(
                sum(map(sum, agreement)) / sum(map(len, agreement)), abs=0.1)
    assert "alpha_long_run" in rates["adaptive"][2].describe(1)["segments"]["prose"]
