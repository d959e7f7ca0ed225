"""`LORAPLANE_PLANNER=greedy`: the daemon's placement with the first-fit planner (CP-SAT's hint and fallback) in
place of CP-SAT, the same rules before and after it. Caps, base models and which worker loads what."""

from scheduler.planning.placement import place
from scheduler.planning.types import LiveWorker, PendingTrial, Snapshot


def trial(i: int, model: str = "m1", cap: int = 8, task: str = "t1") -> PendingTrial:
    return PendingTrial(trial_id=f"tr{i}", task_id=task, tenant_id="ten", base_model=model, max_trials_per_pack=cap,
                        remaining_steps=100, tokens_per_step=512)


def packs(snapshot: Snapshot) -> set[tuple[str, str, frozenset[str]]]:
    """The packs the greedy placement starts now: (worker, base model, trials)."""
    plan = place(snapshot, {}, solver="greedy").plan
    return {(p.worker_id, p.base_model, frozenset(p.trial_ids)) for p in plan.packs}


def test_plan_nothing_pending_gives_no_packs() -> None:
    placement = place(Snapshot(pending=(), idle_workers=(LiveWorker("w1", 8),)), {}, solver="greedy")
    assert placement.plan.packs == () and placement.plan.backfills == ()


def test_plan_no_idle_worker_gives_no_packs() -> None:
    assert packs(Snapshot(pending=(trial(1),), idle_workers=())) == set()


def test_plan_fills_one_worker_up_to_its_slots() -> None:
    snapshot = Snapshot(pending=tuple(trial(i) for i in range(5)), idle_workers=(LiveWorker("w1", 3),))
    # The oldest first; on the cost priors no trial waits while the pack starting now has room (`fill_now`).
    assert packs(snapshot) == {("w1", "m1", frozenset({"tr0", "tr1", "tr2"}))}
    (pack,) = place(snapshot, {}, solver="greedy").plan.packs
    assert pack.max_trials_per_pack == 3


def test_plan_respects_the_tasks_own_pack_cap() -> None:
    pending = (trial(0, cap=2), trial(1, cap=2), trial(2, cap=2))
    snapshot = Snapshot(pending=pending, idle_workers=(LiveWorker("w1", 8), LiveWorker("w2", 8)))
    planned = packs(snapshot)
    assert sorted(len(ids) for _, _, ids in planned) == [1, 2]
    assert set().union(*(ids for _, _, ids in planned)) == {"tr0", "tr1", "tr2"}
    assert {w for w, _, _ in planned} == {"w1", "w2"}


def test_plan_groups_by_base_model_and_mixes_tasks_of_one_model() -> None:
    pending = (trial(0, "m1", task="a"), trial(1, "m2", task="b"), trial(2, "m1", task="c"), trial(3, "m2", task="b"))
    snapshot = Snapshot(pending=pending, idle_workers=(LiveWorker("w2", 8), LiveWorker("w1", 8)))
    assert {(m, ids) for _, m, ids in packs(snapshot)} == {
        ("m1", frozenset({"tr0", "tr2"})), ("m2", frozenset({"tr1", "tr3"})),
    }


def test_plan_a_smaller_cap_of_a_later_task_does_not_shrink_a_full_pack() -> None:
    pending = (trial(0, cap=4, task="a"), trial(1, cap=4, task="a"), trial(2, cap=1, task="b"), trial(3, cap=4))
    snapshot = Snapshot(pending=pending, idle_workers=(LiveWorker("w1", 8),))
    # tr2 (cap 1) cannot join a pack that already has two trials; tr3 still can.
    assert packs(snapshot) == {("w1", "m1", frozenset({"tr0", "tr1", "tr3"}))}


def test_plan_places_a_model_only_on_workers_that_can_load_it() -> None:
    pending = (trial(0, "big"), trial(1, "m1"), trial(2, "big"), trial(3, "m1"))
    # w1 cannot load "big"; w2 loads every model (None).
    snapshot = Snapshot(pending=pending, idle_workers=(LiveWorker("w1", 8, models=frozenset({"m1"})),
                                                      LiveWorker("w2", 8)))
    assert packs(snapshot) == {("w1", "m1", frozenset({"tr1", "tr3"})), ("w2", "big", frozenset({"tr0", "tr2"}))}


def test_plan_leaves_a_worker_idle_when_it_can_load_none_of_the_waiting_models() -> None:
    snapshot = Snapshot(pending=(trial(0, "big"),), idle_workers=(LiveWorker("w1", 8, models=frozenset({"m1"})),
                                                                 LiveWorker("w2", 8, models=frozenset())))
    assert packs(snapshot) == set()
    can = Snapshot(pending=(trial(0, "big"),), idle_workers=(LiveWorker("w1", 8, models=frozenset({"m1", "big"})),))
    assert packs(can) == {("w1", "big", frozenset({"tr0"}))}
