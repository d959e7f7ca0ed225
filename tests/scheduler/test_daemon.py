"""The scheduler daemon against real Postgres, Redis and a Celery broker (no worker: we play its part
by publishing its reports), so every transition is checked without training anything."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
import redis
from sqlalchemy import func, select

from common import states
from common.bus import SCHEDULER_STREAM, commands_stream, get_bus
from common.celery import get_celery, worker_queue
from common.db import session_scope
from common.messages import REPORT_TYPES
from common.registry import DEFAULT_MODELS, ensure_default_models
from common.settings import DEFAULT_MAX_TRIALS_PER_PACK, get_settings
from common.tables import Event, File, MetricPoint, Pack, Task, Tenant, Trial, Worker, as_utc, new_id, utcnow
from scheduler.planning.cost import PRIOR_COST, prior_cost
from scheduler.planning.fairness import FairnessPolicy, policy_from
from scheduler.service.daemon import SchedulerDaemon
from scheduler.service.exits import PAUSE_MIN_STEPS, should_pause
from scheduler.service.faults import fault_policy
from tests.conftest import REDIS_URL

WORKER = "w-test"
TINY_PARAMETERS = next(m.parameters for m in DEFAULT_MODELS if m.name == "tiny-random-llama")


def fresh_daemon(*workers: str) -> SchedulerDaemon:
    """A daemon on the test bus, with whatever earlier tests left on the scheduler stream drained and the queues of
    ``workers`` emptied (the scheduler tests' ``daemon`` fixtures start from it)."""
    bus = get_bus()
    d = SchedulerDaemon(get_settings(), bus, get_celery(), consumer="test")
    while batch := bus.consume(SCHEDULER_STREAM, "scheduler", "test", count=1000, block_s=0.01):
        bus.ack(SCHEDULER_STREAM, "scheduler", [i for i, _ in batch])
    redis.Redis.from_url(REDIS_URL).delete(*(worker_queue(get_settings(), w) for w in workers))
    return d


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    d = fresh_daemon(WORKER)
    # A trial requeued after a worker's loss may be placed again at once here: the tests of the backoff set it.
    d.faults = replace(d.faults, requeue_backoff_s=0)
    yield d


def make_task(n_trials: int, cap: int = 8, early_exit: dict[str, object] | None = None, steps: int = 4, *,
              model: str = "tiny-random-llama", seq_len: int = 64, batch: int = 2,
              evaluation: dict[str, object] | None = None, spec: dict[str, object] | None = None
              ) -> tuple[str, list[str]]:
    with session_scope() as s:
        ensure_default_models(s)
        tenant = Tenant(id=new_id("ten"), name=new_id("n"), max_concurrent_trials=10, max_trials_per_task=10,
                        max_file_bytes=10**6)
        file = File(id=new_id("file"), tenant_id=tenant.id, filename="d.jsonl", bytes=1, rows=10,
                    format="prompt_completion", sha256="0" * 64, storage_key="files/x.jsonl")
        task = Task(id=new_id("task"), tenant_id=tenant.id, base_model=model,
                    training_file_id=file.id, state=states.TASK_QUEUED,
                    spec={"max_seq_len": seq_len, "eval_interval": 2, "validation_split": 0.2, "seed": 0,
                          "scheduling": {"max_trials_per_pack": cap},
                          "early_exit": early_exit or {"policy": "none"},
                          **({"evaluation": evaluation} if evaluation is not None else {}), **(spec or {})})
        s.add(tenant)
        s.flush()
        s.add(file)
        s.flush()
        s.add(task)
        s.flush()
        trials = [Trial(id=new_id("trial"), task_id=task.id, tenant_id=tenant.id, index=i,
                        state=states.TRIAL_PENDING, total_steps=steps,
                        hyperparameters={"learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8, "batch_size": batch,
                                         "lora_dropout": 0.0, "target_modules": ["q_proj"], "seed": i})
                  for i in range(n_trials)]
        s.add_all(trials)
        return task.id, [t.id for t in trials]


def report(kind: str, **fields: object) -> None:
    """What a worker sends: the report of type ``kind`` (common/messages.py) with these fields."""
    get_bus().publish(SCHEDULER_STREAM, REPORT_TYPES[kind](**{"worker_id": WORKER, **fields}).to_dict())


def heartbeat() -> None:
    report("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cpu", max_slots=8)


def queued_messages() -> int:
    return int(redis.Redis.from_url(REDIS_URL).llen(worker_queue(get_settings(), WORKER)))


def live_pack() -> Pack:
    with session_scope() as s:
        return s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).one()


def test_trials_are_packed_dispatched_ingested_and_the_best_wins(daemon: SchedulerDaemon) -> None:
    task_id, trial_ids = make_task(3)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.state == states.PACK_DISPATCHED and sorted(pack.trial_ids) == sorted(trial_ids)
    assert queued_messages() == 1

    report("pack.started", pack_id=pack.id)
    points = [[t, step, "train", 2.0 - step / 10] for t in trial_ids for step in (1, 2)]
    report("points", pack_id=pack.id, points=points)
    report("points", pack_id=pack.id, points=points)  # replayed batch: stored once
    for i, t in enumerate(trial_ids):
        report("points", pack_id=pack.id, points=[[t, 2, "val", 1.5 - i / 10]])
        report("trial.finished", pack_id=pack.id, trial_id=t, status="completed", steps_done=2,
               best_val_loss=1.5 - i / 10, best_step=2, final_train_loss=1.8, adapter_key=f"adapters/{t}.tar.gz")
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)

    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(MetricPoint)) == 3 * 3
        task = s.get(Task, task_id)
        assert task is not None and task.state == states.TASK_SUCCEEDED
        assert task.best_trial_id == trial_ids[2]  # the lowest validation loss
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_COMPLETED}
        events = list(s.scalars(select(Event).order_by(Event.id)))
        types = [e.type for e in events]
        assert types.count("trial.running") == 3 and types[-1] == "task.succeeded"
        assert s.get(Pack, pack.id).state == states.PACK_FINISHED  # type: ignore[union-attr]
        # The replan that placed them is an event of the task, with the solver's time and status.
        (planned,) = [e for e in events if e.type == "task.planned"]
        assert planned.data["trials_placed"] == 3 and planned.data["status"] in ("optimal", "feasible")
        assert planned.data["solve_ms"] >= 0



def test_run_ingests_on_its_own_thread_beside_the_rounds_and_the_task_succeeds(daemon: SchedulerDaemon) -> None:
    """`run` on PostgreSQL: the ingest thread reads the reports while the rounds plan and dispatch, each on its own
    database transactions; a round is woken by what ingest read. The same flow as the serial `step` above."""
    import threading

    from tests.e2e.flow import wait_for

    task_id, trial_ids = make_task(3)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        heartbeat()
        wait_for(lambda: queued_messages() == 1, 30, "the pack to be planned and dispatched")
        pack = live_pack()
        assert sorted(pack.trial_ids) == sorted(trial_ids)
        report("pack.started", pack_id=pack.id)
        for i, t in enumerate(trial_ids):
            report("points", pack_id=pack.id, points=[[t, 1, "train", 2.0], [t, 2, "val", 1.5 - i / 10]])
            report("trial.finished", pack_id=pack.id, trial_id=t, status="completed", steps_done=2,
                   best_val_loss=1.5 - i / 10, best_step=2, final_train_loss=1.8, adapter_key=f"adapters/{t}.tgz")
        report("pack.finished", pack_id=pack.id)

        def state() -> str:
            with session_scope() as s:
                return s.get_one(Task, task_id).state

        wait_for(lambda: state() == states.TASK_SUCCEEDED, 30, "the task to succeed")
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(MetricPoint)) == 2 * 3
        assert s.get_one(Task, task_id).best_trial_id == trial_ids[2]
        assert s.get_one(Pack, pack.id).state == states.PACK_FINISHED


def test_the_greedy_planner_setting_places_through_the_same_placement(daemon: SchedulerDaemon) -> None:
    """`LORAPLANE_PLANNER=greedy`: the daemon runs its placement with the first-fit planner instead of CP-SAT (the
    same rules before and after), so the pack is shaped for back-fills exactly as a CP-SAT pack is."""
    daemon.settings = daemon.settings.model_copy(update={"planner": "greedy"})
    _, trial_ids = make_task(3)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.state == states.PACK_DISPATCHED and sorted(pack.trial_ids) == sorted(trial_ids)
    assert pack.capacity == 8 and pack.max_rank == 4 and pack.target_modules == ["q_proj"]
    with session_scope() as s:
        planned = s.scalars(select(Event).where(Event.type == "task.planned")).one()
        assert planned.data["trials_placed"] == 3 and planned.data["status"] == "greedy"


@pytest.mark.parametrize("policy", ["none", "alto"])
def test_the_first_plan_of_an_18_trial_small_model_task_is_one_pack(daemon: SchedulerDaemon, policy: str) -> None:
    """Issue 15, through the daemon: an idle H100 worker with its default slot cap, an 18-trial SmolLM2-135M task
    (batch 4, 96-token rows) with the API's default pack cap and no measured costs. Early exit must not change
    the first plan: all 18 trials start now, in one pack (held-back trials delayed ALTO's warm-up ranking and made
    the early-exit task slower than the one without)."""
    _, trial_ids = make_task(18, cap=DEFAULT_MAX_TRIALS_PER_PACK, early_exit={"policy": policy}, steps=500,
                             model="smollm2-135m-instruct", seq_len=96, batch=4)
    report("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cuda:0", memory_bytes=80 * 10**9,
           max_slots=get_settings().worker_max_slots)
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.worker_id == WORKER and sorted(pack.trial_ids) == sorted(trial_ids)
    assert pack.capacity == DEFAULT_MAX_TRIALS_PER_PACK

def test_a_lost_worker_sends_its_trials_back_and_its_late_reports_are_dropped(daemon: SchedulerDaemon) -> None:
    daemon.faults = fault_policy(get_settings())  # the default backoff
    task_id, trial_ids = make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    report("points", pack_id=pack.id, points=[[trial_ids[0], 1, "train", 3.0]])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        worker = s.get(Worker, WORKER)
        assert worker is not None
        worker.last_heartbeat = utcnow() - timedelta(seconds=get_settings().worker_timeout_s + 1)
    daemon.tick()
    with session_scope() as s:
        assert s.get(Pack, pack.id).state == states.PACK_LOST  # type: ignore[union-attr]
        trials = s.scalars(select(Trial)).all()
        assert {t.state for t in trials} == {states.TRIAL_PENDING}
        # The worker's loss, not theirs: no attempt spent, one worker loss each, and a backoff before the next try.
        assert all(t.pack_id is None and t.attempts == 0 and t.worker_losses == 1 for t in trials)
        assert all(t.not_before is not None and as_utc(t.not_before) > utcnow() for t in trials)
        assert s.scalar(select(func.count()).select_from(MetricPoint)) == 0  # the curve restarts
        assert s.get_one(Worker, WORKER).lost_packs and len(s.get_one(Worker, WORKER).lost_packs or []) == 1
    # The "dead" worker was only slow: its report for the lost pack must change nothing.
    report("trial.finished", pack_id=pack.id, trial_id=trial_ids[0], status="completed", steps_done=4,
           best_val_loss=0.1, best_step=4, final_train_loss=0.1, adapter_key="x")
    heartbeat()  # ...and it comes back, but the trials wait out their backoff first...
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_PENDING}
        for t in s.scalars(select(Trial)):
            t.not_before = utcnow() - timedelta(seconds=1)  # ...which ends: they are planned again, into a new pack
    daemon.step(block_s=0.2)
    with session_scope() as s:
        trials = s.scalars(select(Trial)).all()
        assert {t.state for t in trials} == {states.TRIAL_RUNNING}
        assert all(t.attempts == 1 and t.pack_id != pack.id and t.not_before is None for t in trials)
        assert s.get(Task, task_id).state == states.TASK_RUNNING  # type: ignore[union-attr]


def test_a_trial_whose_worker_keeps_being_lost_fails_at_the_loss_bound_saying_so(daemon: SchedulerDaemon) -> None:
    """No attempt is spent on a worker's loss, yet a trial that loses every worker it runs on (one that crashes them)
    does not loop for ever: at MAX_TRIAL_WORKER_LOSSES it fails, and its error says why. (Quarantine and backoff off
    here: they only slow the loop down.)"""
    daemon.faults = replace(daemon.faults, requeue_backoff_s=0, quarantine_s=0)
    task_id, _ = make_task(1)
    for _loss in range(states.MAX_TRIAL_WORKER_LOSSES):
        heartbeat()
        daemon.step(block_s=0.2)
        with session_scope() as s:
            assert s.scalars(select(Trial)).one().state == states.TRIAL_RUNNING
            s.get(Worker, WORKER).last_heartbeat = utcnow() - timedelta(hours=1)  # type: ignore[union-attr]
        daemon.tick()
    daemon.tick()
    with session_scope() as s:
        trial = s.scalars(select(Trial)).one()
        assert (trial.state, trial.attempts, trial.worker_losses) == (
            states.TRIAL_FAILED, 0, states.MAX_TRIAL_WORKER_LOSSES)
        assert f"its worker was lost {states.MAX_TRIAL_WORKER_LOSSES} times" in (trial.error or "")
        assert s.get(Task, task_id).state == states.TASK_FAILED  # type: ignore[union-attr]


def test_a_trials_own_failure_spends_an_attempt_and_it_fails_at_the_limit(daemon: SchedulerDaemon) -> None:
    """A failure the worker reports as the trial's (an exception in its step, its data, its OOM) spends one attempt:
    it is tried again (from its checkpoint) until MAX_TRIAL_ATTEMPTS are spent, then it fails with its error."""
    task_id, (trial_id,) = make_task(1)
    heartbeat()
    daemon.step(block_s=0.2)
    for attempt in range(1, states.MAX_TRIAL_ATTEMPTS + 1):
        pack = live_pack()
        with session_scope() as s:
            assert s.get_one(Trial, trial_id).attempts == attempt
        report("pack.started", pack_id=pack.id)
        report("trial.finished", pack_id=pack.id, trial_id=trial_id, status="failed", steps_done=1,
               error="OutOfMemoryError: CUDA out of memory")
        report("pack.finished", pack_id=pack.id)
        daemon.step(block_s=0.2)  # back to pending, and planned again in the same round: no backoff
    daemon.tick()
    with session_scope() as s:
        trial = s.get_one(Trial, trial_id)
        assert (trial.state, trial.attempts, trial.worker_losses) == (
            states.TRIAL_FAILED, states.MAX_TRIAL_ATTEMPTS, 0)
        assert trial.error == "OutOfMemoryError: CUDA out of memory; gave up after 3 attempts"
        assert s.get(Task, task_id).state == states.TASK_FAILED  # type: ignore[union-attr]
        requeued = s.scalars(select(Event).where(Event.type == "trial.requeued").order_by(Event.id)).all()
        assert [e.data["blame"] for e in requeued] == ["trial"] * (states.MAX_TRIAL_ATTEMPTS - 1)
        assert "attempt 1 of 3 spent" in requeued[0].message
        assert not s.get_one(Worker, WORKER).lost_packs  # the packs ended well: nothing against the worker


def test_a_pack_recorded_but_not_sent_before_a_crash_is_sent_by_the_next_scheduler(
    daemon: SchedulerDaemon,
) -> None:
    _, trial_ids = make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    with session_scope() as s:  # as if the scheduler died between recording the pack and sending it
        s.get(Pack, pack.id).state = states.PACK_PLANNED  # type: ignore[union-attr]
    redis.Redis.from_url(REDIS_URL).delete(worker_queue(get_settings(), WORKER))
    restarted = SchedulerDaemon(get_settings(), get_bus(), get_celery(), consumer="test")
    restarted.tick()
    assert live_pack().state == states.PACK_DISPATCHED and queued_messages() == 1
    restarted.tick()
    assert queued_messages() == 1  # not sent twice


def test_a_pack_that_fails_as_a_whole_requeues_its_trials_and_charges_its_worker(daemon: SchedulerDaemon) -> None:
    """`pack.failed` (its model would not load, the store could not be read): no trial's doing, as every trial of
    the pack ended together. They go back to pending at no attempt's cost, after a backoff, saying why, and the
    pack counts against the worker, as a lost one does."""
    daemon.faults = fault_policy(get_settings())  # the default backoff
    task_id, _ = make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    report("pack.failed", pack_id=pack.id, error="OSError: model not found")
    daemon.step(block_s=0.2)
    daemon.tick()
    with session_scope() as s:
        trials = s.scalars(select(Trial)).all()
        assert {(t.state, t.attempts, t.worker_losses) for t in trials} == {(states.TRIAL_PENDING, 0, 1)}
        assert s.get_one(Task, task_id).state in (states.TASK_QUEUED, states.TASK_RUNNING)  # not failed
        events = s.scalars(select(Event).where(Event.type == "trial.requeued")).all()
        assert len(events) == 2 and all("OSError: model not found" in e.message for e in events)
        assert all(e.data["blame"] == "worker" for e in events)
        worker = s.get_one(Worker, WORKER)
        assert len(worker.lost_packs or []) == 1 and worker.current_pack_id is None


def test_cancelling_a_running_task_sends_a_stop_command_once(daemon: SchedulerDaemon) -> None:
    task_id, trial_ids = make_task(2)
    bus = get_bus()
    tail = bus.tail_id(commands_stream(WORKER))
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    with session_scope() as s:  # what POST /v1/tasks/{id}/cancel does
        s.get(Task, task_id).state = states.TASK_CANCELLED  # type: ignore[union-attr]
        for t in s.scalars(select(Trial)):
            t.state, t.finished_at = states.TRIAL_CANCELLED, utcnow()
    daemon.tick()
    daemon.tick()
    commands = [m for _, m in bus.read_after(commands_stream(WORKER), tail, count=10, block_s=0.1)]
    assert len(commands) == 1
    assert commands[0]["type"] == "stop_trials" and commands[0]["pack_id"] == pack.id
    assert sorted(commands[0]["trial_ids"]) == sorted(trial_ids)


def test_a_requeued_trial_resumes_from_its_checkpoint_with_its_curve_cut_back(daemon: SchedulerDaemon) -> None:
    _, trial_ids = make_task(1)
    trial_id = trial_ids[0]
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    report("points", pack_id=pack.id, points=[[trial_id, s, "train", 3.0 - s / 10] for s in range(1, 6)]
           + [[trial_id, 2, "val", 2.5], [trial_id, 4, "val", 2.4]])
    report("trial.checkpoint", pack_id=pack.id, trial_id=trial_id, step=4, checkpoint_key="checkpoints/t/x.tar")
    report("trial.checkpoint", pack_id=pack.id, trial_id=trial_id, step=2, checkpoint_key="old")  # late: ignored
    daemon.step(block_s=0.2)
    with session_scope() as s:
        s.get(Worker, WORKER).last_heartbeat = utcnow() - timedelta(hours=1)  # type: ignore[union-attr]
    daemon.tick()
    with session_scope() as s:
        trial = s.get(Trial, trial_id)
        assert trial is not None and trial.state == states.TRIAL_PENDING
        assert (trial.steps_done, trial.checkpoint_step, trial.checkpoint_key) == (4, 4, "checkpoints/t/x.tar")
        assert (trial.best_val_loss, trial.best_step, trial.last_train_loss) == (2.4, 4, 2.6)
        steps = sorted((p.split, p.step) for p in s.scalars(select(MetricPoint)))
        assert steps == [("train", 1), ("train", 2), ("train", 3), ("train", 4), ("val", 2), ("val", 4)]
        requeued = s.scalars(select(Event).where(Event.type == "trial.requeued")).one()
        assert "from its checkpoint at step 4" in requeued.message
    heartbeat()
    daemon.step(block_s=0.2)
    from scheduler.service.dispatch import pack_message

    with session_scope() as s:
        message = pack_message(s, s.get(Pack, live_pack().id))  # type: ignore[arg-type]
    assert (message.trials[0].resume_key, message.trials[0].resume_step) == ("checkpoints/t/x.tar", 4)


def test_a_pack_profile_is_stored_for_the_cost_model(daemon: SchedulerDaemon) -> None:
    make_task(1)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    profile = {"device": "cpu", "steps": 3, "tokens_per_s": 100.0, "samples": [[64, 0.5, None]]}
    report("pack.profile", pack_id=pack.id, profile=profile)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get(Pack, pack.id).profile == profile  # type: ignore[union-attr]


def test_profiles_fit_the_cost_model_that_predicts_when_a_busy_worker_frees(daemon: SchedulerDaemon) -> None:
    from scheduler.service.planner_io import busy_workers, load_costs

    make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    # Step time 0.5 s + 1 ms per pooled token + 0 per slot, measured at three token counts.
    samples = [[2, n, 0, 0.5 + 0.001 * n, 10**9 + 1000 * n] for n in (100, 200, 400)]
    report("pack.profile", pack_id=pack.id, profile={"device": "cpu", "samples": samples})
    daemon.step(block_s=0.2)
    with session_scope() as s:
        for trial in s.scalars(select(Trial)):
            trial.steps_done = 1  # of total_steps 4
        s.flush()
        costs = load_costs(s)
        step = costs["tiny-random-llama"].step
        # Every sample had 2 slots, so the per-slot cost is the prior and the intercept takes the rest.
        assert step.predict(100, 2) == pytest.approx(0.6) and step.b_s_per_token == pytest.approx(0.001, rel=1e-3)
        (busy,) = busy_workers(s, utcnow(), 60.0, costs)
        # Two trials of batch 2 x max_seq_len 64 = 256 pooled tokens: 3 steps left at 0.5 + 0.256 + 2c s.
        assert busy.worker_id == WORKER
        assert busy.busy_for_s == pytest.approx(3 * step.predict(256, 2))
        assert busy.busy_for_s == pytest.approx(3 * 0.756, rel=1e-2)


def test_a_running_packs_measured_step_time_corrects_the_predictions_online(daemon: SchedulerDaemon) -> None:
    from scheduler.service.planner_io import busy_workers, load_costs

    make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    samples = [[2, n, 0, 0.5 + 0.001 * n, 10**9 + 1000 * n] for n in (100, 200, 400)]
    report("pack.profile", pack_id=pack.id, profile={"device": "cpu", "samples": samples})
    report("pack.started", pack_id=pack.id)
    # The pack now runs three times slower than its profile says (another process took the GPU, say).
    report("pack.progress", pack_id=pack.id, steps=20, step_s=2.1, tokens=200.0, slots=2.0)
    report("pack.progress", pack_id=pack.id, steps=20, step_s=-1.0, tokens=200.0, slots=2.0)  # dropped
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Pack, pack.id).progress == {"steps": 20, "step_s": 2.1, "tokens": 200.0, "slots": 2.0}
        for trial in s.scalars(select(Trial)):
            trial.steps_done = 1  # of total_steps 4
        s.flush()
        costs = load_costs(s)
        # The model-wide correction: every prediction for this base model is 3x the fitted one.
        assert costs["tiny-random-llama"].step.predict(200, 2) == pytest.approx(2.1)
        (busy,) = busy_workers(s, utcnow(), 60.0, costs)
        # Same two members as when it measured: 3 steps left at its own measured 2.1 s.
        assert busy.busy_for_s == pytest.approx(3 * 2.1)


def test_a_malformed_profile_is_ignored_by_the_cost_fit(daemon: SchedulerDaemon) -> None:
    from scheduler.service.planner_io import load_costs

    make_task(1)
    heartbeat()
    daemon.step(block_s=0.2)
    report("pack.profile", pack_id=live_pack().id, profile={"device": "cpu", "samples": [[64, 0.5, None]]})
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert load_costs(s)["tiny-random-llama"] == prior_cost(TINY_PARAMETERS)  # nothing fitted: its priors


def test_a_model_no_pack_profiled_gets_the_priors_for_its_size_corrected_online(daemon: SchedulerDaemon) -> None:
    from scheduler.service.planner_io import load_costs

    with session_scope() as s:
        assert load_costs(s) == {m.name: prior_cost(m.parameters) for m in DEFAULT_MODELS}
        assert all(cost.prior for cost in load_costs(s).values())
    make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    measured = 2 * PRIOR_COST.step.predict(200, 2)  # twice as slow as the prior says
    report("pack.started", pack_id=pack.id)
    report("pack.progress", pack_id=pack.id, steps=20, step_s=measured, tokens=200.0, slots=2.0)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        cost = load_costs(s)["tiny-random-llama"]
    # Its memory stays the prior for its size; its step time is measured now, so the planner no longer treats it
    # as the priors (rules.fill_now).
    assert cost.memory == prior_cost(TINY_PARAMETERS).memory and not cost.prior
    assert cost.step.predict(200, 2) == pytest.approx(measured)


def test_two_schedulers_ticking_at_once_place_and_send_each_pack_once(daemon: SchedulerDaemon) -> None:
    """The leader lock keeps a second scheduler idle; should two ever act at once (a lock lost in a network
    split), row locks still make each trial join one pack and each pack go out once."""
    import threading

    for i in range(4):
        make_task(3, cap=3)
        report("heartbeat", queue=worker_queue(get_settings(), f"{WORKER}-{i}"), device="cpu", max_slots=8,
               worker_id=f"{WORKER}-{i}")
    daemon.step(block_s=0.2)  # ingest the heartbeats only: no worker was known when the trials were read
    with session_scope() as s:
        for p in s.scalars(select(Pack)):  # forget what that first round planned: both schedulers race on it
            s.delete(p)
        for t in s.scalars(select(Trial)):
            t.state, t.pack_id, t.attempts = states.TRIAL_PENDING, None, 0
    for i in range(4):
        redis.Redis.from_url(REDIS_URL).delete(worker_queue(get_settings(), f"{WORKER}-{i}"))
    other = SchedulerDaemon(get_settings(), get_bus(), get_celery(), consumer="test-2")
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def rounds(d: SchedulerDaemon) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                d.tick()
        except BaseException as exc:  # surfaced below: a thread's exception would otherwise be lost
            errors.append(exc)

    threads = [threading.Thread(target=rounds, args=(d,)) for d in (daemon, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    with session_scope() as s:
        packs = list(s.scalars(select(Pack)))
        members = [t for p in packs for t in p.trial_ids]
        assert sorted(members) == sorted(t.id for t in s.scalars(select(Trial)))  # each trial in one pack
        assert all(t.attempts == 1 for t in s.scalars(select(Trial)))
        sent = sum(int(redis.Redis.from_url(REDIS_URL).llen(worker_queue(get_settings(), f"{WORKER}-{i}")))
                   for i in range(4))
        assert sent == len(packs)  # each pack sent once


def commands_tail() -> str:
    """Where the worker's command stream ends now (tests read only what they cause after it)."""
    return get_bus().tail_id(commands_stream(WORKER))


def commands(kind: str, after: str) -> list[dict[str, object]]:
    return [m for _, m in get_bus().read_after(commands_stream(WORKER), after, count=100, block_s=0)
            if m.get("type") == kind]


def set_rank(trial_id: str, rank: int) -> None:
    with session_scope() as s:
        trial = s.get_one(Trial, trial_id)
        trial.hyperparameters = {**trial.hyperparameters, "lora_rank": rank}


def test_a_trial_that_arrives_while_a_pack_runs_is_back_filled_into_its_free_slot(daemon: SchedulerDaemon) -> None:
    start = commands_tail()
    _, first = make_task(2, cap=4)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    # Shaped for back-fills: the worker's slots capped by the task's, rank and layers of what may join.
    assert (pack.capacity, pack.max_rank, pack.target_modules) == (4, 4, ["q_proj"])
    report("pack.started", pack_id=pack.id)
    daemon.step(block_s=0.2)

    _, late = make_task(3, cap=4)
    set_rank(late[2], 16)  # above the pack's rank padding: it cannot join, it waits for a pack of its own
    daemon.step(block_s=0.05)
    with session_scope() as s:
        joined = [s.get_one(Trial, t) for t in late[:2]]
        assert all(t.state == states.TRIAL_RUNNING and t.pack_id == pack.id and t.awaiting_admission for t in joined)
        assert s.get_one(Trial, late[2]).state == states.TRIAL_PENDING
        assert sorted(s.get_one(Pack, pack.id).trial_ids) == sorted(first + late[:2])
        backfill_events = [e for e in s.scalars(select(Event).where(Event.type == "trial.running"))
                           if e.data.get("backfill")]
        assert sorted(e.trial_id for e in backfill_events) == sorted(late[:2])
    (command,) = commands("admit_trials", start)
    assert command["pack_id"] == pack.id
    assert sorted(t["trial_id"] for t in command["trials"]) == sorted(late[:2])  # type: ignore[union-attr]
    assert queued_messages() == 1  # no new pack was sent: the first one's
    daemon.step(block_s=0.05)
    assert len(commands("admit_trials", start)) == 1  # sent once

    # The worker takes one; the other finds the pack ending first and comes back at no cost.
    report("trial.admitted", pack_id=pack.id, trial_id=late[0])
    report("trial.rejected", pack_id=pack.id, trial_id=late[1], reason="the pack ended before it could join")
    daemon.step(block_s=0.2)
    with session_scope() as s:
        admitted, refused = s.get_one(Trial, late[0]), s.get_one(Trial, late[1])
        assert admitted.state == states.TRIAL_RUNNING and not admitted.awaiting_admission
        # Pending again, its attempt refunded, and not sent back to the ending pack (nor anywhere: no worker).
        assert (refused.state, refused.attempts, refused.pack_id) == (states.TRIAL_PENDING, 0, None)
        assert s.get_one(Pack, pack.id).capacity is None


def test_a_back_fill_the_pack_never_took_goes_back_to_pending_when_the_pack_ends(daemon: SchedulerDaemon) -> None:
    make_task(1, cap=2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    daemon.step(block_s=0.2)
    _, (late,) = make_task(1, cap=2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        assert s.get_one(Trial, late).awaiting_admission
    # A worker that could not admit it (say its data would not load) counts the attempt; the free slot is
    # still there, so the next plan sends it back to the same pack.
    report("trial.rejected", pack_id=pack.id, trial_id=late, reason="ValueError: no training row")
    daemon.step(block_s=0.2)
    with session_scope() as s:
        again = s.get_one(Trial, late)
        assert (again.state, again.pack_id, again.awaiting_admission, again.attempts) == (
            states.TRIAL_RUNNING, pack.id, True, 2)
    # The pack ends before taking it: back to pending with that attempt refunded, never failed; the freed
    # worker then takes it in a pack of its own.
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        trial = s.get_one(Trial, late)
        assert trial.pack_id != pack.id and trial.state == states.TRIAL_RUNNING and not trial.awaiting_admission
        assert trial.attempts == 2  # the rejected try, and this one; the never-admitted one was refunded
        kinds = [e.type for e in s.scalars(select(Event).where(Event.trial_id == late).order_by(Event.id))]
        assert kinds.count("trial.requeued") == 2 and "trial.failed" not in kinds


def curve(pack_id: str, trial_id: str, train: list[float], val: dict[int, float]) -> None:
    """A worker's reports: train losses for steps 1.., validation losses at the given steps."""
    points: list[list[object]] = [[trial_id, i + 1, "train", loss] for i, loss in enumerate(train)]
    points += [[trial_id, step, "val", loss] for step, loss in val.items()]
    report("points", pack_id=pack_id, points=points)


def test_alto_keeps_the_best_quarter_at_the_warm_up_boundary_and_stops_the_rest(daemon: SchedulerDaemon) -> None:
    start = commands_tail()
    # ALTO's own single cut to a quarter; warm-up ends at step 2.
    task_id, trials = make_task(4, early_exit={"policy": "alto", "rungs": 1, "keep_ratio": 0.25}, steps=40)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    for i, trial_id in enumerate(trials):
        curve(pack.id, trial_id, [3.0, 2.9 - i / 10], {2: 2.0 + i})
    daemon.step(block_s=0.2)
    with session_scope() as s:
        got = {t.id: (t.state, t.stop_reason) for t in s.scalars(select(Trial))}
        assert got[trials[0]] == (states.TRIAL_RUNNING, None)
        assert all(got[t] == (states.TRIAL_STOPPED_EARLY, "underperforming") for t in trials[1:])
        events = list(s.scalars(select(Event).where(Event.type == "trial.stopped_early")))
        assert sorted(e.trial_id for e in events) == sorted(trials[1:])
        worst = next(e for e in events if e.trial_id == trials[3])
        assert (worst.data["reason"], worst.data["rank"], worst.data["keep"]) == ("underperforming", 4, 1)
        assert "underperforming" in worst.message and "ranks 4 of 4" in worst.message
    (command,) = commands("stop_trials", start)  # the three are taken out of the running pack, nothing exported
    assert command["mode"] == "drop" and sorted(command["trial_ids"]) == sorted(trials[1:])  # type: ignore[arg-type]
    daemon.step(block_s=0.05)
    assert len(commands("stop_trials", start)) == 1
    # The pack message asked each trial to validate exactly at its warm-up step.
    from scheduler.service.dispatch import pack_message
    with session_scope() as s:
        message = pack_message(s, s.get_one(Pack, pack.id))
        assert {t.extra_eval_steps[0] for t in message.trials} == {2}
        assert s.get_one(Task, task_id).state == states.TASK_RUNNING


def test_an_overfitting_trial_is_stopped_with_its_best_adapter_which_can_win(daemon: SchedulerDaemon) -> None:
    start = commands_tail()
    # No smoothing (ema_alpha 1): the gap is against the raw train loss, so the numbers are easy to follow.
    task_id, (fit, over) = make_task(2, early_exit={"policy": "alto", "keep_ratio": 1.0, "ema_alpha": 1.0}, steps=40)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    # "over"'s validation loss stays far above its train loss two evaluations in a row (gaps 1.0 and 0.5).
    curve(pack.id, fit, [2.0] * 10, {2: 2.2, 6: 2.15, 10: 2.1})
    curve(pack.id, over, [2.0] + [1.0] * 9, {2: 2.0, 6: 1.5, 10: 1.9})
    daemon.step(block_s=0.2)
    with session_scope() as s:
        trial = s.get_one(Trial, over)
        assert (trial.state, trial.stop_reason) == (states.TRIAL_STOPPED_EARLY, "overfitting")
        assert s.get_one(Trial, fit).state == states.TRIAL_RUNNING
    (command,) = commands("stop_trials", start)
    assert (command["mode"], command["trial_ids"]) == ("export", [over])
    # The worker exports its best adapter (val 1.5 at step 6) and says so; the other completes, worse.
    report("trial.finished", pack_id=pack.id, trial_id=over, status="stopped", steps_done=10, best_val_loss=1.5,
           best_step=6, final_train_loss=1.0, adapter_key="adapters/over.tar.gz")
    report("trial.finished", pack_id=pack.id, trial_id=fit, status="completed", steps_done=40, best_val_loss=2.05,
           best_step=40, final_train_loss=2.0, adapter_key="adapters/fit.tar.gz")
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        trial = s.get_one(Trial, over)
        assert (trial.state, trial.adapter_key, trial.best_step) == (
            states.TRIAL_STOPPED_EARLY, "adapters/over.tar.gz", 6)
        task = s.get_one(Task, task_id)
        assert task.state == states.TASK_SUCCEEDED and task.best_trial_id == over
        types = [e.type for e in s.scalars(select(Event).where(Event.trial_id == over).order_by(Event.id))]
        assert types.index("trial.stopped_early") < types.index("trial.adapter_saved") < types.index("task.succeeded")


def test_warm_up_rotation_pauses_the_first_trial_until_the_second_has_warmed_up(daemon: SchedulerDaemon) -> None:
    """One slot for two trials: the first pauses at its boundary (checkpoint, slot freed), the second warms
    up in its place, the ranking keeps the first (it resumes from its checkpoint) and stops the second."""
    start = commands_tail()
    _, (first, second) = make_task(2, cap=1, early_exit={"policy": "alto"}, steps=40)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.trial_ids == [first]
    report("pack.started", pack_id=pack.id)
    curve(pack.id, first, [2.0, 1.8], {2: 1.5})
    daemon.step(block_s=0.2)
    (pause,) = commands("stop_trials", start)
    assert (pause["mode"], pause["trial_ids"]) == ("pause", [first])
    report("trial.checkpoint", pack_id=pack.id, trial_id=first, step=2, checkpoint_key="ckpt/first-2")
    report("trial.finished", pack_id=pack.id, trial_id=first, status="paused", steps_done=2, best_val_loss=1.5,
           best_step=2, final_train_loss=1.8, adapter_key=None)
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        waiting = s.get_one(Trial, first)
        assert (waiting.state, waiting.pack_id, waiting.checkpoint_step, waiting.attempts) == (
            states.TRIAL_WAITING, None, 2, 0)
        assert s.get_one(Trial, second).state == states.TRIAL_RUNNING  # the freed worker took the other
    second_pack = live_pack()
    report("pack.started", pack_id=second_pack.id)
    curve(second_pack.id, second, [2.0, 1.9], {2: 1.7})
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Trial, second).state == states.TRIAL_STOPPED_EARLY
        resumed = s.get_one(Trial, first)
        assert resumed.state in (states.TRIAL_PENDING, states.TRIAL_RUNNING)  # kept: queued to continue
        kinds = [e.type for e in s.scalars(select(Event).where(Event.trial_id == first).order_by(Event.id))]
        assert "trial.waiting" in kinds and "trial.resumed" in kinds and "trial.stopped_early" not in kinds


def test_a_trial_held_with_nothing_pending_pauses_only_when_the_others_are_steps_away_and_rejoins_when_kept(
        daemon: SchedulerDaemon) -> None:
    """All three trials fit in one pack (none pending). The first to reach its boundary pauses when the others
    are still PAUSE_MIN_STEPS or more from theirs (no samples spent past it), not when they are close; once
    the ranking keeps it, it back-fills into the pack it left."""
    start = commands_tail()
    _, (first, second, third) = make_task(3, cap=3, early_exit={"policy": "alto", "keep_ratio": 0.5, "rungs": 1},
                                          steps=200)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert sorted(pack.trial_ids) == sorted([first, second, third]) and pack.capacity == 3
    report("pack.started", pack_id=pack.id)
    # Boundary at step 10 (5% of 200). The others are at steps 6 and 1: 4 and 9 steps to go.
    curve(pack.id, second, [2.0] * 6, {})
    curve(pack.id, third, [2.0], {})
    curve(pack.id, first, [2.0] * 9 + [1.8], {10: 1.5})
    daemon.step(block_s=0.2)
    (pause,) = commands("stop_trials", start)
    assert (pause["mode"], pause["trial_ids"]) == ("pause", [first])
    report("trial.checkpoint", pack_id=pack.id, trial_id=first, step=10, checkpoint_key="ckpt/first-10")
    report("trial.finished", pack_id=pack.id, trial_id=first, status="paused", steps_done=10, best_val_loss=1.5,
           best_step=10, final_train_loss=1.8, adapter_key=None)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Trial, first).state == states.TRIAL_WAITING
    # The second reaches its boundary while the third is 2 steps from its own: it is held but trains on.
    curve(pack.id, second, [2.0] * 9 + [1.9], {10: 1.7})
    curve(pack.id, third, [2.0] * 8, {})
    daemon.step(block_s=0.2)
    assert len(commands("stop_trials", start)) == 1
    with session_scope() as s:
        assert s.get_one(Trial, second).state == states.TRIAL_RUNNING
    # Ranked at their boundaries: first 1.5, third 1.6 kept (ceil(0.5 x 3) = 2), second 1.7 stopped.
    curve(pack.id, third, [2.0] * 9 + [1.9], {10: 1.6})
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        assert s.get_one(Trial, second).state == states.TRIAL_STOPPED_EARLY
        assert s.get_one(Trial, third).state == states.TRIAL_RUNNING
        back = s.get_one(Trial, first)
        assert (back.state, back.pack_id, back.awaiting_admission) == (states.TRIAL_RUNNING, pack.id, True)
    (admit,) = commands("admit_trials", start)
    assert admit["pack_id"] == pack.id
    assert [t["trial_id"] for t in admit["trials"]] == [first]  # type: ignore[union-attr]


def test_should_pause_frees_the_slot_for_pending_trials_or_a_long_wait_only() -> None:
    assert should_pause(True, []) and should_pause(True, [1])  # rotation: the pending need the slot
    assert should_pause(False, [1, PAUSE_MIN_STEPS])
    assert not should_pause(False, [PAUSE_MIN_STEPS - 1, 0]) and not should_pause(False, [])


def test_the_pack_message_asks_each_trial_to_validate_at_its_policys_rungs(daemon: SchedulerDaemon) -> None:
    """alto: at each warm-up rung of the trial's own steps; ASHA: where the trial reaches each token rung (its
    next regular validation may be far past it). The task's token budget R: 64 steps x 2 rows x 64 tokens."""
    from scheduler.service.dispatch import eval_steps

    _, alto_trials = make_task(2, early_exit={"policy": "alto"}, steps=100)
    _, asha_trials = make_task(2, early_exit={"policy": "asha", "reduction_factor": 4, "num_rungs": 3}, steps=64)
    with session_scope() as s:
        alto, asha = (s.get_one(Trial, trials[0]) for trials in (alto_trials, asha_trials))
        assert eval_steps(s.get_one(Task, alto.task_id), alto) == [5, 10]
        # Rungs at R/64, R/16, R/4 tokens = 1, 4 and 16 steps of 128 tokens.
        assert eval_steps(s.get_one(Task, asha.task_id), asha) == [1, 4, 16]


def test_a_trial_that_overfits_while_it_waits_is_placed_again_to_export_its_best_adapter(
        daemon: SchedulerDaemon) -> None:
    """The reports of a trial paused at its warm-up boundary can carry the points that show it overfitting, so
    the stop comes while it waits in its checkpoint, where no worker holds its best adapter. It is placed again
    and, as soon as its pack starts, stopped with its best adapter exported (not dropped without one)."""
    start = commands_tail()
    _, (first, second) = make_task(2, cap=1, early_exit={"policy": "alto", "rungs": 1, "keep_ratio": 1.0,
                                                         "ema_alpha": 1.0}, steps=40)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    curve(pack.id, first, [2.0, 1.8], {2: 1.5})
    daemon.step(block_s=0.2)
    (pause,) = commands("stop_trials", start)
    assert (pause["mode"], pause["trial_ids"]) == ("pause", [first])
    # It trained on to step 6 before the pause reached it: val far above train at steps 4 and 6 (gaps 2.0).
    late = [[first, s, "train", 1.0] for s in range(3, 7)] + [[first, 4, "val", 3.0], [first, 6, "val", 3.0]]
    report("trial.checkpoint", pack_id=pack.id, trial_id=first, step=6, checkpoint_key="ckpt/first-6")
    report("trial.finished", pack_id=pack.id, trial_id=first, status="paused", steps_done=6, best_val_loss=1.5,
           best_step=2, final_train_loss=1.0, adapter_key=None, points=late)
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        trial = s.get_one(Trial, first)
        assert trial.state in (states.TRIAL_PENDING, states.TRIAL_RUNNING) and trial.stop_reason is None
        resumed = s.scalars(select(Event).where(Event.trial_id == first, Event.type == "trial.resumed")).one()
        assert resumed.data["to_export"] is True and resumed.data["reason"] == "overfitting"
    daemon.step(block_s=0.2)
    again = live_pack()
    assert first in again.trial_ids
    start = commands_tail()
    report("pack.started", pack_id=again.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        trial = s.get_one(Trial, first)
        assert (trial.state, trial.stop_reason) == (states.TRIAL_STOPPED_EARLY, "overfitting")
    (command,) = commands("stop_trials", start)
    assert (command["mode"], command["trial_ids"]) == ("export", [first])


# ---- the task's own metric (issue 17): "metric" points, metric_score, the best trial by score ----------------------


def exact_match(max_new_tokens: int = 32) -> dict[str, object]:
    return {"metric": "exact_match", "max_new_tokens": max_new_tokens, "pattern": None}


@pytest.mark.parametrize(("evaluation", "winner"), [(exact_match(), 0), (None, 1),
                                                    ({"metric": "loss", "max_new_tokens": 32, "pattern": None}, 1)])
def test_metric_points_set_the_score_and_a_generative_metric_picks_the_highest(
        daemon: SchedulerDaemon, evaluation: dict[str, object] | None, winner: int) -> None:
    """Trial 0 answers better (0.75 against 0.25) with a worse validation loss (1.0 against 0.5): it wins when
    the task is judged by exact_match, and trial 1 wins by loss. The score is the "metric" point of the highest
    step (a later one replaces an earlier; a replayed one changes nothing), sent in a "points" message and
    repeated in the trial's "trial.finished"."""
    task_id, trials = make_task(2, evaluation=evaluation)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    scores, losses = (0.75, 0.25), (1.0, 0.5)
    for trial_id, score, loss in zip(trials, scores, losses, strict=True):
        curve(pack.id, trial_id, [2.0, 1.5, 1.2, 1.1], {2: loss + 0.1, 4: loss})
        report("points", pack_id=pack.id, points=[[trial_id, 2, "metric", 0.0], [trial_id, 4, "metric", score]])
        report("points", pack_id=pack.id, points=[[trial_id, 2, "metric", 0.5]])  # replayed, older: no change
        report("trial.finished", pack_id=pack.id, trial_id=trial_id, status="completed", steps_done=4,
               best_val_loss=loss, best_step=4, final_train_loss=1.1, adapter_key=f"adapters/{trial_id}.tar.gz",
               points=[[trial_id, 4, "metric", score]])
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        got = {t.id: t.metric_score for t in s.scalars(select(Trial))}
        assert got == dict(zip(trials, scores, strict=True))
        stored = sorted((p.trial_id, p.step, p.loss) for p in s.scalars(
            select(MetricPoint).where(MetricPoint.split == "metric")))
        assert stored == sorted([(t, 2, 0.0) for t in trials] + list(zip(trials, (4, 4), scores, strict=True)))
        # Not validation points: best_val_loss comes from the val points only.
        assert {t.id: t.best_val_loss for t in s.scalars(select(Trial))} == dict(zip(trials, losses, strict=True))
        task = s.get_one(Task, task_id)
        assert task.state == states.TASK_SUCCEEDED and task.best_trial_id == trials[winner]
        succeeded = s.scalars(select(Event).where(Event.type == "task.succeeded")).one()
        if evaluation and evaluation["metric"] == "exact_match":
            assert succeeded.data["metric_score"] == 0.75 and "exact_match 0.750" in succeeded.message
        else:
            assert "metric_score" not in succeeded.data


def test_the_pack_message_carries_the_tasks_evaluation(daemon: SchedulerDaemon) -> None:
    from scheduler.service.dispatch import pack_message, trial_payload

    evaluation = {"metric": "regex", "max_new_tokens": 8, "pattern": r"\d+"}
    _, (scored,) = make_task(1, evaluation=evaluation)
    _, (old,) = make_task(1)  # a task stored before evaluation existed
    heartbeat()
    daemon.step(block_s=0.2)
    with session_scope() as s:
        pack = s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).one()
        sent = {t.trial_id: t.evaluation for t in pack_message(s, pack).trials}
        assert sent.get(scored, evaluation) == evaluation and sent.get(old) is None
        payloads = {}
        for trial_id in (scored, old):
            trial = s.get_one(Trial, trial_id)
            payloads[trial_id] = trial_payload(trial, s.get_one(Task, trial.task_id)).evaluation
    assert payloads == {scored: evaluation, old: None}


def test_an_overfitting_trial_scored_as_its_adapter_is_exported_can_win_by_its_metric(
        daemon: SchedulerDaemon) -> None:
    """A trial stopped early for overfitting is scored with its exported best adapter: its "metric" point comes
    with the trial.finished that reports the export (the trial is no longer running), and counts. Early exit,
    which decides again on that report, reads the train and val points only."""
    task_id, (fit, over) = make_task(2, early_exit={"policy": "alto", "keep_ratio": 1.0, "ema_alpha": 1.0},
                                     steps=40, evaluation={"metric": "contains", "max_new_tokens": 16,
                                                           "pattern": None})
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    curve(pack.id, fit, [2.0] * 10, {2: 2.2, 6: 2.15, 10: 2.1})
    curve(pack.id, over, [2.0] + [1.0] * 9, {2: 2.0, 6: 1.5, 10: 1.9})
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Trial, over).state == states.TRIAL_STOPPED_EARLY
    report("trial.finished", pack_id=pack.id, trial_id=over, status="stopped", steps_done=10, best_val_loss=1.5,
           best_step=6, final_train_loss=1.0, adapter_key="adapters/over.tar.gz", points=[[over, 10, "metric", 0.9]])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Trial, over).metric_score == 0.9
        assert s.get_one(Trial, fit).state == states.TRIAL_RUNNING
    # The other trial trains on to a better validation loss than "over" had, but answers worse.
    curve(pack.id, fit, [1.0] * 40, {20: 1.2, 40: 1.1})
    report("trial.finished", pack_id=pack.id, trial_id=fit, status="completed", steps_done=40, best_val_loss=1.1,
           best_step=40, final_train_loss=1.0, adapter_key="adapters/fit.tar.gz", points=[[fit, 40, "metric", 0.4]])
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        assert s.get_one(Trial, fit).metric_score == 0.4
        task = s.get_one(Task, task_id)
        assert task.state == states.TASK_SUCCEEDED and task.best_trial_id == over


def test_a_metric_point_from_another_pack_or_out_of_range_is_dropped(daemon: SchedulerDaemon) -> None:
    _, (trial_id,) = make_task(1, evaluation=exact_match())
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    report("points", pack_id="pack-other", points=[[trial_id, 4, "metric", 1.0]])
    report("points", pack_id=pack.id, points=[[trial_id, 2, "metric", 1.5], [trial_id, 3, "metric", float("nan")],
                                              [trial_id, 1, "metric", 0.5]])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Trial, trial_id).metric_score == 0.5
        assert [(p.step, p.loss) for p in s.scalars(select(MetricPoint))] == [(1, 0.5)]


def test_the_winner_is_the_trial_whose_smoothed_curve_is_lowest_not_the_one_lucky_dip(daemon: SchedulerDaemon) -> None:
    """Issue 33: on a small validation split one evaluation is noisy. Trial 0 dipped once to 0.8 and came back;
    trial 1 stayed near 0.9. By lowest point trial 0 would win; by the smoothed curve (common.metrics.
    selection_loss), which the scheduler keeps from the stored points, trial 1 does."""
    task_id, trial_ids = make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    curves = {trial_ids[0]: [2.0, 1.2, 0.8, 1.25, 1.3], trial_ids[1]: [2.0, 1.0, 0.95, 0.9, 0.92]}
    for trial_id, curve in curves.items():
        points = [[trial_id, 2 * (i + 1), "val", loss] for i, loss in enumerate(curve)]
        report("points", pack_id=pack.id, points=points[:3])
        report("points", pack_id=pack.id, points=points)  # the first three again: stored, and counted, once
    daemon.step(block_s=0.2)
    with session_scope() as s:
        stored = {t.id: (t.best_val_loss, t.selection_loss) for t in s.scalars(select(Trial))}
    assert stored[trial_ids[0]] == (0.8, pytest.approx(1.2))
    assert stored[trial_ids[1]] == (0.9, pytest.approx(0.99125))
    for trial_id, curve in curves.items():
        best = min(curve)
        report("trial.finished", pack_id=pack.id, trial_id=trial_id, status="completed", steps_done=10,
               best_val_loss=best, best_step=2 * (curve.index(best) + 1), final_train_loss=1.0,
               adapter_key=f"adapters/{trial_id}.tar.gz")
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        task = s.get_one(Task, task_id)
        assert task.state == states.TASK_SUCCEEDED and task.best_trial_id == trial_ids[1]
        succeeded = s.scalars(select(Event).where(Event.type == "task.succeeded")).one()
        assert succeeded.data["selection_loss"] == pytest.approx(0.99125)


def test_the_best_trial_is_ranked_by_the_tasks_metric() -> None:
    from scheduler.service.task_results import best_trial

    def trial(index: int, score: float | None, val: float | None) -> Trial:
        return Trial(id=f"t{index}", index=index, metric_score=score, best_val_loss=val, last_train_loss=2.0)

    trials = [trial(0, 0.5, 1.0), trial(1, 0.5, 0.9), trial(2, None, 0.1), trial(3, 0.25, 0.2)]
    assert best_trial("exact_match", trials).id == "t1"  # the highest score, then the lower validation loss
    assert best_trial("loss", trials).id == "t2"
    assert best_trial("json_valid", [trials[2], trial(4, None, 0.05)]).id == "t4"  # none scored: by loss


def test_each_stay_of_a_trial_in_a_pack_is_counted_once_for_usage(daemon: SchedulerDaemon) -> None:
    """Issue 18: `trial.finished` carries what the trial trained in its pack; a replayed report is counted once, and
    a trial paused and finished in the same pack leaves two stays. A report without the fields (an older worker)
    counts nothing."""
    from common.tables import TrialUsage

    _, trial_ids = make_task(2)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    first, second = trial_ids
    paused = dict(pack_id=pack.id, trial_id=first, status="paused", steps_done=2, pack_steps=2, pack_tokens=120)
    report("trial.finished", **paused)
    report("trial.finished", **paused)  # replayed
    report("trial.finished", pack_id=pack.id, trial_id=first, status="completed", steps_done=5, pack_steps=3,
           pack_tokens=200, best_val_loss=1.0, best_step=5, final_train_loss=1.1, adapter_key=f"adapters/{first}")
    report("trial.finished", pack_id=pack.id, trial_id=second, status="completed", steps_done=5, best_val_loss=1.0,
           best_step=5, final_train_loss=1.1, adapter_key=f"adapters/{second}")
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        stays = [(u.trial_id, u.end_step, u.steps, u.tokens) for u in s.scalars(select(TrialUsage).order_by(
            TrialUsage.end_step))]
    assert stays == [(first, 2, 2, 120), (first, 5, 3, 200)]


def test_a_stopped_daemon_gives_its_leader_lock_back(daemon: SchedulerDaemon) -> None:
    """The advisory lock belongs to the database session, which the engine's pool keeps open after `close()`: a
    daemon that stops must unlock, or every other scheduler of the database stands by for as long as the pooled
    connection lives (a standby scheduler process waited 3 minutes behind a test's stopped daemon)."""
    import threading

    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from common.db import get_engine
    from scheduler.service.daemon import LEADER_LOCK_ID
    from tests.e2e.flow import wait_for

    other = create_engine(get_engine().url, poolclass=NullPool)  # another database session, as another process has

    def lock_is_free() -> bool:
        with other.connect() as conn:
            if conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK_ID}).scalar():
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LEADER_LOCK_ID})
                return True
            return False

    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: not lock_is_free(), 15, "the daemon to take the leader lock")
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
    assert lock_is_free()


def finish(pack_id: str, trial_id: str, *, val: list[float], steps: int) -> None:
    """The worker's reports of a trial that validated ``val`` at steps 2, 4, ... and completed after ``steps``."""
    report("points", pack_id=pack_id, points=[[trial_id, 2 * (i + 1), "val", v] for i, v in enumerate(val)])
    best = min(val) if val else None
    report("trial.finished", pack_id=pack_id, trial_id=trial_id, status="completed", steps_done=steps,
           best_val_loss=best, best_step=2 * (val.index(best) + 1) if val else steps, final_train_loss=1.0,
           adapter_key=f"adapters/{trial_id}.tar.gz")


REFIT = {"refit": True, "training_rows": 8, "validation_rows": 2}


@pytest.mark.parametrize("policy", ["none", "alto"])
def test_a_refit_trains_the_winners_configuration_on_both_splits_and_the_task_ends_with_it(
        daemon: SchedulerDaemon, policy: str) -> None:
    """Issue 33: with "refit": true the search's winner is chosen as before; then a trial of its configuration (and
    seed) trains on the 8 training and 2 validation rows for the passes its adapter made (best at step 4 of 8 rows:
    round(4 x 10 / 8) = 5 steps), is sent without validation, metric or early-exit rungs, is not ranked (it has no
    validation loss), and the task succeeds once it ends, naming both."""
    from scheduler.service.dispatch import pack_message

    task_id, trial_ids = make_task(2, steps=8, spec=REFIT, evaluation={"metric": "exact_match", "max_new_tokens": 4},
                                   early_exit={"policy": policy})
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    finish(pack.id, trial_ids[0], val=[1.2, 1.1, 1.15, 1.2], steps=8)
    finish(pack.id, trial_ids[1], val=[1.0, 0.9, 0.95, 1.0], steps=8)  # best at step 4: the winner
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        task = s.get_one(Task, task_id)
        winner = s.get_one(Trial, trial_ids[1])
        assert task.state == states.TASK_RUNNING and task.best_trial_id == winner.id
        refit = s.get_one(Trial, task.refit_trial_id)
        assert (refit.refit_of, refit.index, refit.total_steps) == (winner.id, 2, 5)
        assert refit.hyperparameters == winner.hyperparameters  # its seed too
        started = s.scalars(select(Event).where(Event.type == "task.refit_started")).one()
        assert started.data == {"best_trial_id": winner.id, "refit_trial_id": refit.id, "total_steps": 5}
        refit_id = refit.id
        live = s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).one()
        (payload,) = pack_message(s, live).trials
    assert (payload.trial_id, payload.refit, payload.evaluation, payload.extra_eval_steps) == (refit_id, True, None, [])

    report("pack.started", pack_id=live.id)
    report("points", pack_id=live.id, points=[[refit_id, 5, "train", 0.7]])
    finish(live.id, refit_id, val=[], steps=5)
    report("pack.finished", pack_id=live.id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    with session_scope() as s:
        task = s.get_one(Task, task_id)
        assert task.state == states.TASK_SUCCEEDED and task.best_trial_id == trial_ids[1]
        assert s.get_one(Trial, refit_id).state == states.TRIAL_COMPLETED
        succeeded = s.scalars(select(Event).where(Event.type == "task.succeeded")).one()
        assert succeeded.data["refit_trial_id"] == refit_id and succeeded.data["best_trial_id"] == trial_ids[1]
        assert "2 of 2 trials completed" in succeeded.message and "refit" in succeeded.message
        assert not s.scalars(select(Event).where(Event.type == "trial.stopped_early")).all()


def test_a_failed_refit_leaves_the_task_succeeded_with_its_best_trial_and_a_warning(daemon: SchedulerDaemon) -> None:
    task_id, trial_ids = make_task(1, steps=4, spec=REFIT)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    finish(pack.id, trial_ids[0], val=[1.0, 0.9], steps=4)
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        task = s.get_one(Task, task_id)
        refit = s.get_one(Trial, task.refit_trial_id)
        refit.state, refit.error = states.TRIAL_FAILED, "OutOfMemoryError"  # as at its attempts' limit
        refit_id = refit.id
    daemon.tick()
    with session_scope() as s:
        task = s.get_one(Task, task_id)
        assert (task.state, task.best_trial_id, task.refit_trial_id) == (
            states.TASK_SUCCEEDED, trial_ids[0], refit_id)
        warned = s.scalars(select(Event).where(Event.type == "task.refit_failed")).one()
        assert warned.level == "warn" and "OutOfMemoryError" in warned.message
        assert s.scalars(select(Event).where(Event.type == "task.refit_started")).one()


def test_refit_steps_keep_the_winners_passes_over_more_rows() -> None:
    from common.task_spec import refit_steps

    assert refit_steps(100, 900, 100) == 111
    assert refit_steps(4, 8, 2) == 5
    assert refit_steps(1, 1000, 1) == 1
    with pytest.raises(ValueError):
        refit_steps(10, 0, 5)


def test_a_task_judged_by_its_metric_has_its_warm_up_rung_ranked_by_the_scores_there(daemon: SchedulerDaemon) -> None:
    """Issue 33: early exit ranks by what the user measures. Trial 3 has the highest validation loss at the rung
    but the best exact-match score the worker reported there: it is the one kept."""
    task_id, trials = make_task(4, early_exit={"policy": "alto", "rungs": 1, "keep_ratio": 0.25}, steps=40,
                                evaluation={"metric": "exact_match", "max_new_tokens": 4})
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    for i, trial_id in enumerate(trials):
        curve(pack.id, trial_id, [3.0, 2.9 - i / 10], {2: 2.0 + i})
        report("points", pack_id=pack.id, points=[[trial_id, 2, "metric", [0.1, 0.2, 0.3, 0.8][i]]])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        got = {t.id: t.state for t in s.scalars(select(Trial))}
        assert got[trials[3]] == states.TRIAL_RUNNING
        assert all(got[t] == states.TRIAL_STOPPED_EARLY for t in trials[:3])
        first = s.scalars(select(Event).where(Event.type == "trial.stopped_early", Event.trial_id == trials[0])).one()
        assert first.data["ranked_by"] == "metric" and first.data["metric_score"] == 0.1
        assert "metric score 0.1" in first.message and "ranks 4 of 4" in first.message


def make_tenant_task(steps: int) -> tuple[str, str, str]:
    """A one-trial task of a tenant of its own that trains alone (a pack of one: no room for another tenant)."""
    task_id, (trial_id,) = make_task(1, cap=1, steps=steps)
    with session_scope() as s:
        return task_id, trial_id, s.get_one(Task, task_id).tenant_id


def long_pack_running(daemon: SchedulerDaemon) -> tuple[str, str, str, Pack]:
    """A tenant's long one-trial task placed on the one worker and started: (task, trial, tenant, its pack)."""
    task_id, trial_id, tenant_id = make_tenant_task(steps=100_000)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    daemon.step(block_s=0.2)
    return task_id, trial_id, tenant_id, pack


def started_ago(pack_id: str, seconds: float) -> None:
    with session_scope() as s:
        s.get_one(Pack, pack_id).started_at = utcnow() - timedelta(seconds=seconds)


def test_a_pack_past_its_slice_is_preempted_for_another_tenants_waiting_trial_which_takes_the_worker(
        daemon: SchedulerDaemon) -> None:
    """One worker: tenant A's long trial runs alone; tenant B's trial arrives and cannot start. Once A's pack has
    run its slice, A's trial is paused at a checkpoint, B's trial takes the worker, and A's trial, held back until
    then, is pending again to resume from its checkpoint."""
    assert daemon.fairness is not None  # on by default
    start = commands_tail()
    _, long_trial, tenant_a, pack = long_pack_running(daemon)
    _, short_trial, tenant_b = make_tenant_task(steps=10)
    daemon.step(block_s=0.2)
    assert commands("stop_trials", start) == []  # the pack has not run its slice: nothing is preempted

    started_ago(pack.id, daemon.fairness.min_slice_s + 1)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.2)  # the mark is sent once, however many rounds see it
    (pause,) = commands("stop_trials", start)
    assert (pause["mode"], pause["trial_ids"]) == ("pause", [long_trial])
    with session_scope() as s:
        trial = s.get_one(Trial, long_trial)
        assert (trial.state, trial.preemptions, trial.preempted_for) == (states.TRIAL_RUNNING, 1, tenant_b)
        [event] = s.scalars(select(Event).where(Event.trial_id == long_trial, Event.type == "trial.preempted")).all()
        assert f"for tenant {tenant_b}" in event.message and event.data["for_tenant"] == tenant_b
        assert s.get_one(Trial, short_trial).state == states.TRIAL_PENDING

    report("trial.checkpoint", pack_id=pack.id, trial_id=long_trial, step=40, checkpoint_key="ckpt/long-40")
    report("trial.finished", pack_id=pack.id, trial_id=long_trial, status="paused", steps_done=40,
           best_val_loss=1.5, best_step=40, final_train_loss=1.8, adapter_key=None)
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    second = live_pack()
    assert second.trial_ids == [short_trial]  # the freed worker went to the tenant it was freed for
    with session_scope() as s:
        paused = s.get_one(Trial, long_trial)
        assert (paused.state, paused.checkpoint_step, paused.attempts) == (states.TRIAL_PENDING, 40, 0)
        assert "trial.paused" in [e.type for e in s.scalars(select(Event).where(Event.trial_id == long_trial))]
    daemon.step(block_s=0.2)
    with session_scope() as s:
        # Tenant B has nothing left pending: A's trial is no longer held back (it waits for the worker as usual),
        # and B's pack, not past its slice, is not preempted back.
        released = s.get_one(Trial, long_trial)
        assert (released.state, released.preempted_for, released.not_before) == (states.TRIAL_PENDING, None, None)
    assert len(commands("stop_trials", start)) == 1
    assert tenant_a != tenant_b


def test_a_trial_is_preempted_at_most_max_pauses_times_and_never_for_its_own_tenant(daemon: SchedulerDaemon) -> None:
    assert daemon.fairness is not None
    start = commands_tail()
    task_id, long_trial, tenant_a, pack = long_pack_running(daemon)
    started_ago(pack.id, daemon.fairness.min_slice_s + 1)
    # Another trial of the same tenant waits: the tenant is not preempted for itself.
    with session_scope() as s:
        s.add(Trial(id=new_id("trial"), task_id=task_id, tenant_id=tenant_a, index=1, state=states.TRIAL_PENDING,
                    total_steps=10, hyperparameters=s.get_one(Trial, long_trial).hyperparameters))
    daemon.step(block_s=0.2)
    assert commands("stop_trials", start) == []
    # Another tenant waits, but the running trial has been preempted max_pauses times already.
    with session_scope() as s:
        s.get_one(Trial, long_trial).preemptions = daemon.fairness.max_pauses
    make_tenant_task(steps=10)
    daemon.step(block_s=0.2)
    assert commands("stop_trials", start) == []


def test_preemption_can_be_turned_off() -> None:
    settings = get_settings().model_copy(update={"preempt": False})
    assert SchedulerDaemon(settings, get_bus(), get_celery(), consumer="test").fairness is None
    tuned = get_settings().model_copy(update={"preempt_min_slice_s": 60.0, "preempt_max_pauses": 1})
    policy = SchedulerDaemon(tuned, get_bus(), get_celery(), consumer="test").fairness
    assert policy == policy_from(tuned)
    assert policy is not None and (policy.min_slice_s, policy.max_pauses) == (60.0, 1)
    assert policy.window_s == FairnessPolicy().window_s  # unset: the policy's own default
