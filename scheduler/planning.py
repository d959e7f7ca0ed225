"""What the planners take and give (pure data), and the integer arithmetic they share.

`Prepared` holds every coefficient in integer time units, so the CP-SAT model (scheduler/cpsat.py), the
first-fit packer (scheduler/firstfit.py) and the brute-force tests all compute the same durations;
`finish_plan` recomputes a plan's completions and objective with it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

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


class Prepared:
    """Integer coefficients shared by the CP-SAT model, the greedy packer and the result."""

    def __init__(self, inp: PlanningInput) -> None:
        self.inp = inp
        self.gpu_mem = {g.gpu_id: g.memory_bytes for g in inp.gpus}
        self._memories = sorted(g.memory_bytes for g in inp.gpus)  # for counting the GPUs that hold a trial
        placeable = [self._placeable(t) for t in inp.trials]
        self.trials = [t for t, ok in zip(inp.trials, placeable, strict=True) if ok]
        self.unschedulable = tuple(t.trial_id for t, ok in zip(inp.trials, placeable, strict=True) if not ok)

    def _cost(self, model: str) -> ModelCost:
        return self.inp.costs[model]

    def _placeable(self, t: PlanTrial) -> bool:
        if t.base_model not in self.inp.costs or t.remaining_steps <= 0 or t.gpus_needed < 1:
            return False
        if self.inp.tenant_quota.get(t.tenant_id, 1) < 1:
            return False
        solo = self.mem_base(t.base_model) + self.mem_item(t)
        return len(self._memories) - bisect.bisect_left(self._memories, solo) >= t.gpus_needed

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


def finish_plan(prep: Prepared, packs: list[ScheduledPack], solve_s: float, status: str) -> PlanResult:
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
