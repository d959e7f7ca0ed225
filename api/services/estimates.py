"""A task's estimate before it runs (`POST /v1/tasks?dry_run=true`, `POST /v1/search-spaces/expand`, and every
submission, stored in `tasks.estimate`): the database read here, the arithmetic in scheduler/planning/estimate.py.

It reads what the daemon's planner reads (scheduler/service/cluster_state.py): the base model's cost model fitted
from its pack profiles (the priors for its size when it has none), the alive workers that can load the model, with
their GPUs, and when each busy one's pack is predicted to end; all of one device kind (`estimate_kind`: a CPU run
teaches no GPU estimate), which the estimate's `basis` names with its error band.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from common.settings import get_settings
from common.tables import utcnow
from scheduler.planning.cost import CPU_DEVICE_KIND, GPU_DEVICE_KIND, PRIOR_COST, tokens_per_step
from scheduler.planning.estimate import Estimate, TrialLoad, UsableWorker, estimate
from scheduler.planning.types import loads, lower_to_slots
from scheduler.service.cluster_state import (
    alive_workers,
    busy_workers,
    load_costs,
    quarantine_left_s,
    worker_kind,
    worker_models,
)


def estimate_task(
    session: Session, *, base_model: str, configs: Sequence[dict[str, Any]], steps: Sequence[int], max_seq_len: int,
    max_trials_per_pack: int,
) -> Estimate:
    """The estimate of trials with these hyperparameters (`configs`) and step counts, on the cluster as it is now."""
    now = utcnow()
    timeout_s = get_settings().worker_timeout_s
    able = [w for w in alive_workers(session, now, timeout_s) if loads(worker_models(w), base_model)]
    kind = estimate_kind([worker_kind(w) for w in able])
    workers = [w for w in able if worker_kind(w) == kind]
    costs = load_costs(session, [base_model], kind)
    busy_for = {b.worker_id: b.busy_for_s for b in busy_workers(session, now, timeout_s, costs)}
    # A quarantined worker gets no pack until its quarantine ends: busy until then, as far as the estimate goes.
    usable = [UsableWorker(memory_bytes=w.memory_bytes, gpus=w.gpus,
                           busy_for_s=max(busy_for.get(w.id, 0.0), quarantine_left_s(w, now))) for w in workers]
    trials = [TrialLoad(steps=n, tokens_per_step=tokens_per_step(c, max_seq_len))
              for c, n in zip(configs, steps, strict=True)]
    cost = costs.get(base_model, PRIOR_COST)  # every registered model has one: the default is for an unknown name
    max_trials_per_pack = lower_to_slots(max_trials_per_pack, [w.max_slots for w in workers])  # as the daemon does
    return estimate(trials, cost, usable, max_trials_per_pack=max_trials_per_pack, on_priors=cost.prior, kind=kind)


def estimate_kind(kinds: Sequence[str]) -> str:
    """The device kind an estimate plans on, given the kinds of the alive workers that can load the model: a GPU
    kind when any is there (the planner's cost model has no kinds: a pack may go to any worker, and a GPU worker
    finishes ~50x sooner), the CPU's when only CPU workers are, and a GPU's when none is (the service's target; the
    estimate then has no wall time). Only the workers of that kind are planned on."""
    return GPU_DEVICE_KIND if not kinds or any(k != CPU_DEVICE_KIND for k in kinds) else CPU_DEVICE_KIND
