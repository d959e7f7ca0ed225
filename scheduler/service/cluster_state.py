"""What the planner knows of the cluster now, read from the database: each base model's cost model (fitted, or the
priors for its size), the alive workers with their GPUs and the models they load, and when each busy worker's pack
is predicted to end.

Shared by the daemon (scheduler/service/planner_io.py, its snapshot) and the API's estimates
(api/services/estimates.py), so an estimate rests on the very numbers the planner plans with. Imports only
SQLAlchemy, `common` and the pure cost modules: the API imports this module, and must not pull in the solver, the
bus or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, not_, select
from sqlalchemy.orm import Session

from common import states
from common.tables import BaseModelEntry, Pack, Task, Trial, Worker, as_utc
from scheduler.planning.cost import (
    CPU_DEVICE_KIND,
    GPU_DEVICE_KIND,
    PRIOR_COST,
    ModelCost,
    Progress,
    device_kind,
    fit_profiles,
    prior_cost,
    samples_from_profiles,
    tokens_per_step,
)
from scheduler.planning.types import LiveWorker

log = logging.getLogger(__name__)

PROFILES_PER_MODEL = 20  # the newest pack profiles a base model's cost model is fitted on


def load_costs(
    session: Session, models: Collection[str] | None = None, kind: str | None = None
) -> dict[str, ModelCost]:
    """Each base model's cost model: the one place the daemon's planner and the API's estimates get it from.
    Fitted on its newest pack profiles; without any, the priors for its size (`prior_cost` of its registered
    `parameters`, flagged `ModelCost.prior`); either then corrected online by what its running packs measure now
    (the mean measured/predicted step-time ratio of their `pack.progress`: no longer the priors). Every registered
    model has one. `models`: only these base models (None: every one). `kind`: only the packs of workers of this
    device kind (`cost.device_kind`), and its priors (the estimates: a CPU run must not teach a GPU estimate); None:
    every pack, and the GPU priors (the daemon's planner, which has one cost model per base model)."""
    costs = _fitted_costs(session, models, kind)
    registered = select(BaseModelEntry.name, BaseModelEntry.parameters, BaseModelEntry.quantization)
    if models is not None:
        registered = registered.where(BaseModelEntry.name.in_(list(models)))
    for model, parameters, quantization in session.execute(registered):
        costs.setdefault(model, prior_cost(parameters, kind or GPU_DEVICE_KIND, quantization))
    ratios: dict[str, list[float]] = {}
    running = select(Pack).where(Pack.state == states.PACK_RUNNING, Pack.progress.is_not(None))
    if models is not None:
        running = running.where(Pack.base_model.in_(list(models)))
    if kind is not None:
        running = running.join(Worker, Worker.id == Pack.worker_id).where(_of_kind(kind))
    for pack in session.scalars(running):
        measured = progress_of(pack)
        if measured is not None:
            base = costs.get(pack.base_model, PRIOR_COST)
            ratios.setdefault(pack.base_model, []).append(measured.ratio(base.step))
    for model, found in ratios.items():
        base = costs.get(model, PRIOR_COST)
        costs[model] = ModelCost(memory=base.memory, step=base.step.scaled(sum(found) / len(found)),
                                 packs=base.packs + len(found))
    return costs


def _of_kind(kind: str) -> ColumnElement[bool]:
    """The workers of a device kind, as `cost.device_kind` reads their `device`."""
    on_cpu = Worker.device.like(f"{CPU_DEVICE_KIND}%")
    return on_cpu if kind == CPU_DEVICE_KIND else not_(on_cpu)


def _fitted_costs(session: Session, models: Collection[str] | None, kind: str | None) -> dict[str, ModelCost]:
    """The cost models fitted on each profiled base model's newest pack profiles (`models`: only these; `kind`: only
    packs of workers of this device kind)."""
    profiled = select(Pack.base_model).where(Pack.profile.is_not(None)).distinct()
    if models is not None:
        profiled = profiled.where(Pack.base_model.in_(list(models)))
    if kind is not None:
        profiled = profiled.join(Worker, Worker.id == Pack.worker_id).where(_of_kind(kind))
    costs: dict[str, ModelCost] = {}
    for model in session.scalars(profiled).all():
        newest = select(Pack.profile).where(Pack.base_model == model, Pack.profile.is_not(None))
        if kind is not None:
            newest = newest.join(Worker, Worker.id == Pack.worker_id).where(_of_kind(kind))
        profiles = session.scalars(newest.order_by(Pack.created_at.desc()).limit(PROFILES_PER_MODEL)).all()
        samples, packs = [], 0
        for profile in profiles:
            try:
                found = samples_from_profiles([profile])
            except (ValueError, TypeError, AssertionError) as exc:  # a malformed report must not stop planning
                log.warning("ignoring a malformed %s pack profile: %s", model, exc)
                continue
            samples.extend(found)
            packs += bool(found)
        if samples:
            memory, step = fit_profiles(samples)
            costs[model] = ModelCost(memory=memory, step=step, packs=packs)
    return costs


def worker_kind(worker: Worker) -> str:
    """The worker's device kind (`cost.device_kind` of its heartbeat's `device`)."""
    return device_kind(worker.device)


def progress_of(pack: Pack) -> Progress | None:
    """The pack's newest measurement, if it has a usable one."""
    try:
        return Progress.from_report(pack.progress) if pack.progress else None
    except (KeyError, TypeError, ValueError):
        return None


def trial_tokens_per_step(trial: Trial, task: Task) -> int:
    return tokens_per_step(trial.hyperparameters, task.parsed_spec.max_seq_len)


def alive_workers(session: Session, now: datetime, timeout_s: float) -> list[Worker]:
    return list(session.scalars(
        select(Worker).where(
            Worker.state == states.WORKER_ALIVE,
            Worker.last_heartbeat >= now - timedelta(seconds=timeout_s),
        )
    ).all())


def usable_workers(session: Session, now: datetime, timeout_s: float) -> list[Worker]:
    """Alive workers the planners may give packs: those out of quarantine (scheduler/service/faults.py)."""
    return [w for w in alive_workers(session, now, timeout_s) if quarantine_left_s(w, now) == 0]


def quarantine_left_s(worker: Worker, now: datetime) -> float:
    """Seconds until the worker's quarantine ends (0: not quarantined)."""
    if worker.quarantined_until is None:
        return 0.0
    return max(0.0, (as_utc(worker.quarantined_until) - now).total_seconds())


def quarantined_worker_ids(session: Session, now: datetime) -> list[str]:
    return list(session.scalars(select(Worker.id).where(Worker.quarantined_until > now)).all())


def worker_models(worker: Worker) -> frozenset[str] | None:
    """The models the worker's newest heartbeat says it can load; None: it does not say (every model)."""
    return None if worker.models is None else frozenset(str(m) for m in worker.models)


def worker_warm(worker: Worker) -> frozenset[str]:
    """The base models the worker's newest heartbeat says it holds loaded (none when it does not say)."""
    return frozenset(str(w["name"]) for w in worker.warm_models or () if isinstance(w, dict) and "name" in w)


def pack_memory(worker: Worker) -> int | None:
    """One of the worker's GPUs' memory less what its sampler process holds now (worker/sampler.py: its own copy of a
    base model, answering sampling requests beside the packs); None where the worker does not say its memory."""
    if worker.memory_bytes is None:
        return None
    return max(0, worker.memory_bytes - (worker.sampler_bytes or 0))


def busy_workers(
    session: Session, now: datetime, timeout_s: float, costs: dict[str, ModelCost],
    read: MembersRead | None = None,
) -> tuple[LiveWorker, ...]:
    """Alive workers out of quarantine training a pack, each with the predicted seconds until its pack ends (the
    planner may wait for one rather than open a worse pack now). Only worth its queries when something is to be
    placed. ``read``: the members the caller's transaction already read (`running_members`)."""
    live = {p.worker_id: p for p in session.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE)))}
    workers = [w for w in usable_workers(session, now, timeout_s) if w.id in live]
    members = running_members(session, [live[w.id].id for w in workers], read)
    return tuple(
        LiveWorker(w.id, w.max_slots, pack_memory(w), worker_models(w),
                   busy_for_s=predicted_remaining_s(session, live[w.id], costs, members[live[w.id].id]), gpus=w.gpus,
                   warm=worker_warm(w))
        for w in workers
    )


MembersRead = dict[str, list[tuple[Trial, Task]]]  # running members already read, by pack (`running_members`)


def running_members(session: Session, pack_ids: Collection[str],
                    read: MembersRead | None = None) -> MembersRead:
    """Each pack's running trials with their tasks, in one query for all of them (a query a pack was most of a
    round's time at 256 workers: issue 53). ``read``: packs whose members this transaction already read, and where
    the ones read now are kept (a round reads each pack's once: the rows of 8,192 running trials were a fifth of a
    round's CPU at 256 workers, read three times)."""
    read = {} if read is None else read
    missing = [pack_id for pack_id in pack_ids if pack_id not in read]
    if missing:
        read.update({pack_id: [] for pack_id in missing})
        for trial, task in session.execute(select(Trial, Task).join(Task, Task.id == Trial.task_id).where(
                Trial.pack_id.in_(missing), Trial.state == states.TRIAL_RUNNING).order_by(Trial.id)):
            read[str(trial.pack_id)].append((trial, task))
    return {pack_id: read[pack_id] for pack_id in pack_ids}


def predicted_remaining_s(session: Session, pack: Pack, costs: dict[str, ModelCost],
                          rows: Sequence[tuple[Trial, Task]] | None = None) -> float:
    """Seconds until a live pack's longest-running member is done, at the pack's predicted step time (``rows``:
    its running members with their tasks, when already read: `running_members`).

    ``costs`` already carry the online correction of the pack's base model (``load_costs``). A pack that
    measured its own step time with the members it has now is predicted at that time; one whose members
    changed since, by the model corrected with its own measured/predicted ratio."""
    if rows is None:
        rows = running_members(session, [pack.id])[pack.id]
    if not rows:
        return 0.0
    model = costs.get(pack.base_model, PRIOR_COST).step
    measured = progress_of(pack)
    if measured is not None and round(measured.slots) == len(rows):
        step = measured.step_s
    else:
        if measured is not None:
            model = model.scaled(measured.ratio(model))
        step = model.predict(sum(trial_tokens_per_step(trial, task) for trial, task in rows), len(rows))
    return max(trial.total_steps - trial.steps_done for trial, _ in rows) * step
