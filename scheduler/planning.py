"""What the planners take and give (pure data), and the integer arithmetic they share.

`Prepared` holds every coefficient in integer time units, so the CP-SAT model (scheduler/cpsat.py), the
first-fit packer (scheduler/firstfit.py) and the brute-force tests all compute the same durations;
`finish_plan` recomputes a plan's completions and objective with it.

How long a pack's members take. A pack steps all its members together, one step costing
`base + Σ item(u)` over the members still in it (the step-time model `a + b·tokens + c·slots`, split into the
shared `base = a` and each member's `item = b·tokens_u + c`), and a member leaves once its own steps are done.
So the first `n_t` steps of member t cost `n_t·base + Σ_u item(u)·min(n_u, n_t)`: a long member is slowed
by a short one only while they share the pack, and a short member by a long one for all of its own steps.
That sum is linear in membership, so the CP-SAT model states it exactly; it is what the simulator's clock
does too (scheduler/simulate.py), up to the rounding of each coefficient up to a thousandth of a unit.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.cost import (
    PRIOR_K1_BYTES_PER_TOKEN,
    PRIOR_STEP_BASE_S,
    PRIOR_STEP_S_PER_SLOT,
    PRIOR_STEP_S_PER_TOKEN,
    MemoryModel,
    StepTimeModel,
)

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
    # The base models its worker can load; None: every one. A pack goes only on GPUs that all load its model.
    models: frozenset[str] | None = None


@dataclass(frozen=True)
class RunningMember:
    """One trial training in a running pack: what the planner needs to model the pack member by member."""

    trial_id: str
    tenant_id: str
    tenant_weight: int
    remaining_steps: int
    tokens_per_step: int


@dataclass(frozen=True)
class RunningPack:
    """A pack already training: kept as is (never preempted); its free slots may be back-filled.

    With `members` the planner models it exactly (see the module docstring): back-filled trials slow each
    member only while they share the pack, and the members' weighted completions count in the objective, so a
    back-fill must pay for the delay it causes (the daemon gives them). Without them the old conservative
    model holds: the pack's whole step load stays until `ends_at`, members are not delayed.
    """

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
    members: tuple[RunningMember, ...] = ()  # empty, or all `trials` members


@dataclass(frozen=True)
class ModelCost:
    memory: MemoryModel  # per GPU of the pack
    step: StepTimeModel


# Without a profile: the cost priors (scheduler/cost.py says where their numbers come from). Here, beside
# `ModelCost`, so that the daemon's planner and the API's estimates (scheduler/estimate.py) share one prior.
PRIOR_COST = ModelCost(
    memory=MemoryModel(k0_bytes=0.0, k1_bytes_per_token=PRIOR_K1_BYTES_PER_TOKEN),
    step=StepTimeModel(a_s=PRIOR_STEP_BASE_S, b_s_per_token=PRIOR_STEP_S_PER_TOKEN, c_s_per_slot=PRIOR_STEP_S_PER_SLOT),
)
# A GPU whose worker did not report its memory: plan as for an 80 GB H100 (the profile's fit then decides).
DEFAULT_GPU_BYTES = 80 * 2**30


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
    unschedulable: tuple[str, ...]  # pending trials no GPU set can hold (memory) or load (the model) now
    makespan: int
    objective: int
    solve_s: float
    status: str  # "optimal" | "feasible" | "greedy_fallback"
    # Running members' completions (units) after this plan's back-fills: only for packs given with `members`.
    running_completion: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Member:
    """A pack member as the completion arithmetic sees it: steps left and its step-time item (SCALE-ths)."""

    trial_id: str
    steps: int
    item: int
    weight: int


# A legacy running pack's load stays for every member's whole duration: a member that never leaves.
NEVER = 2**62


def completions(base: int, members: Sequence[Member]) -> dict[str, int]:
    """Units from the pack's start until each member's last step: ceil((n_t·base + Σ_u item_u·min(n_u, n_t)) /
    SCALE), never 0 (remaining work always takes time). Members of `steps == NEVER` stay to the end and get no
    completion. O(m log m): members sorted by steps, prefix sums of item·steps, suffix sums of item."""
    ordered = sorted(members, key=lambda m: m.steps)
    suffix = [0] * (len(ordered) + 1)
    for i in range(len(ordered) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + ordered[i].item
    out: dict[str, int] = {}
    done = 0  # Σ item·steps of the members before i (all shorter or equal)
    i = 0
    while i < len(ordered):
        n = ordered[i].steps
        j = i
        while j < len(ordered) and ordered[j].steps == n:  # equal steps: all leave together
            j += 1
        if n < NEVER:
            milli = n * base + done + n * suffix[i]
            for m in ordered[i:j]:
                out[m.trial_id] = max(1, -(-milli // SCALE))
        done += sum(m.item * m.steps for m in ordered[i:j])
        i = j
    return out


class Prepared:
    """Integer coefficients shared by the CP-SAT model, the greedy packer and the result."""

    def __init__(self, inp: PlanningInput) -> None:
        self.inp = inp
        self.gpu_mem = {g.gpu_id: g.memory_bytes for g in inp.gpus}
        self._memories = sorted(g.memory_bytes for g in inp.gpus)  # for counting the GPUs that hold a trial
        self._gpu_models = {g.gpu_id: g.models for g in inp.gpus}
        self._restricted = any(g.models is not None for g in inp.gpus)  # some GPU loads only some models
        placeable = [self._placeable(t) for t in inp.trials]
        self.trials = [t for t, ok in zip(inp.trials, placeable, strict=True) if ok]
        self.unschedulable = tuple(t.trial_id for t, ok in zip(inp.trials, placeable, strict=True) if not ok)
        self._items: dict[str, int] = {}
        self._priority: list[PlanTrial] | None = None

    def _cost(self, model: str) -> ModelCost:
        return self.inp.costs[model]

    def _placeable(self, t: PlanTrial) -> bool:
        if t.base_model not in self.inp.costs or t.remaining_steps <= 0 or t.gpus_needed < 1:
            return False
        if self.inp.tenant_quota.get(t.tenant_id, 1) < 1:
            return False
        solo = self.mem_base(t.base_model) + self.mem_item(t)
        if self._restricted:
            hold = sum(1 for g in self.inp.gpus if g.memory_bytes >= solo and self.loads(g.gpu_id, t.base_model))
            return hold >= t.gpus_needed
        return len(self._memories) - bisect.bisect_left(self._memories, solo) >= t.gpus_needed

    def loads(self, gpu_id: str, model: str) -> bool:
        """Whether the GPU's worker can load ``model`` (its heartbeat's models; None: every one)."""
        models = self._gpu_models[gpu_id]
        return models is None or model in models

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

    def _item(self, model: str, tokens: int) -> int:
        s = self._cost(model).step
        return math.ceil(s.b_s_per_token * tokens * self._kk()) + math.ceil(s.c_s_per_slot * self._kk())

    def step_item(self, t: PlanTrial) -> int:
        item = self._items.get(t.trial_id)
        if item is None:
            item = self._items[t.trial_id] = self._item(t.base_model, t.tokens_per_step)
        return item

    def step_running(self, r: RunningPack) -> int:
        """A legacy running pack's step with all its members (they are taken to stay until its end)."""
        s = self._cost(r.base_model).step
        return (self.step_base(r.base_model) + math.ceil(s.b_s_per_token * r.tokens_per_step * self._kk())
                + math.ceil(s.c_s_per_slot * self._kk()) * r.trials)

    def solo_milli(self, t: PlanTrial) -> int:
        """The trial's remaining time alone on its GPUs, in SCALE-ths of a unit (unrounded, for ordering)."""
        return t.remaining_steps * (self.step_base(t.base_model) + self.step_item(t))

    @staticmethod
    def duration(steps: int, step_milli: int) -> int:
        """Units for `steps` at `step_milli`: rounded up and never 0 (remaining work always takes time)."""
        return max(1, -(-steps * step_milli // SCALE))

    def member(self, t: PlanTrial) -> Member:
        return Member(t.trial_id, t.remaining_steps, self.step_item(t), t.tenant_weight)

    def running_members(self, r: RunningPack) -> list[Member]:
        """The running pack's own members; a legacy pack is one member that never leaves, of weight 0."""
        if not r.members:
            return [Member(f"{r.pack_id}#load", NEVER, self.step_running(r) - self.step_base(r.base_model), 0)]
        return [Member(m.trial_id, max(1, m.remaining_steps), self._item(r.base_model, m.tokens_per_step),
                       m.tenant_weight) for m in r.members]

    def pack_times(self, start: int, trials: Sequence[PlanTrial], running: RunningPack | None = None
                   ) -> tuple[dict[str, int], dict[str, int], int]:
        """(completion of each pending member, of each running member, the pack's end), all from now.

        `running` given: `trials` are back-filled into it at 0 (`start` must be 0).
        """
        model = running.base_model if running else trials[0].base_model
        own = self.running_members(running) if running else []
        comp = completions(self.step_base(model), [*own, *(self.member(t) for t in trials)])
        mine = {t.trial_id: start + comp[t.trial_id] for t in trials}
        theirs = {m.trial_id: comp[m.trial_id] for m in own if m.steps < NEVER}
        end = max([*mine.values(), *theirs.values(), *([self.running_end(running)] if running else [])])
        return mine, theirs, end

    def running_end(self, r: RunningPack) -> int:
        """When a running pack is predicted to end without back-fills: its `ends_at`, or later if its members
        say so (the exact model may round up past a caller's estimate)."""
        if not r.members:
            return r.ends_at
        return max(r.ends_at, *completions(self.step_base(r.base_model), self.running_members(r)).values())

    def durations(self, members: list[PlanTrial], base: int) -> dict[str, int]:
        """Units each member of a new pack needs from the pack's start (members leave when done)."""
        return completions(base, [self.member(t) for t in members])

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
            end = self.running_end(r)
            for g in r.gpu_ids:
                busy[g] = max(busy.get(g, 0), end)
        return busy

    def priority(self) -> list[PlanTrial]:
        """Pending trials by Smith's rule: shortest solo time per unit of weight first, oldest first on ties.

        On one machine this order minimises Σ weight·completion (Smith 1956); on identical parallel machines,
        list scheduling in it is the classic approximation for the same objective, and it is the order the
        CP-SAT model's leaders follow. Heavier tenants' trials count as proportionally shorter, so a tenant's
        weight buys earlier starts, not exclusivity.
        """
        # Cross-multiplied comparison would be exact; a float ratio of two exact integers is close enough to
        # only ever swap trials whose keys agree to ~1e-16, and ties fall back to the input (arrival) order.
        if self._priority is None:
            self._priority = sorted(self.trials, key=lambda t: self.solo_milli(t) / t.tenant_weight)
        return list(self._priority)


def finish_plan(prep: Prepared, packs: list[ScheduledPack], solve_s: float, status: str) -> PlanResult:
    """Recomputes completions from the packs with the shared arithmetic and scores the objective:
    `makespan_weight·makespan + Σ weight·completion` over pending trials and exactly modelled running members."""
    by_id = {t.trial_id: t for t in prep.trials}
    running = {r.pack_id: r for r in prep.inp.running}
    completion: dict[str, int] = {}
    theirs: dict[str, int] = {}
    ends: list[int] = []
    timed: list[ScheduledPack] = []
    filled: set[str] = set()
    for p in packs:
        r = running[p.pack_key] if p.backfill else None
        mine, own, end = prep.pack_times(p.start, [by_id[i] for i in p.trial_ids], r)
        completion.update(mine)
        theirs.update(own)
        ends.append(end)
        if r:
            filled.add(r.pack_id)
        timed.append(replace(p, end=max(mine.values())))
    for r in prep.inp.running:
        if r.pack_id not in filled:
            _, own, end = prep.pack_times(0, [], r)
            theirs.update(own)
            ends.append(end)
    makespan = max([*completion.values(), *ends, 0])
    weights = {t.trial_id: t.tenant_weight for t in prep.trials}
    weights.update({m.trial_id: m.tenant_weight for r in prep.inp.running for m in r.members})
    objective = prep.inp.makespan_weight * makespan + sum(weights[i] * c for i, c in (completion | theirs).items())
    ordered = tuple(sorted(timed, key=lambda p: (p.start, p.pack_key)))
    return PlanResult(
        packs=ordered, start_now=tuple(p for p in ordered if p.start == 0 or p.backfill), completion=completion,
        unschedulable=prep.unschedulable, makespan=makespan, objective=objective, solve_s=solve_s, status=status,
        running_completion=theirs,
    )


def work_conserving(inp: PlanningInput, result: PlanResult) -> PlanResult:
    """The plan with no GPU left idle now while a pack waits for later: each GPU free now that the plan gives
    nothing to takes the earliest later single-GPU pack that fits its memory and its tenants' quotas, started
    now. Never later for the pack moved (it starts now instead of at its planned start) and never later for the
    others (the GPU it leaves is only freed); the solver's cost model may still score the result worse (it
    prefers to wait where packing buys nothing in it), which is why this is a rule outside the solver."""
    prep = Prepared(inp)
    busy = prep.fixed_busy()
    taken = {g for p in result.start_now if not p.backfill for g in p.gpu_ids}
    idle = [g for g in inp.gpus if busy.get(g.gpu_id, 0) == 0 and g.gpu_id not in taken]
    later = sorted((p for p in result.packs if not p.backfill and p.start > 0 and len(p.gpu_ids) == 1),
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
            if (p.pack_key in moved or not prep.loads(gpu.gpu_id, p.base_model)
                    or prep.mem_base(p.base_model) + sum(prep.mem_item(t) for t in members) > gpu.memory_bytes
                    or any((cap := prep.quota_cap(tenant)) is not None and running_now[tenant] + n > cap
                           for tenant, n in adds.items())):
                continue
            running_now.update(adds)
            moved[p.pack_key] = replace(p, gpu_ids=(gpu.gpu_id,), start=0)
            break
    if not moved:
        return result
    return finish_plan(prep, [moved.get(p.pack_key, p) for p in result.packs], result.solve_s, result.status)


def _tenant_trials_now(inp: PlanningInput, result: PlanResult, by_id: Mapping[str, PlanTrial]) -> Counter[str]:
    """Trials per tenant running now, and once the plan's first wave has started."""
    running_now: Counter[str] = Counter()
    for r in inp.running:
        for tenant, n in r.tenant_trials:
            running_now[tenant] += n
    running_now.update(by_id[i].tenant_id for p in result.start_now for i in p.trial_ids)
    return running_now


def fill_now(inp: PlanningInput, result: PlanResult, models: Collection[str]) -> PlanResult:
    """The plan with no trial of a base model in `models` held for a later pack while a new pack of its model
    starting now has room: each such pack takes, earliest-planned first, the trials of its model and GPU count that
    the plan starts later, within its cap, its GPUs' memory and its tenants' quotas.

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
        room = min(prep.gpu_mem[g] for g in p.gpu_ids) - prep.mem_base(p.base_model)
        room -= sum(prep.mem_item(t) for t in members)
        cap = min(t.max_trials_per_pack for t in members)
        added: list[str] = []
        for q in later:
            if q.base_model != p.base_model or len(q.gpu_ids) != len(p.gpu_ids):
                continue
            for t in (by_id[i] for i in q.trial_ids if i not in moved):
                quota = prep.quota_cap(t.tenant_id)
                if (len(members) + len(added) + 1 > min(cap, t.max_trials_per_pack) or prep.mem_item(t) > room
                        or (quota is not None and running_now[t.tenant_id] + 1 > quota)):
                    continue
                cap = min(cap, t.max_trials_per_pack)
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
