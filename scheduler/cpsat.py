"""The CP-SAT planner: which pending trials share a pack, on which GPU(s), starting when (DESIGN.md §5).

Pure: `plan_cpsat(PlanningInput) -> PlanResult`, no I/O. ALTO §7.2 (Table 1) schedules rigid multi-GPU
tasks for makespan; PLoRA §6 adds the packing (configuration → job); tLoRA §3.4 lets trials of different
tasks and tenants share one backbone. Here the three are one model:

- candidate packs per (base model, GPU count): pack j holds pending trial j as its lowest-index member or is
  empty (bin-packing symmetry breaking: n trials need n(n+1)/2 membership literals, not n²);
- a pack is one start and duration on k GPUs chosen together: an optional interval per (pack, GPU) and
  `NoOverlap` per GPU, with busy GPUs and running packs as intervals from 0;
- step time `a + b·tokens + c·slots` is linear in membership, so every trial's completion is linear too;
- back-fill puts a pending trial into a running pack's free slot, starting now;
- per-tenant quotas (max concurrent trials) are `Cumulative` constraints over trial intervals.
Objective: makespan_weight·makespan + Σ tenant_weight·completion. All integer arithmetic is in
`_Prep` and shared with `plan_greedy`; the reported schedule is recomputed with it from the solver's
choices, so the model, the fallback and the brute-force tests agree exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from scheduler.cost import MemoryModel, StepTimeModel

SCALE = 1000  # step times are integer thousandths of a time unit, rounded up


@dataclass(frozen=True)
class PlanTrial:
    trial_id: str
    task_id: str
    tenant_id: str
    tenant_weight: int  # ≥ 1: weight of this trial's completion time in the objective
    base_model: str
    gpus_needed: int  # the task's model needs this many GPUs together (ALTO: 70B → 4, 32B → 2, 8B → 1)
    tokens_per_step: int  # padded tokens this trial adds to its pack's step
    remaining_steps: int
    slot_bytes: int  # adapter + optimizer bytes of this slot (16 · adapter_params)
    max_trials_per_pack: int  # the task's cap


@dataclass(frozen=True)
class GpuSpec:
    gpu_id: str
    memory_bytes: int
    busy_until: int = 0  # time units from now; 0 = free now


@dataclass(frozen=True)
class RunningPack:
    """A pack already training: kept as is (never preempted); its free slots may be back-filled."""

    pack_id: str
    gpu_ids: tuple[str, ...]
    base_model: str
    ends_at: int  # predicted end of its current members, time units from now
    trials: int
    free_slots: int
    tokens_per_step: int
    slot_bytes: int
    max_trials_per_pack: int
    tenant_trials: tuple[tuple[str, int], ...] = ()  # running trials per tenant, for quotas


@dataclass(frozen=True)
class ModelCost:
    memory: MemoryModel  # per GPU of the pack
    step: StepTimeModel


@dataclass(frozen=True)
class PlanningInput:
    trials: tuple[PlanTrial, ...]  # pending, oldest first
    gpus: tuple[GpuSpec, ...]
    costs: Mapping[str, ModelCost]  # by base model
    running: tuple[RunningPack, ...] = ()
    tenant_quota: Mapping[str, int] = field(default_factory=dict)  # max concurrent trials per tenant
    unit_s: float = 1.0  # seconds per integer time unit
    makespan_weight: int = 1
    max_interval_vars: int = 20_000  # above this the model is not built: greedy fallback
    # Σ over groups of n·n(n+1)/2, the terms of the completion constraints (n trials of one model in a group):
    # measured, CP-SAT finds nothing within 1 s beyond a few tens of thousands, so skip straight to greedy.
    max_pack_terms: int = 30_000


@dataclass(frozen=True)
class ScheduledPack:
    pack_key: str  # "new-<leader trial id>" or the running pack's id for a back-fill
    gpu_ids: tuple[str, ...]
    base_model: str
    trial_ids: tuple[str, ...]
    start: int
    end: int
    backfill: bool = False


@dataclass(frozen=True)
class PlanResult:
    packs: tuple[ScheduledPack, ...]  # the full schedule, by (start, pack_key)
    start_now: tuple[ScheduledPack, ...]  # the first wave: new packs starting at 0 and all back-fills
    completion: Mapping[str, int]  # trial id -> completion time (units)
    unschedulable: tuple[str, ...]  # pending trials no GPU set can ever hold
    makespan: int
    objective: int
    solve_s: float
    status: str  # "optimal" | "feasible" | "greedy_fallback"


class _Prep:
    """Integer coefficients shared by the CP-SAT model, the greedy packer and the result."""

    def __init__(self, inp: PlanningInput) -> None:
        self.inp = inp
        self.gpu_mem = {g.gpu_id: g.memory_bytes for g in inp.gpus}
        self.trials = [t for t in inp.trials if self._placeable(t)]
        self.unschedulable = tuple(t.trial_id for t in inp.trials if not self._placeable(t))

    def _cost(self, model: str) -> ModelCost:
        return self.inp.costs[model]

    def _placeable(self, t: PlanTrial) -> bool:
        if t.base_model not in self.inp.costs or t.remaining_steps <= 0 or t.gpus_needed < 1:
            return False
        if self.inp.tenant_quota.get(t.tenant_id, 1) < 1:
            return False
        solo = self.mem_base(t.base_model) + self.mem_item(t)
        return sum(1 for g in self.inp.gpus if g.memory_bytes >= solo) >= t.gpus_needed

    # Memory: base + Σ items ≤ GPU bytes. Each term is rounded up so the sum never under-estimates.
    def mem_base(self, model: str) -> int:
        return math.ceil(self._cost(model).memory.k0_bytes)

    def mem_item(self, t: PlanTrial) -> int:
        return math.ceil(self._cost(t.base_model).memory.k1_bytes_per_token * t.tokens_per_step) + t.slot_bytes

    def mem_running(self, r: RunningPack) -> int:
        m = self._cost(r.base_model).memory
        return self.mem_base(r.base_model) + math.ceil(m.k1_bytes_per_token * r.tokens_per_step) + r.slot_bytes

    # Step time in SCALE-ths of a unit: base + Σ items, each rounded up.
    def _kk(self) -> float:
        return SCALE / self.inp.unit_s

    def step_base(self, model: str) -> int:
        return math.ceil(self._cost(model).step.a_s * self._kk())

    def step_item(self, t: PlanTrial) -> int:
        s = self._cost(t.base_model).step
        return math.ceil(s.b_s_per_token * t.tokens_per_step * self._kk()) + math.ceil(s.c_s_per_slot * self._kk())

    def step_running(self, r: RunningPack) -> int:
        s = self._cost(r.base_model).step
        return (self.step_base(r.base_model) + math.ceil(s.b_s_per_token * r.tokens_per_step * self._kk())
                + math.ceil(s.c_s_per_slot * self._kk()) * r.trials)

    @staticmethod
    def duration(steps: int, step_milli: int) -> int:
        """Units for `steps` at `step_milli`: rounded up and never 0 (remaining work always takes time)."""
        return max(1, -(-steps * step_milli // SCALE))

    def durations(self, members: list[PlanTrial], base: int) -> dict[str, int]:
        step = base + sum(self.step_item(t) for t in members)
        return {t.trial_id: self.duration(t.remaining_steps, step) for t in members}

    def quota_cap(self, tenant: str) -> int | None:
        q = self.inp.tenant_quota.get(tenant)
        if q is None:
            return None
        running = sum(n for r in self.inp.running for ten, n in r.tenant_trials if ten == tenant)
        # Already over quota (the quota was lowered): keep what runs, start nothing new beside it.
        return max(q, running)

    def compatible(self, t: PlanTrial, r: RunningPack) -> bool:
        return t.base_model == r.base_model and t.gpus_needed == len(r.gpu_ids) and r.free_slots > 0

    def fixed_busy(self) -> dict[str, int]:
        """GPU -> time it is taken until by something the plan cannot move (busy or a running pack)."""
        busy = {g.gpu_id: g.busy_until for g in self.inp.gpus}
        for r in self.inp.running:
            for g in r.gpu_ids:
                busy[g] = max(busy.get(g, 0), r.ends_at)
        return busy


def _finish(prep: _Prep, packs: list[ScheduledPack], solve_s: float, status: str) -> PlanResult:
    """Recomputes completions from the packs with the shared arithmetic and scores the objective."""
    by_id = {t.trial_id: t for t in prep.trials}
    running = {r.pack_id: r for r in prep.inp.running}
    completion: dict[str, int] = {}
    timed: list[ScheduledPack] = []
    for p in packs:
        members = [by_id[i] for i in p.trial_ids]
        base = prep.step_running(running[p.pack_key]) if p.backfill else prep.step_base(p.base_model)
        durs = prep.durations(members, base)
        completion.update({tid: p.start + d for tid, d in durs.items()})
        timed.append(replace(p, end=p.start + max(durs.values())))
    makespan = max([*completion.values(), *(r.ends_at for r in prep.inp.running), 0])
    weights = {t.trial_id: t.tenant_weight for t in prep.trials}
    objective = prep.inp.makespan_weight * makespan + sum(weights[i] * c for i, c in completion.items())
    ordered = tuple(sorted(timed, key=lambda p: (p.start, p.pack_key)))
    return PlanResult(
        packs=ordered, start_now=tuple(p for p in ordered if p.start == 0 or p.backfill), completion=completion,
        unschedulable=prep.unschedulable, makespan=makespan, objective=objective, solve_s=solve_s, status=status,
    )


def _quota_ok(prep: _Prep, used: dict[str, list[tuple[int, int]]], new: list[tuple[str, int, int]]) -> bool:
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
    of the same model join while memory, caps and quotas still hold with the pack's slower step.
    """
    t0 = time.perf_counter()
    prep = _Prep(inp)
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

    for r in sorted(inp.running, key=lambda r: r.pack_id):
        members: list[PlanTrial] = []
        mem_left = min(prep.gpu_mem[g] for g in r.gpu_ids) - prep.mem_running(r)
        for t in pending:
            if prep.compatible(t, r) and len(members) < r.free_slots and grow(
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
        members = [lead]
        for t in pending[1:]:
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
        chosen = {t.trial_id for t in members}
        pending = [t for t in pending if t.trial_id not in chosen]
    return _finish(prep, packs, time.perf_counter() - t0, "greedy_fallback")


def plan_cpsat(inp: PlanningInput, *, time_limit_s: float = 1.0, seed: int = 0, num_workers: int = 1) -> PlanResult:
    """Best plan CP-SAT finds within `time_limit_s`; the greedy plan when the model is too big or unsolved.

    The greedy plan also seeds the search (a hint) and bounds the objective, so a timed-out solve is never
    worse than the fallback. `num_workers=1` with a fixed `seed` and a deterministic time limit makes the
    plan reproducible; more workers search faster but the result may then depend on timing.
    """
    t0 = time.perf_counter()
    prep = _Prep(inp)
    groups: dict[tuple[str, int], list[PlanTrial]] = {}
    for t in prep.trials:
        groups.setdefault((t.base_model, t.gpus_needed), []).append(t)
    n_intervals = sum(len(ts) for ts in groups.values()) * len(inp.gpus) + len(prep.trials)
    greedy = plan_greedy(inp)
    if not prep.trials:  # nothing to decide: the empty plan is trivially optimal
        return replace(greedy, solve_s=time.perf_counter() - t0, status="optimal")
    terms = sum(len(ts) * len(ts) * (len(ts) + 1) // 2 for ts in groups.values())
    if n_intervals > inp.max_interval_vars or terms > inp.max_pack_terms:
        return replace(greedy, solve_s=time.perf_counter() - t0)
    built = _Model(prep, groups, greedy)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = num_workers
    status = solver.solve(built.m)
    if status not in _STATUS:
        return replace(greedy, solve_s=time.perf_counter() - t0)
    return _finish(prep, built.extract(solver), time.perf_counter() - t0, _STATUS[status])


_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible"}


class _Model:
    """The CP-SAT model of one planning input; see the module docstring for the formulation."""

    def __init__(self, prep: _Prep, groups: dict[tuple[str, int], list[PlanTrial]], greedy: PlanResult) -> None:
        self.prep, self.m = prep, cp_model.CpModel()
        m, inp = self.m, prep.inp
        fixed = prep.fixed_busy()
        # Any optimal plan's makespan and completions are ≤ its objective ≤ the greedy plan's objective.
        h = max(greedy.objective, *fixed.values(), 1) + 1
        self.comp = {t.trial_id: m.new_int_var(1, h, f"C_{t.trial_id}") for t in prep.trials}
        self.st = {t.trial_id: m.new_int_var(0, h, f"st_{t.trial_id}") for t in prep.trials}
        on_gpu: dict[str, list[cp_model.IntervalVar]] = {g.gpu_id: [] for g in inp.gpus}
        placed: dict[str, list[cp_model.IntVar]] = {t.trial_id: [] for t in prep.trials}
        by_tenant: dict[str, list[tuple[cp_model.IntervalVar, int]]] = {}
        ends: list[cp_model.IntVar] = []
        # New packs, one candidate per (group, leader).
        self.span: dict[str, tuple[cp_model.IntVar, cp_model.IntVar]] = {}
        self.packs: list[tuple[PlanTrial, list[tuple[PlanTrial, cp_model.IntVar]], cp_model.IntVar,
                               dict[str, cp_model.IntVar]]] = []
        for (model, k), ts in groups.items():
            base_mem, base_step = prep.mem_base(model), prep.step_base(model)
            for j, lead in enumerate(ts):
                members = [(t, m.new_bool_var(f"x_{t.trial_id}_{lead.trial_id}")) for t in ts[j:]]
                used = members[0][1]
                s, d, e = (m.new_int_var(0, h, f"{n}_{lead.trial_id}") for n in "SDE")
                m.add(e == s + d)
                gpus = [g for g in inp.gpus if g.memory_bytes >= base_mem + prep.mem_item(lead)]
                y = {g.gpu_id: m.new_bool_var(f"y_{lead.trial_id}_{g.gpu_id}") for g in gpus}
                m.add(sum(y.values()) == k * used)
                for g in gpus:
                    on_gpu[g.gpu_id].append(m.new_optional_interval_var(s, d, e, y[g.gpu_id], "p"))
                    m.add(base_mem + sum(prep.mem_item(t) * x for t, x in members) <= g.memory_bytes
                          ).only_enforce_if(y[g.gpu_id])
                step = base_step + sum(prep.step_item(t) * x for t, x in members)
                for t, x in members:
                    m.add_implication(x, used)
                    placed[t.trial_id].append(x)
                    c = self.comp[t.trial_id]
                    m.add(sum(x2 for _, x2 in members) <= t.max_trials_per_pack).only_enforce_if(x)
                    m.add(SCALE * c >= SCALE * s + t.remaining_steps * step).only_enforce_if(x)
                    m.add(c >= s + 1).only_enforce_if(x)
                    m.add(e >= c).only_enforce_if(x)
                    m.add(self.st[t.trial_id] == s).only_enforce_if(x)
                self.packs.append((lead, members, s, y))
                self.span[lead.trial_id] = (d, e)
        # Running packs: kept where they are, back-filled with pending trials that fit.
        self.fills: list[tuple[RunningPack, list[tuple[PlanTrial, cp_model.IntVar]]]] = []
        for r in inp.running:
            e_r = m.new_int_var(r.ends_at, h, f"E_{r.pack_id}")
            ends.append(e_r)
            iv = m.new_interval_var(0, e_r, e_r, f"run_{r.pack_id}")
            for gid in r.gpu_ids:
                # The GPU is taken until the pack ends or its own busy_until, whichever is later.
                occ = m.new_int_var(0, h, f"occ_{gid}")
                m.add_max_equality(occ, [e_r, fixed[gid]])
                on_gpu[gid].append(m.new_interval_var(0, occ, occ, f"held_{gid}"))
            # Its own trials end at ends_at even if back-filled trials keep the pack running longer.
            own = m.new_fixed_size_interval_var(0, r.ends_at, f"own_{r.pack_id}")
            for ten, n in r.tenant_trials:
                by_tenant.setdefault(ten, []).append((own, n))
            z = [(t, m.new_bool_var(f"z_{t.trial_id}_{r.pack_id}")) for t in prep.trials if prep.compatible(t, r)]
            if not z:
                continue
            n_fill = sum(v for _, v in z)
            m.add(n_fill <= min(r.free_slots, r.max_trials_per_pack - r.trials))
            # Only the additions are constrained: a running pack the model thinks over-full still runs.
            room = max(0, min(prep.gpu_mem[gid] for gid in r.gpu_ids) - prep.mem_running(r))
            m.add(sum(prep.mem_item(t) * v for t, v in z) <= room)
            step = prep.step_running(r) + sum(prep.step_item(t) * v for t, v in z)
            for t, v in z:
                placed[t.trial_id].append(v)
                m.add(r.trials + n_fill <= t.max_trials_per_pack).only_enforce_if(v)
                m.add(SCALE * self.comp[t.trial_id] >= t.remaining_steps * step).only_enforce_if(v)
                m.add(e_r >= self.comp[t.trial_id]).only_enforce_if(v)
                m.add(self.st[t.trial_id] == 0).only_enforce_if(v)
            self.fills.append((r, z))
        for g in inp.gpus:
            if g.busy_until > 0 and not any(g.gpu_id in r.gpu_ids for r in inp.running):
                on_gpu[g.gpu_id].append(m.new_fixed_size_interval_var(0, g.busy_until, "busy"))
            m.add_no_overlap(on_gpu[g.gpu_id])
        for t in prep.trials:
            m.add_exactly_one(placed[t.trial_id])
            size = m.new_int_var(0, h, f"len_{t.trial_id}")
            iv = m.new_interval_var(self.st[t.trial_id], size, self.comp[t.trial_id], f"trial_{t.trial_id}")
            by_tenant.setdefault(t.tenant_id, []).append((iv, 1))
        for ten, ivs in by_tenant.items():
            cap = prep.quota_cap(ten)
            if cap is not None:
                m.add_cumulative([iv for iv, _ in ivs], [n for _, n in ivs], cap)
        makespan = m.new_int_var(0, h, "makespan")
        m.add_max_equality(makespan, [*self.comp.values(), *ends])
        objective = inp.makespan_weight * makespan + sum(
            t.tenant_weight * self.comp[t.trial_id] for t in prep.trials)
        m.add(objective <= greedy.objective)
        m.minimize(objective)
        self._hint(greedy)

    def _hint(self, greedy: PlanResult) -> None:
        """Starts the search from the greedy plan: each greedy pack is the candidate led by its oldest member."""
        rank = {t.trial_id: i for i, t in enumerate(self.prep.trials)}
        led = {min(p.trial_ids, key=rank.__getitem__): p for p in greedy.packs if not p.backfill}
        for lead, members, s, y in self.packs:
            p = led.get(lead.trial_id)
            for t, x in members:
                self.m.add_hint(x, p is not None and t.trial_id in p.trial_ids)
            self.m.add_hint(s, p.start if p else 0)
            d, e = self.span[lead.trial_id]
            self.m.add_hint(d, p.end - p.start if p else 0)
            self.m.add_hint(e, p.end if p else 0)
            for g, v in y.items():
                self.m.add_hint(v, p is not None and g in p.gpu_ids)
        # A complete hint lets CP-SAT start from a feasible solution instead of repairing a partial one.
        start = {tid: (0 if p.backfill else p.start) for p in greedy.packs for tid in p.trial_ids}
        for tid, c in self.comp.items():
            self.m.add_hint(c, greedy.completion[tid])
            self.m.add_hint(self.st[tid], start[tid])
        where = {tid: p.pack_key for p in greedy.packs if p.backfill for tid in p.trial_ids}
        for r, z in self.fills:
            for t, v in z:
                self.m.add_hint(v, where.get(t.trial_id) == r.pack_id)

    def extract(self, solver: cp_model.CpSolver) -> list[ScheduledPack]:
        out: list[ScheduledPack] = []
        for lead, members, s, y in self.packs:
            trials = [t.trial_id for t, x in members if solver.boolean_value(x)]
            if trials:
                out.append(ScheduledPack(f"new-{lead.trial_id}", tuple(g for g, v in y.items()
                                                                       if solver.boolean_value(v)),
                                         lead.base_model, tuple(trials), solver.value(s), 0))
        for r, z in self.fills:
            trials = [t.trial_id for t, v in z if solver.boolean_value(v)]
            if trials:
                out.append(ScheduledPack(r.pack_id, r.gpu_ids, r.base_model, tuple(trials), 0, 0, backfill=True))
        return out
