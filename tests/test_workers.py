"""The router's worker pool (sequence affinity, balancing, failures) and the split/merge of a round's
proposal and results across draft actors and target groups — pure functions, no Ray."""

import torch

from raysd.drafting import DraftProposal, merge_proposals, select_rows
from raysd.serve.cluster import ClusterMonitor, WorkerInfo
from raysd.serve.workers import WorkerPool
from raysd.verify import VerifyResult, merge_results


def _infos(*ids, kind="target", capacity=2):
    return {i: WorkerInfo(kind, i, [f"{i}-rank0"], capacity) for i in ids}


def test_new_sequences_are_balanced_and_stay_pinned():
    pool = WorkerPool("target")
    pool.update(_infos("a", "b"))
    placed = [pool.worker_of(f"s{i}").worker_id for i in range(4)]
    assert sorted(placed) == ["a", "a", "b", "b"]  # least loaded first
    assert pool.worker_of("s0").worker_id == placed[0]  # affinity for the sequence's life
    assert pool.worker_of("s9") is None  # both full (capacity 2)
    assert pool.forget("s0").worker_id == placed[0]
    assert pool.worker_of("s9").worker_id == placed[0]  # the freed slot is reused


def test_failed_worker_is_never_readopted_but_a_late_heartbeat_is():
    pool = WorkerPool("target")
    pool.update(_infos("a", "b"))
    assert [pool.worker_of("s1").worker_id, pool.worker_of("s2").worker_id] == ["a", "b"]
    assert pool.drop("a") == ["s1"]  # a call to it failed: its sequences' caches are gone
    pool.update(_infos("a", "b"))  # the monitor still lists the dead one for a while
    assert set(pool.workers) == {"b"}
    pool.update(_infos("c"))  # b missed its heartbeats: unlisted, but it still holds s2's cache
    assert pool.worker_of("s2").worker_id == "b"  # s2 stays on it (only a failed call proves it dead)
    assert pool.worker_of("s3").worker_id == "c"  # nothing new goes to an unlisted worker
    pool.update(_infos("b", "c"))  # b heartbeats again: it was slow, not dead
    assert set(pool.workers) == {"b", "c"} and pool.workers["b"].listed


def test_pools_only_take_their_own_kind():
    pool = WorkerPool("draft")
    pool.update({**_infos("t"), **_infos("d", kind="draft")})
    assert set(pool.workers) == {"d"}


def test_monitor_sums_pressure_and_forgets_silent_sources():
    monitor = ClusterMonitor(stale_after_s=60)
    monitor.report("router-1", 3)
    monitor.heartbeat(WorkerInfo("target", "t1", [], 8))
    view = monitor.report("router-2", 4)
    assert view.pressure == 7 and set(view.workers) == {"t1"}
    monitor.stale_after_s = 0.0
    assert monitor.view().pressure == 0 and monitor.view().workers == {}


def test_split_and_merge_of_a_round_are_exact():
    token_ids = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    num_draft = torch.tensor([3, 1, 2])
    probs = torch.rand(3, 3, 7)
    proposal = DraftProposal(token_ids, num_draft, probs, 0.5, 3)
    part = select_rows(proposal, [1, 2])
    assert part.token_ids.tolist() == [[4, 0], [5, 6]] and part.num_draft.tolist() == [1, 2]
    merged = merge_proposals(3, [([1, 2], part), ([0], select_rows(proposal, [0]))])
    assert torch.equal(merged.token_ids, token_ids) and torch.equal(merged.num_draft, num_draft)
    assert torch.equal(merged.draft_probs[0], probs[0]) and torch.equal(merged.draft_probs[2, :2], probs[2, :2])
    results = merge_results(3, [([2, 0], VerifyResult([2, 3], [60, 10], [False, False], 0.2, 0.0, 8)),
                                ([1], VerifyResult([0], [40], [True], 0.3, 0.1, 4))])
    assert results.num_accepted == [3, 0, 2] and results.bonus_token_ids == [10, 40, 60]
    assert results.failed == [False, True, False] and results.seconds == 0.3 and results.batch_tokens == 12
    uncovered = merge_results(2, [([0], VerifyResult([1], [9], [False], 0.1, 0.0, 2))])
    assert uncovered.failed == [False, True]  # a row no group verified is never silently "accepted"


def test_monitor_announces_departed_routers_until_they_report_again():
    from raysd.sequence import new_seq_id, origin_of, process_tag

    monitor = ClusterMonitor(stale_after_s=60)
    monitor.report(f"router-{process_tag()}", 1)
    assert monitor.view().departed == []
    monitor.stale_after_s = 0.0  # everything is stale now: the router went silent
    assert monitor.view().departed == [f"router-{process_tag()}"]
    assert origin_of(new_seq_id()) == process_tag()  # how workers match orphaned sequences to it
    monitor.stale_after_s = 60
    monitor.report(f"router-{process_tag()}", 1)  # it was only stalled
    assert monitor.view().departed == []


def test_a_draining_worker_keeps_its_sequences_and_gets_new_ones_only_as_a_last_resort():
    pool = WorkerPool("target")
    pool.update({"old": WorkerInfo("target", "old", ["r0"], 4, {"draining": 1.0})})
    assert pool.worker_of("s1").worker_id == "old"  # nothing else is up yet: better than failing the request
    pool.update({"old": WorkerInfo("target", "old", ["r0"], 4, {"draining": 1.0, "sequences": 1}),
                 "new": WorkerInfo("target", "new", ["r1"], 4, {"sequences": 3})})
    assert pool.worker_of("s2").worker_id == "new"  # even though it is busier
    assert pool.worker_of("s1").worker_id == "old"  # pinned sequences stay


def test_an_unlisted_worker_finishes_its_sequences_then_is_forgotten():
    """Regression: when the monitor is replaced (any redeploy), its first views list no one; the router
    dropped every target and failed all in-flight streams though their groups were alive."""
    pool = WorkerPool("target")
    pool.update(_infos("old"))
    pool.worker_of("s1")
    pool.update({})  # a fresh monitor that has not heard any heartbeat yet
    assert not pool.available  # no new sequences anywhere...
    assert pool.worker_of("s1").worker_id == "old"  # ...but s1 keeps its group
    assert pool.worker_of("s2") is None
    assert pool.forget("s1").worker_id == "old"  # its last sequence is done: the worker is forgotten
    assert pool.workers == {}
    pool.update(_infos("old"))  # a late heartbeat: not dead, adopted again
    assert pool.available
