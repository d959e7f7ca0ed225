"""Attempts that blame the right party (issue 29): the pure policies (scheduler/planning/faults.py), and through the
daemon against the real Postgres and Redis (we play the worker's processes by publishing their messages, as
tests/scheduler/test_liveness.py does): a worker that loses packs repeatedly is quarantined — left out of every
plan, said so, measured — until its quarantine ends, while its trials spend no attempt."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from common import states
from common.celery import worker_queue
from common.db import session_scope
from common.settings import Settings, get_settings
from common.tables import Event, Pack, Trial, Worker, as_utc, utcnow
from common.telemetry import scheduler_metrics
from scheduler.planning.faults import (
    ALONE_AFTER_WORKER_LOSSES,
    FaultPolicy,
    max_trials_per_pack_after_losses,
    quarantine_s_for,
    recent_losses,
    requeue_delay_s,
)
from scheduler.service.daemon import SchedulerDaemon
from scheduler.service.faults import WAITING_FOR_WORKER, fault_policy
from scheduler.service.telemetry import SchedulerTelemetry
from tests.scheduler.test_daemon import WORKER, live_pack, make_task
from tests.scheduler.test_liveness import FakeProcess, daemon  # noqa: F401 - the fixture

DEFAULTS = fault_policy(Settings())


# ------------------------------------------------------------------------------------------------ pure policies


def test_the_defaults_are_the_settings() -> None:
    assert DEFAULTS == FaultPolicy(requeue_backoff_s=5.0, requeue_backoff_max_s=300.0, quarantine_losses=3,
                                   quarantine_window_s=600.0, quarantine_s=60.0, quarantine_max_s=1800.0)


def test_the_requeue_backoff_doubles_with_each_worker_loss_up_to_its_cap() -> None:
    assert [requeue_delay_s(k, DEFAULTS) for k in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert requeue_delay_s(0, DEFAULTS) == 5  # never below the base
    assert requeue_delay_s(10_000, DEFAULTS) == 300  # no overflow
    assert requeue_delay_s(3, replace(DEFAULTS, requeue_backoff_s=0)) == 0  # off
    # MAX_TRIAL_WORKER_LOSSES losses at the defaults: about twenty minutes before a poison trial is given up.
    assert 1000 < sum(requeue_delay_s(k, DEFAULTS) for k in range(1, states.MAX_TRIAL_WORKER_LOSSES)) < 1500


def test_a_workers_loss_history_keeps_the_window() -> None:
    now = 10_000.0
    assert recent_losses([now - 700, now - 599, now - 10, now], now, DEFAULTS) == [now - 599, now - 10, now]
    assert recent_losses([now - 600], now, DEFAULTS) == []  # exactly a window ago: out
    assert recent_losses([now + 5, now - 1], now, DEFAULTS) == [now - 1]  # a time from the future says nothing


@pytest.mark.parametrize(("losses", "in_a_row", "expected"), [
    (1, 0, None), (2, 0, None),  # below the count: no quarantine
    (3, 0, 60.0), (4, 0, 60.0),  # the first: the base
    (3, 1, 120.0), (3, 2, 240.0), (3, 4, 960.0),  # each in a row doubles
    (3, 5, 1800.0), (3, 64, 1800.0), (3, 10_000, 1800.0),  # up to the cap
])
def test_a_worker_is_quarantined_past_the_count_for_longer_each_time(losses: int, in_a_row: int,
                                                                     expected: float | None) -> None:
    assert quarantine_s_for(losses, in_a_row, DEFAULTS) == expected


def test_a_trial_whose_workers_keep_being_lost_trains_alone_from_half_the_bound() -> None:
    assert ALONE_AFTER_WORKER_LOSSES == states.MAX_TRIAL_WORKER_LOSSES // 2 == 5
    assert [max_trials_per_pack_after_losses(8, k) for k in (0, 1, 4, 5, 9)] == [8, 8, 8, 1, 1]


# ----------------------------------------------------------------------------------------- through the daemon


def quarantine_state() -> tuple[list[float], int, float | None]:
    """The worker's lost packs, quarantines in a row, and seconds left in its quarantine (None: none)."""
    with session_scope() as s:
        w = s.get_one(Worker, WORKER)
        left = (as_utc(w.quarantined_until) - utcnow()).total_seconds() if w.quarantined_until else None
        return list(w.lost_packs or []), w.quarantines, left


def restart_under_its_id(daemon: SchedulerDaemon) -> FakeProcess:  # noqa: F811 - the fixture's name
    """A new process of the worker: its first heartbeat ends the old one's pack (a lost pack, charged to the
    worker); returns it, after it started the pack it was given next, if any."""
    proc = FakeProcess()
    proc.beat(None)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        pack = s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).one_or_none()
    if pack is not None:
        proc.report("pack.started", pack_id=pack.id)
        proc.beat(pack.id)
        daemon.step(block_s=0.2)
    return proc


def test_a_worker_that_loses_three_packs_is_left_out_of_plans_until_its_quarantine_ends(
    daemon: SchedulerDaemon,  # noqa: F811
) -> None:
    _, trial_ids = make_task(2, steps=20)
    restart_under_its_id(daemon)  # the first process, with the first pack
    for loss in (1, 2):
        restart_under_its_id(daemon)
        lost, in_a_row, left = quarantine_state()
        assert (len(lost), in_a_row, left) == (loss, 0, None)
        live_pack()  # planned on it again at once (the fixture's backoff is 0)
    restart_under_its_id(daemon)  # the third loss within the window
    lost, in_a_row, left = quarantine_state()
    assert len(lost) == 3 and in_a_row == 1 and left is not None and 55 < left <= 60
    for _round in range(3):  # nothing is planned on it, however many rounds
        daemon.step(block_s=0.05)
    with session_scope() as s:
        assert s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).all() == []
        trials = s.scalars(select(Trial)).all()
        # Three worker losses, no attempt spent: the trials did nothing wrong.
        assert {(t.state, t.attempts, t.worker_losses) for t in trials} == {(states.TRIAL_PENDING, 0, 3)}
        waiting = s.scalars(select(Event).where(Event.type == WAITING_FOR_WORKER)).all()
        assert sorted(e.trial_id or "" for e in waiting) == sorted(trial_ids)  # once each, when it began
        assert all(e.data["worker_id"] == WORKER and "waits for another worker" in e.message for e in waiting)
        s.get_one(Worker, WORKER).quarantined_until = utcnow() - timedelta(seconds=1)  # its quarantine ends
    daemon.step(block_s=0.05)
    pack = live_pack()  # it recovers: planned again
    assert pack.worker_id == WORKER and sorted(pack.trial_ids) == sorted(trial_ids)
    with session_scope() as s:
        assert {t.attempts for t in s.scalars(select(Trial))} == {1}


def test_a_worker_lost_again_after_its_quarantine_goes_back_for_twice_as_long_until_a_pack_ends_well(
    daemon: SchedulerDaemon,  # noqa: F811
) -> None:
    make_task(1, steps=20)
    proc = restart_under_its_id(daemon)
    for _loss in range(3):
        proc = restart_under_its_id(daemon)
    with session_scope() as s:
        s.get_one(Worker, WORKER).quarantined_until = utcnow() - timedelta(seconds=1)
    daemon.step(block_s=0.05)
    pack = live_pack()
    proc.report("pack.started", pack_id=pack.id)
    daemon.step(block_s=0.05)
    proc = restart_under_its_id(daemon)  # a fourth loss, still within the window: back in quarantine at once
    lost, in_a_row, left = quarantine_state()
    assert len(lost) == 4 and in_a_row == 2 and left is not None and 115 < left <= 120
    # A pack that ends well clears the run: the next quarantine starts from the base again.
    with session_scope() as s:
        s.get_one(Worker, WORKER).quarantined_until = utcnow() - timedelta(seconds=1)
    daemon.step(block_s=0.05)
    pack = live_pack()
    (trial_id,) = pack.trial_ids
    proc.report("pack.started", pack_id=pack.id)
    proc.report("trial.finished", pack_id=pack.id, trial_id=trial_id, status="completed", steps_done=20,
                best_val_loss=0.5, best_step=20, final_train_loss=0.5, adapter_key="a")
    proc.report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    assert quarantine_state()[1] == 0
    with session_scope() as s:
        trial = s.get_one(Trial, trial_id)
        assert (trial.state, trial.attempts, trial.worker_losses) == (states.TRIAL_COMPLETED, 1, 4)


def test_while_a_worker_is_quarantined_its_trials_go_to_another(daemon: SchedulerDaemon) -> None:  # noqa: F811
    _, trial_ids = make_task(2, steps=20)
    restart_under_its_id(daemon)
    for _loss in range(3):
        restart_under_its_id(daemon)
    assert quarantine_state()[2] is not None
    FakeProcess().publish("heartbeat", worker_id="w-other", queue=worker_queue(get_settings(), "w-other"),
                          device="cpu", max_slots=8)  # (publish's worker_id is overridden by this one)
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.worker_id == "w-other" and sorted(pack.trial_ids) == sorted(trial_ids)


def test_the_scheduler_measures_quarantines(daemon: SchedulerDaemon) -> None:  # noqa: F811
    metrics = scheduler_metrics()
    begun = metrics.quarantines._value.get()
    make_task(1, steps=20)
    restart_under_its_id(daemon)
    for _loss in range(3):
        restart_under_its_id(daemon)
    assert metrics.quarantines._value.get() == begun + 1
    with session_scope() as s:
        SchedulerTelemetry(enabled=True).observe_state(s, utcnow())
    from prometheus_client import generate_latest

    samples = {sample.name: sample.value for family in text_string_to_metric_families(
        generate_latest(metrics.registry).decode()) for sample in family.samples}
    assert samples["loraplane_scheduler_workers_quarantined"] == 1
    assert samples["loraplane_scheduler_worker_quarantines_total"] == begun + 1


def test_a_trial_that_trains_alone_joins_no_running_pack_nor_takes_a_mate(daemon: SchedulerDaemon) -> None:  # noqa: F811
    """A trial of ALONE_AFTER_WORKER_LOSSES worker losses is not back-filled into a running pack (not even its own
    task's, where a resumed trial rejoins first) and its own pack is started with room for no one else."""
    _, (first, resumed) = make_task(2, steps=20)
    with session_scope() as s:  # only the first trains for now
        s.get_one(Trial, resumed).state = states.TRIAL_WAITING
    proc = FakeProcess()
    proc.beat(None)
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.trial_ids == [first] and (pack.capacity or 0) > 1
    proc.report("pack.started", pack_id=pack.id)
    proc.beat(pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:  # it comes back from a checkpoint, after losing five workers
        trial = s.get_one(Trial, resumed)
        trial.state, trial.checkpoint_step, trial.worker_losses = states.TRIAL_PENDING, 4, ALONE_AFTER_WORKER_LOSSES
    daemon.step(block_s=0.05)
    with session_scope() as s:
        assert s.get_one(Trial, resumed).state == states.TRIAL_PENDING  # not back-filled beside the first
        assert s.get_one(Pack, pack.id).trial_ids == [first]
    proc.report("trial.finished", pack_id=pack.id, trial_id=first, status="completed", steps_done=20,
                best_val_loss=0.5, best_step=20, final_train_loss=0.5, adapter_key="a")
    proc.report("pack.finished", pack_id=pack.id)
    proc.beat(None)
    daemon.step(block_s=0.2)
    alone = live_pack()
    assert alone.trial_ids == [resumed] and alone.capacity == 1
