"""Why a task waits, judged purely from a snapshot and a plan (scheduler/planning/waits.py): one test per reason,
the queue positions, the predicted starts in seconds, and which changes are worth an event."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from scheduler.planning.cost import MemoryModel, ModelCost, StepTimeModel
from scheduler.planning.placement import UNIT_S, place
from scheduler.planning.types import (
    LivePack,
    LiveWorker,
    PendingTrial,
    PlanResult,
    RunningMember,
    ScheduledPack,
    Snapshot,
)
from scheduler.planning.waits import (
    ETA_RETELL_S,
    Backoff,
    BusyPack,
    TaskWait,
    join_cost,
    start_at,
    task_waits,
    worth_telling,
)

X, Y = "model-x", "model-y"
NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def trial(trial_id: str, task_id: str, model: str = Y) -> PendingTrial:
    return PendingTrial(trial_id=trial_id, task_id=task_id, tenant_id="ten", base_model=model,
                        max_trials_per_pack=8, remaining_steps=10, tokens_per_step=128)


def worker(worker_id: str = "local", models: frozenset[str] | None = None) -> LiveWorker:
    return LiveWorker(worker_id, max_slots=32, models=models)


PACK_A = BusyPack(pack_id="pack-a", worker_id="local", base_model=X, trials=4, ends_in_s=180.0)


def result(*packs: ScheduledPack, unschedulable: tuple[str, ...] = ()) -> PlanResult:
    return PlanResult(packs=packs, start_now=tuple(p for p in packs if p.start == 0), completion={},
                      unschedulable=unschedulable, makespan=0, objective=0, solve_s=0.0, status="optimal")


def test_behind_the_pack_of_another_model_without_a_plan() -> None:
    """The issue's case: the only worker trains a 4-trial pack of model X with room to spare; the task on model Y
    waits for it. The planner had nothing to decide (no idle worker, no pack that can take Y): the pack's
    predicted end is the start."""
    [wait] = task_waits([trial("t1", "B"), trial("t2", "B"), trial("t3", "B")], set(), [worker()], [PACK_A], None,
                        unit_s=1.0)
    assert (wait.task_id, wait.reason, wait.position, wait.starts_in_s) == ("B", "behind_pack", 1, 180.0)
    assert (wait.pack_id, wait.worker_id, wait.waiting_trials) == ("pack-a", "local", 3)
    assert wait.message == ("3 trials waiting behind pack pack-a on worker local (4 trials of model-x, about 3 min "
                            "left); 1st in queue; starts in about 3 min")


def test_behind_a_pack_by_the_planners_predicted_start_in_seconds() -> None:
    later = ScheduledPack(pack_key="new-t1", worker_ids=("local",), base_model=Y, trial_ids=("t1",), start=95, end=200)
    [wait] = task_waits([trial("t1", "B")], set(), [worker()], [PACK_A], result(later), unit_s=2.0)
    assert (wait.reason, wait.starts_in_s, wait.pack_id) == ("behind_pack", 190.0, "pack-a")


def test_planned_later_on_a_worker_with_no_pack() -> None:
    later = ScheduledPack(pack_key="new-t1", worker_ids=("other",), base_model=Y, trial_ids=("t1",), start=30, end=90)
    [wait] = task_waits([trial("t1", "B")], set(), [worker(), worker("other")], [PACK_A], result(later), unit_s=1.0)
    assert (wait.reason, wait.starts_in_s, wait.pack_id) == ("planned_later", 30.0, None)
    assert wait.message == "1 trial waiting: the planner starts them later; 1st in queue; starts in under a minute"


def test_planned_later_without_a_prediction_while_a_worker_that_loads_it_is_free() -> None:
    [wait] = task_waits([trial("t1", "B")], set(), [worker(), worker("idle")], [PACK_A], None, unit_s=1.0)
    assert (wait.reason, wait.starts_in_s) == ("planned_later", None)


def test_no_worker_alive() -> None:
    [wait] = task_waits([trial("t1", "B")], set(), [], [], None, unit_s=1.0)
    assert (wait.reason, wait.starts_in_s, wait.position) == ("no_worker", None, 1)


def test_model_not_loadable_unless_it_is_too_new_to_judge() -> None:
    only_x = [worker(models=frozenset({X}))]
    [wait] = task_waits([trial("t1", "B")], set(), only_x, [PACK_A], None, unit_s=1.0)
    assert wait.reason == "model_not_loadable"
    assert wait.message.startswith("1 trial waiting: no live worker can load model model-y (1 worker(s) alive)")
    [fresh] = task_waits([trial("t1", "B")], set(), only_x, [PACK_A], None, unit_s=1.0, unjudged_models={Y})
    assert fresh.reason != "model_not_loadable"


def test_does_not_fit_when_the_planner_finds_no_worker_with_the_memory() -> None:
    [wait] = task_waits([trial("t1", "B")], set(), [worker()], [], result(unschedulable=("t1",)), unit_s=1.0)
    assert (wait.reason, wait.starts_in_s) == ("does_not_fit", None)


def test_positions_follow_the_planners_order_and_started_tasks_are_left_out() -> None:
    pending = [trial("a1", "A", X), trial("b1", "B"), trial("b2", "B"), trial("c1", "C"), trial("d1", "D")]
    waits = task_waits(pending, {"a1", "d1"}, [worker()], [PACK_A], None, unit_s=1.0)
    assert [(w.task_id, w.position, w.waiting_trials) for w in waits] == [("B", 1, 2), ("C", 2, 1)]
    assert "2nd in queue" in waits[1].message


def test_a_running_task_with_trials_left_waits_behind_its_own_pack() -> None:
    own = BusyPack(pack_id="pack-own", worker_id="local", base_model=Y, trials=8, ends_in_s=4000.0)
    [wait] = task_waits([trial("t9", "B")], set(), [worker()], [own], None, unit_s=1.0)
    assert (wait.reason, wait.pack_id) == ("behind_pack", "pack-own")
    assert "about 1.1 h left" in wait.message


def test_retry_backoff_is_out_of_the_queue() -> None:
    held = Backoff(task_id="R", tenant_id="ten", base_model=Y, trials=2, ends_in_s=45.0)
    [queued, backing_off] = task_waits([trial("t1", "B")], set(), [worker()], [PACK_A], None, unit_s=1.0,
                                       backoffs=[held])
    assert queued.position == 1
    assert (backing_off.task_id, backing_off.reason, backing_off.position, backing_off.starts_in_s) == (
        "R", "retry_backoff", None, 45.0)


def wait_of(reason: str = "behind_pack", position: int | None = 1, starts_in_s: float | None = 600.0) -> TaskWait:
    return TaskWait(task_id="B", tenant_id="ten", base_model=Y, reason=reason,  # type: ignore[arg-type]
                    waiting_trials=1, position=position, starts_in_s=starts_in_s, message="m")


def test_worth_telling_a_new_reason_or_position_but_not_a_drifting_eta() -> None:
    told = ("behind_pack", 1, NOW + timedelta(seconds=600), None)  # a record kept from before told_at
    assert worth_telling(None, wait_of(), NOW)
    assert not worth_telling(told, wait_of(starts_in_s=630.0), NOW)  # moved 30 s: drift
    assert not worth_telling(told, wait_of(starts_in_s=880.0), NOW)  # moved 280 s, less than half of 600
    assert worth_telling(told, wait_of(starts_in_s=950.0), NOW)  # moved 350 s: more than half and a minute
    assert worth_telling(told, wait_of(reason="planned_later"), NOW)
    assert worth_telling(told, wait_of(position=2), NOW)
    assert worth_telling(told, wait_of(starts_in_s=None), NOW)
    # Close to the start, a move of half the wait must still be more than a minute.
    soon = ("behind_pack", 1, NOW + timedelta(seconds=40), None)
    assert not worth_telling(soon, wait_of(starts_in_s=90.0), NOW)


def test_a_start_flipping_between_two_estimates_is_told_at_most_every_few_minutes() -> None:
    """Measured on the H200 (2026-11-27): behind an overrunning pack one task's start flipped between "under a
    minute" and "about 2 min" each round. Each flip moved it by more than a minute, and the wait announced was
    already over, so every flip was news: 55,505 events in 21 minutes. Now a moved start is news once per
    ETA_RETELL_S, measured against the wait announced when it was told."""
    told_at = NOW - timedelta(seconds=120)
    told = ("behind_pack", 1, NOW - timedelta(seconds=30), told_at)  # announced 90 s ahead; overdue now
    assert not worth_telling(told, wait_of(starts_in_s=100.0), NOW)  # a flip, two minutes after the last word
    later = told_at + timedelta(seconds=ETA_RETELL_S)
    assert worth_telling(told, wait_of(starts_in_s=100.0), later)  # five minutes on, it moved: news again
    # The share of the wait is of the wait announced then (90 s), not of what is left of it now.
    announced = ("behind_pack", 1, later + timedelta(seconds=600), later - timedelta(seconds=ETA_RETELL_S))
    assert not worth_telling(announced, wait_of(starts_in_s=1000.0), later)  # moved 400 s of a 900 s wait
    assert worth_telling(told, wait_of(reason="planned_later"), NOW)  # a new reason is news at once
    assert worth_telling(told, wait_of(position=2), NOW)


def test_start_at_is_a_time_to_the_second() -> None:
    assert start_at(wait_of(starts_in_s=90.4), NOW) == NOW + timedelta(seconds=90)
    assert start_at(wait_of(starts_in_s=None), NOW) is None


# ---- why a trial waits behind a pack of its own model with free slots (issue 52) ---------------------------------

TOKENS = 16_384  # batch 16 x 1024: each member's tokens in every step of the pack
# A measured (not prior) cost model in which a step's cost is mostly its tokens: packing buys little.
TOKEN_BOUND = ModelCost(memory=MemoryModel(k0_bytes=2e9, k1_bytes_per_token=2e5),
                        step=StepTimeModel(a_s=0.05, b_s_per_token=2e-5, c_s_per_slot=1e-3))
# One whose step is mostly its fixed cost (a small model, host-bound): a trial more costs a pack little.
HOST_BOUND = ModelCost(memory=MemoryModel(k0_bytes=2e9, k1_bytes_per_token=2e5),
                       step=StepTimeModel(a_s=0.25, b_s_per_token=1e-7, c_s_per_slot=1e-3))


def probe_cluster(**trial_fields: object) -> tuple[Snapshot, LiveWorker, BusyPack]:
    """The probe's cluster: one worker of 32 slots running a pack of 3 trials of model Y (29 slots free), and another
    tenant's trial of model Y pending."""
    members = tuple(RunningMember(f"m{i}", "ten-a", 1, remaining_steps=600, tokens_per_step=TOKENS) for i in range(3))
    busy = LiveWorker("w1", max_slots=32, memory_bytes=80 * 2**30, busy_for_s=624.0)
    pack = LivePack(pack_id="pack-a", worker_id="w1", base_model=Y, free_slots=29, members=3, max_rank=16,
                    target_modules=("all-linear",), tokens_per_step=3 * TOKENS, busy_for_s=624.0,
                    member_list=members, task_ids=frozenset({"A"}))
    fields: dict[str, object] = {"max_trials_per_pack": 32, "remaining_steps": 600, "tokens_per_step": TOKENS,
                                 **trial_fields}
    pending = PendingTrial(trial_id="t1", task_id="B", tenant_id="ten-b", base_model=Y, **fields)  # type: ignore[arg-type]
    snapshot = Snapshot(pending=(pending,), idle_workers=(), busy_workers=(busy,), live_packs=(pack,))
    return snapshot, busy, BusyPack(pack_id="pack-a", worker_id="w1", base_model=Y, trials=3, ends_in_s=624.0)


def explained(snapshot: Snapshot, busy: LiveWorker, pack: BusyPack, costs: dict[str, ModelCost]) -> TaskWait:
    placement = place(snapshot, costs)
    started = {t for b in placement.plan.backfills for t in b.trial_ids}
    assert started == set(), placement.plan
    [wait] = task_waits(snapshot.pending, started, [busy], [pack], placement.result, unit_s=UNIT_S,
                        live_packs=snapshot.live_packs, costs=costs)
    return wait


def test_a_trial_the_cost_model_keeps_out_of_a_pack_with_free_slots_is_told_why() -> None:
    """The probe's case: 29 of 32 slots free, and the planner waits. With each step's cost mostly its tokens, joining
    would slow each of the 3 members' 600 steps by the trial's share (about 3 min each, 10 min in all) for the trial
    to end about half a minute sooner; the plan waits, and the message says so with both numbers."""
    snapshot, busy, pack = probe_cluster()
    wait = explained(snapshot, busy, pack, {Y: TOKEN_BOUND})
    assert (wait.reason, wait.pack_id) == ("behind_pack", "pack-a")
    assert wait.message == (
        "1 trial waiting behind pack pack-a on worker w1 (3 trials of model-y, about 10 min left): the pack has 29 "
        "free slots, but joining now would slow its 3 trials by about 10 min in all (each step trains every member's "
        "tokens), while this trial would end under a minute sooner: waiting costs less in the planner's cost model; "
        "1st in queue; starts in about 10 min")
    cost = join_cost(snapshot.pending[0], snapshot.live_packs[0], busy, TOKEN_BOUND, unit_s=UNIT_S)
    assert cost is not None and cost.fits_memory and cost.members_slowed_s > 500


def test_where_a_step_is_mostly_its_fixed_cost_the_trial_joins_the_running_pack() -> None:
    """The same cluster on a host-bound model: a trial more costs each step little, so the plan back-fills it."""
    snapshot, _, _ = probe_cluster()
    placement = place(snapshot, {Y: HOST_BOUND})
    assert [(b.pack_id, b.trial_ids) for b in placement.plan.backfills] == [("pack-a", ("t1",))]


def test_a_trial_the_packs_engine_cannot_take_is_told_what_it_lacks() -> None:
    snapshot, busy, pack = probe_cluster(lora_rank=64)
    wait = explained(snapshot, busy, pack, {Y: HOST_BOUND})
    assert "(3 trials of model-y, about 10 min left): the pack has 29 free slots, but its adapters are padded to " \
           "rank 16, below this trial's 64;" in wait.message
    snapshot, busy, pack = probe_cluster(max_trials_per_pack=2)
    wait = explained(snapshot, busy, pack, {Y: HOST_BOUND})
    assert "(3 trials of model-y, about 10 min left): the pack has 29 free slots, but the task lets at most 2 " \
           "trials share a pack and it trains 3;" in wait.message
