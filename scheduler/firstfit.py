"""The first-fit planner: the CP-SAT planner's hint and fallback (pure, no I/O)."""

from __future__ import annotations

import time
from collections import Counter

from scheduler.planning import PlanningInput, PlanResult, PlanTrial, Prepared, ScheduledPack, finish_plan


def _quota_ok(prep: Prepared, used: dict[str, list[tuple[int, int]]], new: list[tuple[str, int, int]]) -> bool:
    """Whether adding trial intervals `new` (tenant, start, end) keeps every tenant within its quota."""
    for tenant in {ten for ten, _, _ in new}:
        cap = prep.quota_cap(tenant)
        if cap is None:
            continue
        spans = used.get(tenant, []) + [(s, e) for ten, s, e in new if ten == tenant]
        # Concurrency peaks at some interval start: count the spans covering each start.
        if any(sum(1 for s, e in spans if s <= x < e) > cap for x, _ in spans):
            return False
    return True


def plan_greedy(inp: PlanningInput) -> PlanResult:
    """First-fit list scheduling: back-fill running packs, then open packs on the earliest-free GPU sets.

    Trials go heaviest tenant weight first, then oldest first. Each new pack is led by the next trial, on
    the k earliest-free GPUs that can hold it, at the earliest time its tenant's quota allows; later trials
    of the same model join while memory, caps and quotas still hold with the pack's slower step, up to an
    even share of that model's pending trials over the GPU sets free at the pack's start. Running packs are
    back-filled only with trials for which no GPU set is free now.
    """
    t0 = time.perf_counter()
    prep = Prepared(inp)
    pending = sorted(prep.trials, key=lambda t: -t.tenant_weight)  # stable: oldest first within a weight
    avail = prep.fixed_busy()
    used: dict[str, list[tuple[int, int]]] = {}
    for r in inp.running:
        for ten, n in r.tenant_trials:
            used.setdefault(ten, []).extend([(0, r.ends_at)] * n)
    packs: list[ScheduledPack] = []

    def grow(members: list[PlanTrial], cand: PlanTrial, cap: int, mem_left: int, base: int, start: int,
             already: int = 0) -> bool:
        """Whether `cand` may join `members` (plus `already` running trials) in a pack starting at `start`."""
        trial = [*members, cand]
        if already + len(trial) > min([cap, *(t.max_trials_per_pack for t in trial)]):
            return False
        if sum(prep.mem_item(t) for t in trial) > mem_left:
            return False
        durs = prep.durations(trial, base)
        return _quota_ok(prep, used, [(t.tenant_id, start, start + durs[t.trial_id]) for t in trial])

    def free_now(t: PlanTrial, at: int) -> int:
        """GPU sets of `t`'s size free at time `at` that can hold it alone."""
        solo = prep.mem_base(t.base_model) + prep.mem_item(t)
        return sum(1 for g in inp.gpus if avail[g.gpu_id] <= at and g.memory_bytes >= solo) // t.gpus_needed

    for r in sorted(inp.running, key=lambda r: r.pack_id):
        members: list[PlanTrial] = []
        mem_left = min(prep.gpu_mem[g] for g in r.gpu_ids) - prep.mem_running(r)
        for t in pending:
            # Joining a running pack slows all its members: only when no GPU is free for the trial now.
            if free_now(t, 0) == 0 and prep.compatible(t, r) and len(members) < r.free_slots and grow(
                    members, t, r.max_trials_per_pack, mem_left, prep.step_running(r), 0, already=r.trials):
                members.append(t)
        if members:
            durs = prep.durations(members, prep.step_running(r))
            for t in members:
                used.setdefault(t.tenant_id, []).append((0, durs[t.trial_id]))
            for gid in r.gpu_ids:
                avail[gid] = max(avail[gid], *durs.values())
            packs.append(ScheduledPack(r.pack_id, r.gpu_ids, r.base_model, tuple(t.trial_id for t in members),
                                       0, max(durs.values()), backfill=True))
            chosen = {t.trial_id for t in members}
            pending = [t for t in pending if t.trial_id not in chosen]

    waiting = Counter((t.base_model, t.gpus_needed) for t in pending)  # pending trials per pack kind
    while pending:
        lead = pending[0]
        base_mem = prep.mem_base(lead.base_model)
        fits = [g for g in inp.gpus if g.memory_bytes >= base_mem + prep.mem_item(lead)]
        gpus = sorted(fits, key=lambda g: (avail[g.gpu_id], g.gpu_id))[: lead.gpus_needed]
        start = max(avail[g.gpu_id] for g in gpus)
        base = prep.step_base(lead.base_model)
        solo = prep.duration(lead.remaining_steps, base + prep.step_item(lead))
        # The lead alone must fit its quota: move to the next time one of its tenant's trials ends.
        times = sorted({start, *(e for _, e in used.get(lead.tenant_id, []) if e > start)})
        start = next(x for x in times if _quota_ok(prep, used, [(lead.tenant_id, x, x + solo)]))
        mem_left = min(g.memory_bytes for g in gpus) - base_mem
        # Spread the model's pending trials over the GPU sets free at `start` before stacking them: a pack's
        # step slows with every member, an idle GPU is lost time.
        alike = waiting[(lead.base_model, lead.gpus_needed)]
        limit = min(-(-alike // max(1, free_now(lead, start))), lead.max_trials_per_pack)
        members = [lead]
        for t in pending[1:]:
            if len(members) >= limit:
                break
            if (t.base_model, t.gpus_needed) == (lead.base_model, lead.gpus_needed) and grow(
                    members, t, lead.max_trials_per_pack, mem_left, base, start):
                members.append(t)
        durs = prep.durations(members, base)
        end = start + max(durs.values())
        for t in members:
            used.setdefault(t.tenant_id, []).append((start, start + durs[t.trial_id]))
        for gpu in gpus:
            avail[gpu.gpu_id] = end
        packs.append(ScheduledPack(f"new-{lead.trial_id}", tuple(sorted(g.gpu_id for g in gpus)),
                                   lead.base_model, tuple(t.trial_id for t in members), start, end))
        for t in members:
            waiting[(t.base_model, t.gpus_needed)] -= 1
        chosen = {t.trial_id for t in members}
        pending = [t for t in pending if t.trial_id not in chosen]
    return finish_plan(prep, packs, time.perf_counter() - t0, "greedy_fallback")
