"""The rules applied after a solver, to its plan (pure): no worker idle now while a pack waits (`work_conserving`),
and, on the cost priors, no trial held back while a pack of its model starting now has room (`fill_now`).
`after_solver` applies both, as the daemon's planner (placement.py) and the estimates (estimate.py) do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import replace

from scheduler.planning.coefficients import Prepared, finish_plan
from scheduler.planning.types import PendingTrial, PlanningInput, PlanResult, ScheduledPack


def after_solver(inp: PlanningInput, result: PlanResult, on_priors: Collection[str]) -> PlanResult:
    """The solver's plan with `work_conserving`, then `fill_now` for the base models in ``on_priors`` (those no
    pack has profiled yet)."""
    return fill_now(inp, work_conserving(inp, result), on_priors)


def work_conserving(inp: PlanningInput, result: PlanResult) -> PlanResult:
    """The plan with no worker left idle now while a pack waits for later: each worker free now that the plan gives
    nothing to takes the earliest later single-worker pack that fits its memory and its tenants' quotas, started
    now. Never later for the pack moved (it starts now instead of at its planned start) and never later for the
    others (the worker it leaves is only freed); the solver's cost model may still score the result worse (it
    prefers to wait where packing buys nothing in it), which is why this is a rule outside the solver."""
    prep = Prepared(inp)
    busy = prep.fixed_busy()
    taken = {g for p in result.start_now if not p.backfill for g in p.worker_ids}
    idle = [g for g in inp.workers if busy.get(g.worker_id, 0) == 0 and g.worker_id not in taken]
    later = sorted((p for p in result.packs if not p.backfill and p.start > 0 and len(p.worker_ids) == 1),
                   key=lambda p: (p.start, p.pack_key))
    if not idle or not later:
        return result
    by_id = {t.trial_id: t for t in prep.trials}
    running_now = _tenant_trials_now(inp, result, by_id)
    moved: dict[str, ScheduledPack] = {}
    for gpu in idle:
        for p in later:
            members = [by_id[i] for i in p.trial_ids]
            adds = Counter(t.tenant_id for t in members)
            if (p.pack_key in moved or not prep.loads(gpu.worker_id, p.base_model)
                    or prep.mem_base(p.base_model) + sum(prep.mem_item(t) for t in members) > gpu.memory_bytes
                    or any((quota := prep.quota_cap(tenant)) is not None and running_now[tenant] + n > quota
                           for tenant, n in adds.items())):
                continue
            running_now.update(adds)
            moved[p.pack_key] = replace(p, worker_ids=(gpu.worker_id,), start=0)
            break
    if not moved:
        return result
    return finish_plan(prep, [moved.get(p.pack_key, p) for p in result.packs], result.solve_s, result.status)


def _tenant_trials_now(inp: PlanningInput, result: PlanResult, by_id: Mapping[str, PendingTrial]) -> Counter[str]:
    """Trials per tenant running now, and once the plan's first wave has started."""
    running_now: Counter[str] = Counter()
    for r in inp.running:
        for tenant, n in r.tenant_trials:
            running_now[tenant] += n
    running_now.update(by_id[i].tenant_id for p in result.start_now for i in p.trial_ids)
    return running_now


def fill_now(inp: PlanningInput, result: PlanResult, models: Collection[str]) -> PlanResult:
    """The plan with no trial of a base model in `models` held for a later pack while a new pack of its model
    starting now has room: each such pack takes, earliest-planned first, the trials of its model and worker count that
    the plan starts later, within its `max_trials_per_pack`, its workers' memory and its tenants' quotas.

    For models planned on the cost priors (no pack measured yet). The priors cannot tell how much a pack's step
    grows with its trials, and near the margin (short trials, the rounding of each step to whole time units) the
    objective still holds some back; but on the measured engine a pack of a small model steps in about the time
    of a smaller one (host-bound), a held-back trial waits a whole pack, and with early exit it holds its task's
    warm-up ranking back too. The first pack is profiled, and the plans after it weigh measured costs."""
    prep = Prepared(inp)
    now = [p for p in result.packs if not p.backfill and p.start == 0 and p.base_model in models]
    later = sorted((p for p in result.packs if not p.backfill and p.start > 0 and p.base_model in models),
                   key=lambda p: (p.start, p.pack_key))
    if not now or not later:
        return result
    by_id = {t.trial_id: t for t in prep.trials}
    running_now = _tenant_trials_now(inp, result, by_id)
    moved: set[str] = set()
    grown: dict[str, ScheduledPack] = {}
    for p in now:
        members = [by_id[i] for i in p.trial_ids]
        room = min(prep.worker_mem[g] for g in p.worker_ids) - prep.mem_base(p.base_model)
        room -= sum(prep.mem_item(t) for t in members)
        max_trials_per_pack = min(t.max_trials_per_pack for t in members)
        added: list[str] = []
        for q in later:
            if q.base_model != p.base_model or len(q.worker_ids) != len(p.worker_ids):
                continue
            for t in (by_id[i] for i in q.trial_ids if i not in moved):
                quota = prep.quota_cap(t.tenant_id)
                if (len(members) + len(added) + 1 > min(max_trials_per_pack, t.max_trials_per_pack)
                        or prep.mem_item(t) > room or (quota is not None and running_now[t.tenant_id] + 1 > quota)):
                    continue
                max_trials_per_pack = min(max_trials_per_pack, t.max_trials_per_pack)
                room -= prep.mem_item(t)
                running_now[t.tenant_id] += 1
                moved.add(t.trial_id)
                added.append(t.trial_id)
        if added:
            grown[p.pack_key] = replace(p, trial_ids=(*p.trial_ids, *added))
    if not moved:
        return result
    packs = [grown.get(p.pack_key, p) if p.start == 0 or p.backfill
             else replace(p, trial_ids=tuple(i for i in p.trial_ids if i not in moved)) for p in result.packs]
    return finish_plan(prep, [p for p in packs if p.trial_ids], result.solve_s, result.status)
