"""The integer coefficients every planner shares (pure): memory, step time and pack members' completions in
integer time units, and a plan's objective.

`Prepared` holds every coefficient in integer time units, so the CP-SAT model (cpsat.py), the greedy planner
(greedy.py) and the brute-force tests all compute the same durations; `finish_plan` recomputes a plan's
completions and objective with it.

How long a pack's members take. A pack steps all its members together, one step costing
`base + Σ item(u)` over the members still in it (the step-time model `a + b·tokens + c·slots`, split into the
shared `base = a` and each member's `item = b·tokens_u + c`), and a member leaves once its own steps are done.
So the first `n_t` steps of member t cost `n_t·base + Σ_u item(u)·min(n_u, n_t)`: a long member is slowed
by a short one only while they share the pack, and a short member by a long one for all of its own steps.
That sum is linear in membership, so the CP-SAT model states it exactly; it is what the simulator's clock
does too (scheduler/sim/simulate.py), up to the rounding of each coefficient up to a thousandth of a unit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.planning.cost import ModelCost
from scheduler.planning.types import PendingTrial, PlanningInput, PlanResult, RunningPack, ScheduledPack

SCALE = 1000  # step times are integer thousandths of a time unit, rounded up


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
        self.worker_mem = {g.worker_id: g.memory_bytes for g in inp.workers}
        self._memories = sorted(g.memory_bytes for g in inp.workers)  # for counting the workers that hold a trial
        self._worker_models = {g.worker_id: g.models for g in inp.workers}
        self._restricted = any(g.models is not None for g in inp.workers)  # some worker loads only some models
        self.warm_workers: dict[str, list[str]] = {}  # base model -> the workers holding it loaded
        for g in inp.workers:
            for model in sorted(g.warm):
                self.warm_workers.setdefault(model, []).append(g.worker_id)
        placeable = [self._placeable(t) for t in inp.trials]
        self.trials = [t for t, ok in zip(inp.trials, placeable, strict=True) if ok]
        self.unschedulable = tuple(t.trial_id for t, ok in zip(inp.trials, placeable, strict=True) if not ok)
        self._items: dict[str, int] = {}
        self._priority: list[PendingTrial] | None = None

    def _cost(self, model: str) -> ModelCost:
        return self.inp.costs[model]

    def _placeable(self, t: PendingTrial) -> bool:
        if t.base_model not in self.inp.costs or t.remaining_steps <= 0 or t.gpus_needed < 1:
            return False
        if self.inp.tenant_quota.get(t.tenant_id, 1) < 1:
            return False
        solo = self.mem_base(t.base_model) + self.mem_item(t)
        if self._restricted:
            hold = sum(1 for g in self.inp.workers if g.memory_bytes >= solo and self.loads(g.worker_id, t.base_model))
            return hold >= t.gpus_needed
        return len(self._memories) - bisect.bisect_left(self._memories, solo) >= t.gpus_needed

    def loads(self, worker_id: str, model: str) -> bool:
        """Whether the worker can load ``model`` (its heartbeat's models; None: every one)."""
        models = self._worker_models[worker_id]
        return models is None or model in models

    def cold(self, worker_id: str, model: str) -> bool:
        """Whether a pack of ``model`` on the worker would wait for it to load the model while another worker holds
        it warm: what the planners avoid, all else equal (no warm worker anywhere: no worker is cold)."""
        warm = self.warm_workers.get(model, [])
        return bool(warm) and worker_id not in warm

    # Memory: base + Σ items ≤ the worker's bytes. Each term is rounded up so the sum never under-estimates.
    def mem_base(self, model: str) -> int:
        return math.ceil(self._cost(model).memory.k0_bytes)

    def mem_item(self, t: PendingTrial) -> int:
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

    def step_item(self, t: PendingTrial) -> int:
        item = self._items.get(t.trial_id)
        if item is None:
            item = self._items[t.trial_id] = self._item(t.base_model, t.tokens_per_step)
        return item

    def step_running(self, r: RunningPack) -> int:
        """A legacy running pack's step with all its members (they are taken to stay until its end)."""
        s = self._cost(r.base_model).step
        return (self.step_base(r.base_model) + math.ceil(s.b_s_per_token * r.tokens_per_step * self._kk())
                + math.ceil(s.c_s_per_slot * self._kk()) * r.trials)

    def solo_milli(self, t: PendingTrial) -> int:
        """The trial's remaining time alone on its workers, in SCALE-ths of a unit (unrounded, for ordering)."""
        return t.remaining_steps * (self.step_base(t.base_model) + self.step_item(t))

    @staticmethod
    def duration(steps: int, step_milli: int) -> int:
        """Units for `steps` at `step_milli`: rounded up and never 0 (remaining work always takes time)."""
        return max(1, -(-steps * step_milli // SCALE))

    def member(self, t: PendingTrial) -> Member:
        return Member(t.trial_id, t.remaining_steps, self.step_item(t), t.tenant_weight)

    def running_members(self, r: RunningPack) -> list[Member]:
        """The running pack's own members; a legacy pack is one member that never leaves, of weight 0."""
        if not r.members:
            return [Member(f"{r.pack_id}#load", NEVER, self.step_running(r) - self.step_base(r.base_model), 0)]
        return [Member(m.trial_id, max(1, m.remaining_steps), self._item(r.base_model, m.tokens_per_step),
                       m.tenant_weight) for m in r.members]

    def pack_times(self, start: int, trials: Sequence[PendingTrial], running: RunningPack | None = None
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

    def durations(self, members: list[PendingTrial], base: int) -> dict[str, int]:
        """Units each member of a new pack needs from the pack's start (members leave when done)."""
        return completions(base, [self.member(t) for t in members])

    def quota_cap(self, tenant: str) -> int | None:
        q = self.inp.tenant_quota.get(tenant)
        if q is None:
            return None
        running = sum(n for r in self.inp.running for ten, n in r.tenant_trials if ten == tenant)
        # Already over quota (the quota was lowered): keep what runs, start nothing new beside it.
        return max(q, running)

    def compatible(self, t: PendingTrial, r: RunningPack) -> bool:
        return t.base_model == r.base_model and t.gpus_needed == len(r.worker_ids) and r.free_slots > 0

    def fixed_busy(self) -> dict[str, int]:
        """Worker -> time it is taken until by something the plan cannot move (busy or a running pack)."""
        busy = {g.worker_id: g.busy_until for g in self.inp.workers}
        for r in self.inp.running:
            end = self.running_end(r)
            for g in r.worker_ids:
                busy[g] = max(busy.get(g, 0), end)
        return busy

    def priority(self) -> list[PendingTrial]:
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
