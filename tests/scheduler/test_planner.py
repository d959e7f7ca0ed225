from scheduler.planner import IdleWorker, PendingTrial, Plan, PlannedPack, Snapshot, plan


def trial(i: int, model: str = "m1", cap: int = 8, task: str = "t1") -> PendingTrial:
    return PendingTrial(trial_id=f"tr{i}", task_id=task, tenant_id="ten", base_model=model, max_trials_per_pack=cap)


def test_plan_nothing_pending_gives_no_packs() -> None:
    assert plan(Snapshot(pending=(), idle_workers=(IdleWorker("w1", 8),))) == Plan(())


def test_plan_no_idle_worker_gives_no_packs() -> None:
    assert plan(Snapshot(pending=(trial(1),), idle_workers=())) == Plan(())


def test_plan_fills_one_worker_up_to_its_slots() -> None:
    snapshot = Snapshot(pending=tuple(trial(i) for i in range(5)), idle_workers=(IdleWorker("w1", 3),))
    assert plan(snapshot).packs == (PlannedPack("w1", "m1", ("tr0", "tr1", "tr2")),)


def test_plan_respects_the_tasks_own_pack_cap() -> None:
    pending = (trial(0, cap=2), trial(1, cap=2), trial(2, cap=2))
    snapshot = Snapshot(pending=pending, idle_workers=(IdleWorker("w1", 8), IdleWorker("w2", 8)))
    assert plan(snapshot).packs == (
        PlannedPack("w1", "m1", ("tr0", "tr1")),
        PlannedPack("w2", "m1", ("tr2",)),
    )


def test_plan_groups_by_base_model_and_mixes_tasks_of_one_model() -> None:
    pending = (trial(0, "m1", task="a"), trial(1, "m2", task="b"), trial(2, "m1", task="c"), trial(3, "m2", task="b"))
    snapshot = Snapshot(pending=pending, idle_workers=(IdleWorker("w2", 8), IdleWorker("w1", 8)))
    # Workers are taken in id order; the oldest trial picks the model of each pack.
    assert plan(snapshot).packs == (
        PlannedPack("w1", "m1", ("tr0", "tr2")),
        PlannedPack("w2", "m2", ("tr1", "tr3")),
    )


def test_plan_a_smaller_cap_of_a_later_task_does_not_shrink_a_full_pack() -> None:
    pending = (trial(0, cap=4, task="a"), trial(1, cap=4, task="a"), trial(2, cap=1, task="b"), trial(3, cap=4))
    snapshot = Snapshot(pending=pending, idle_workers=(IdleWorker("w1", 8),))
    # tr2 (cap 1) cannot join a pack that already has two trials; tr3 still can.
    assert plan(snapshot).packs == (PlannedPack("w1", "m1", ("tr0", "tr1", "tr3")),)


def test_plan_places_a_model_only_on_workers_that_can_load_it() -> None:
    pending = (trial(0, "big"), trial(1, "m1"), trial(2, "big"), trial(3, "m1"))
    # w1 cannot load the oldest trial's model: it takes the oldest it can; w2 loads every model (None).
    snapshot = Snapshot(pending=pending, idle_workers=(IdleWorker("w1", 8, models=frozenset({"m1"})),
                                                      IdleWorker("w2", 8)))
    assert plan(snapshot).packs == (
        PlannedPack("w1", "m1", ("tr1", "tr3")),
        PlannedPack("w2", "big", ("tr0", "tr2")),
    )


def test_plan_leaves_a_worker_idle_when_it_can_load_none_of_the_waiting_models() -> None:
    snapshot = Snapshot(pending=(trial(0, "big"),), idle_workers=(IdleWorker("w1", 8, models=frozenset({"m1"})),
                                                                 IdleWorker("w2", 8, models=frozenset())))
    assert plan(snapshot).packs == ()
    can = Snapshot(pending=(trial(0, "big"),), idle_workers=(IdleWorker("w1", 8, models=frozenset({"m1", "big"})),))
    assert plan(can).packs == (PlannedPack("w1", "big", ("tr0",)),)
