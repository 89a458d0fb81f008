"""The policy on synthetic acceptance and load: k follows acceptance, 0 when it cannot pay, no flapping."""

import random

import pytest

from raysd.config import PolicyConfig, SpeculationMode
from raysd.policy import AcceptanceTracker, CostModel, PressureGate, SpeculationPolicy, expected_tokens


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def _simulate(policy: SpeculationPolicy, alpha: float, rounds: int, segment: str, rng: random.Random,
              num_seqs: int = 1) -> list[tuple[int, str]]:
    decisions = []
    for _ in range(rounds):
        decision = policy.decide([segment] * num_seqs, [False] * num_seqs, [16] * num_seqs, pressure=num_seqs)
        drafted, accepted = [], []
        for k in decision.ks:
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            drafted.append(k)
            accepted.append(n)
        policy.observe_round([segment] * num_seqs, drafted, accepted)
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
    assert policy.acceptance.alpha("json") > 0.8 > 0.2 > policy.acceptance.alpha("prose")
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
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=2, probe_every=16))
    _simulate(policy, 0.05, 60, "prose", rng, num_seqs=32)
    widths = [max(policy.decide(["prose"] * 32, [False] * 32, [16] * 32, pressure=32).ks) for _ in range(64)]
    assert widths.count(0) >= 60 and max(widths) == 1  # about one k=1 probe per 16 rounds


def test_pressure_gate_has_hysteresis_and_does_not_flap():
    gate = PressureGate(high=10, low=5)
    states = [gate.update(p) for p in [1, 9, 11, 9, 7, 6, 11, 5.5, 4, 6, 9, 10]]
    assert states == [True, True, False, False, False, False, False, False, True, True, True, True]
    flips = sum(a != b for a, b in zip(states, states[1:]))
    noisy = PressureGate(high=10, low=5)
    noisy_states = [noisy.update(8 + 3 * ((i % 2) * 2 - 1) * 0.9) for i in range(100)]  # 5.3 ↔ 10.7
    assert flips == 2 and sum(a != b for a, b in zip(noisy_states, noisy_states[1:])) == 1


def test_pressure_turns_speculation_off_for_everyone_and_back_on():
    policy = SpeculationPolicy(PolicyConfig(mode=SpeculationMode.adaptive, warmup_rounds=0,
                                            pressure_high=8, pressure_low=4))
    for _ in range(30):
        policy.observe_round(["code"], [4], [4])
    assert policy.decide(["code"], [False], [16], pressure=2).ks == [policy.decide(["code"], [False], [16], 2).ks[0]]
    high = policy.decide(["code"] * 3, [False] * 3, [16] * 3, pressure=9)
    assert high.ks == [0, 0, 0] and set(high.reasons) == {"pressure"} and not high.speculation_on
    assert policy.decide(["code"], [False], [16], pressure=6).reasons == ["pressure"]  # still above low
    back = policy.decide(["code"], [False], [16], pressure=3)
    assert back.ks[0] > 0 and back.reasons == ["adaptive"]


def test_cost_model_learns_that_big_batches_make_verification_expensive():
    costs = CostModel(decay=0.9)
    for _ in range(50):  # memory-bound at small batch, compute-bound beyond ~64 tokens
        for tokens in (1, 4, 8, 16, 64, 128, 256):
            costs.observe_target(tokens, 0.010 + 0.0004 * tokens)
        costs.observe_draft(1, 0.002)
        costs.observe_draft(32, 0.004)
    assert costs.v(4, 1) < 1.5
    assert costs.v(4, 32) > 2.5
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


def test_a_remote_draft_call_is_a_fixed_cost_per_round_not_per_step():
    """Regression: the call overhead was spread over the k steps of a round, so a k = 1 probe made drafting
    look ~4x dearer per step and held the policy at k = 0 even where speculation doubled throughput."""
    costs = CostModel(decay=0.9)
    for _ in range(50):
        for tokens in (2, 4, 8):
            costs.observe_target(tokens, 0.012 + 0.0005 * tokens)  # a hop-dominated target step
        costs.observe_draft(2, 0.002)
        costs.observe_draft_call(0.006)
    assert costs.draft_call_seconds == pytest.approx(0.006)
    assert costs.round_cost(3, 2) == pytest.approx(3 * costs.c(2) + 0.006 / costs.target.predict(2) + costs.v(3, 2))
    assert costs.speedup(0.85, 3, 2) > 1.4  # still clearly worth it: the overhead is paid once per round
    assert costs.round_cost(0, 2) == 1.0
