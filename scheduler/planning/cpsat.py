"""The CP-SAT planner: which pending trials share a pack, on which worker(s), starting when.

docs/ARCHITECTURE.md ("A task's way through the system") says where it sits in the daemon.

Pure: `plan_cpsat(PlanningInput) -> PlanResult`, no I/O. ALTO §7.2 (Table 1) schedules rigid multi-GPU
tasks for makespan; PLoRA §6 adds the packing (configuration → job); tLoRA §3.4 lets trials of different
tasks and tenants share one backbone. Here the three are one model:

- candidate packs per (base model, `gpus_needed`): pack j holds pending trial j as its lowest-index member or is
  empty (bin-packing symmetry breaking: n trials need n(n+1)/2 membership literals, not n²), and holds at most
  each member's `max_trials_per_pack` (the papers' Z);
- a pack is one start and duration on k workers chosen together (k = `gpus_needed`: 1 in the service; the
  simulator's workers are single GPUs), among those that can load its model: an optional interval per
  (pack, worker) and `NoOverlap` per worker, with busy workers and running packs as intervals
  from 0;
- step time `a + b·tokens + c·slots` is linear in membership and a member leaves when its steps are done, so
  every trial's completion `start + n_t·a + Σ_u item_u·min(n_u, n_t)` is linear too (coefficients.py);
- back-fill puts a pending trial into a running pack's free slot, starting now; with the pack's members known,
  their delayed completions count in the objective, so a back-fill pays for the members it slows;
- per-tenant quotas (max concurrent trials) are `Cumulative` constraints over trial intervals.
Objective: makespan_weight·makespan + Σ tenant_weight·completion. Candidate packs follow Smith's order
(`Prepared.priority`), so a candidate's leader is its highest-priority member, as in the greedy plan that
seeds the search. All integer arithmetic is in
`coefficients.Prepared`, shared with `greedy.plan_greedy`; the reported schedule is recomputed with it from
the solver's choices, so the model, the fallback and the brute-force tests agree exactly.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ortools.sat.python import cp_model

from scheduler.planning.coefficients import NEVER, SCALE, Member, Prepared, finish_plan
from scheduler.planning.greedy import plan_greedy
from scheduler.planning.types import PendingTrial, PlanningInput, PlanResult, RunningPack, ScheduledPack

# The solver gets what is left of the call's time limit after the greedy plan and the model are built, less this
# margin for reading the solution back, so that a call with a limit of 1 s returns within about 1 s.
EXTRACT_MARGIN_S = 0.02


def plan_cpsat(inp: PlanningInput, *, time_limit_s: float = 1.0, seed: int = 0, num_workers: int = 1) -> PlanResult:
    """Best plan CP-SAT finds within `time_limit_s` (the whole call, building included); the greedy plan
    when the model is too big, the time is gone before the solve, or the solver found nothing.

    The greedy plan also seeds the search (a hint) and bounds the objective, so a timed-out solve is never
    worse than the fallback. `num_workers=1` with a fixed `seed` and a deterministic time limit makes the
    plan reproducible when the deterministic limit is what stops the search; more workers search faster but
    the result may then depend on timing.
    """
    t0 = time.perf_counter()
    prep = Prepared(inp)
    groups: dict[tuple[str, int], list[PendingTrial]] = {}
    for t in prep.priority():
        groups.setdefault((t.base_model, t.gpus_needed), []).append(t)
    n_intervals = sum(len(ts) for ts in groups.values()) * len(inp.workers) + len(prep.trials)
    greedy = plan_greedy(inp)
    if not prep.trials:  # nothing to decide: the empty plan is trivially optimal
        return replace(greedy, solve_s=time.perf_counter() - t0, status="optimal")
    terms = sum(len(ts) * len(ts) * (len(ts) + 1) // 2 for ts in groups.values())
    if n_intervals > inp.max_interval_vars or terms > inp.max_pack_terms:
        return replace(greedy, solve_s=time.perf_counter() - t0)
    built = _Model(prep, groups, greedy)
    left = time_limit_s - (time.perf_counter() - t0) - EXTRACT_MARGIN_S
    if left <= 0:
        return replace(greedy, solve_s=time.perf_counter() - t0)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = left
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = num_workers
    status = solver.solve(built.m)
    if status not in _STATUS:
        return replace(greedy, solve_s=time.perf_counter() - t0)
    return finish_plan(prep, built.extract(solver), time.perf_counter() - t0, _STATUS[status])


_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible"}


def _first_steps(prep: Prepared, n: int, base: int, own: list[Member],
                 fills: list[tuple[PendingTrial, cp_model.IntVar]]) -> cp_model.LinearExprT:
    """SCALE·(time of a running pack's first n steps from now): the shared cost every step, each of its own
    members' items while they are in, each chosen back-fill's item while it is in."""
    return n * base + sum(i.item * min(i.steps, n) for i in own) + sum(
        prep.step_item(u) * min(u.remaining_steps, n) * v for u, v in fills)


class _Model:
    """The CP-SAT model of one planning input; see the module docstring for the formulation."""

    def __init__(self, prep: Prepared, groups: dict[tuple[str, int], list[PendingTrial]], greedy: PlanResult) -> None:
        self.prep, self.m = prep, cp_model.CpModel()
        m, inp = self.m, prep.inp
        self.fixed = prep.fixed_busy()
        # Any optimal plan's makespan and completions are ≤ its objective ≤ the greedy plan's objective.
        self.h = h = max(greedy.objective, *self.fixed.values(), 1) + 1
        self.comp = {t.trial_id: m.new_int_var(1, h, f"C_{t.trial_id}") for t in prep.trials}
        self.st = {t.trial_id: m.new_int_var(0, h, f"st_{t.trial_id}") for t in prep.trials}
        # Gathered while the packs are modelled, constrained at the end:
        # NoOverlap per worker:
        self.on_worker: dict[str, list[cp_model.IntervalVar]] = {g.worker_id: [] for g in inp.workers}
        self.placed: dict[str, list[cp_model.IntVar]] = {t.trial_id: [] for t in prep.trials}  # exactly one each
        self.by_tenant: dict[str, list[tuple[cp_model.IntervalVar, int]]] = {}  # (interval, trials): quotas
        self.ends: list[cp_model.IntVar] = []  # running packs' ends, in the makespan
        self.weighted: list[tuple[int, cp_model.IntVar]] = []  # running members' completions, in the objective
        self.cold: list[cp_model.IntVar] = []  # a new pack on a GPU that must load a model another holds warm
        # New packs, one candidate per (group, leader).
        self.span: dict[str, tuple[cp_model.IntVar, cp_model.IntVar]] = {}
        self.packs: list[tuple[PendingTrial, list[tuple[PendingTrial, cp_model.IntVar]], cp_model.IntVar,
                               dict[str, cp_model.IntVar]]] = []
        for (model, k), ts in groups.items():
            for j in range(len(ts)):
                self._new_pack(model, k, ts[j:])
        # Running packs: kept where they are, back-filled with pending trials that fit.
        self.fills: list[tuple[RunningPack, list[tuple[PendingTrial, cp_model.IntVar]]]] = []
        self.members: dict[str, cp_model.IntVar] = {}  # running members' completions (exactly modelled packs)
        for r in inp.running:
            self._running_pack(r)
        self._no_overlap()
        self._each_trial_placed_once()
        self._quotas()
        self._objective(greedy)
        self._hint(greedy)

    def _new_pack(self, model: str, k: int, ts: list[PendingTrial]) -> None:
        """The candidate pack led by ts[0], which the trials after it in its group may join."""
        m, lead = self.m, ts[0]
        members = [(t, m.new_bool_var(f"x_{t.trial_id}_{lead.trial_id}")) for t in ts]
        used = members[0][1]
        s, d, e = (m.new_int_var(0, self.h, f"{n}_{lead.trial_id}") for n in "SDE")
        m.add(e == s + d)
        y = self._pack_workers(model, k, members, used, (s, d, e))
        self._pack_completions(model, members, used, s, e)
        self.packs.append((lead, members, s, y))
        self.span[lead.trial_id] = (d, e)

    def _pack_workers(self, model: str, k: int, members: list[tuple[PendingTrial, cp_model.IntVar]],
                   used: cp_model.IntVar, sde: tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar]
                   ) -> dict[str, cp_model.IntVar]:
        """A used pack takes k GPUs together for its whole span, each with memory for its base and members."""
        m, prep, lead = self.m, self.prep, members[0][0]
        base_mem = prep.mem_base(model)
        # Only GPUs that hold its leader and whose worker can load the model (its heartbeat says).
        workers = [g for g in prep.inp.workers
                if g.memory_bytes >= base_mem + prep.mem_item(lead) and prep.loads(g.worker_id, model)]
        y = {g.worker_id: m.new_bool_var(f"y_{lead.trial_id}_{g.worker_id}") for g in workers}
        m.add(sum(y.values()) == k * used)
        self.cold.extend(y[g.worker_id] for g in workers if prep.cold(g.worker_id, model))
        for g in workers:
            self.on_worker[g.worker_id].append(m.new_optional_interval_var(*sde, y[g.worker_id], "p"))
            m.add(base_mem + sum(prep.mem_item(t) * x for t, x in members) <= g.memory_bytes
                  ).only_enforce_if(y[g.worker_id])
        return y

    def _pack_completions(self, model: str, members: list[tuple[PendingTrial, cp_model.IntVar]],
                          used: cp_model.IntVar, s: cp_model.IntVar, e: cp_model.IntVar) -> None:
        """Each member's cap on the pack's size, and its completion: after its steps, within the pack's span."""
        m, prep = self.m, self.prep
        base_step = prep.step_base(model)
        for t, x in members:
            m.add_implication(x, used)
            self.placed[t.trial_id].append(x)
            c, n = self.comp[t.trial_id], t.remaining_steps
            m.add(sum(x2 for _, x2 in members) <= t.max_trials_per_pack).only_enforce_if(x)
            # Its first n steps: the shared base each step, each member's item while both are in.
            work = n * base_step + sum(prep.step_item(u) * min(u.remaining_steps, n) * xu for u, xu in members)
            m.add(SCALE * c >= SCALE * s + work).only_enforce_if(x)
            m.add(c >= s + 1).only_enforce_if(x)
            m.add(e >= c).only_enforce_if(x)
            m.add(self.st[t.trial_id] == s).only_enforce_if(x)

    def _running_pack(self, r: RunningPack) -> None:
        """A running pack where it is: its GPUs held until its end, its members' completions and quota, and the
        pending trials that may back-fill it."""
        m, prep = self.m, self.prep
        e_r = m.new_int_var(prep.running_end(r), self.h, f"E_{r.pack_id}")
        self.ends.append(e_r)
        for gid in r.worker_ids:
            # The GPU is taken until the pack ends or its own busy_until, whichever is later.
            occ = m.new_int_var(0, self.h, f"occ_{gid}")
            m.add_max_equality(occ, [e_r, self.fixed[gid]])
            self.on_worker[gid].append(m.new_interval_var(0, occ, occ, f"held_{gid}"))
        z = [(t, m.new_bool_var(f"z_{t.trial_id}_{r.pack_id}")) for t in prep.trials if prep.compatible(t, r)]
        own = prep.running_members(r)  # a legacy pack: one member that never leaves
        base_r = prep.step_base(r.base_model)
        for i in own:
            if i.steps >= NEVER:
                continue
            c_i = m.new_int_var(1, self.h, f"C_{i.trial_id}")
            m.add(SCALE * c_i >= _first_steps(prep, i.steps, base_r, own, z))
            m.add(e_r >= c_i)
            self.members[i.trial_id] = c_i
            self.weighted.append((i.weight, c_i))
        self._running_quota(r)
        if z:
            self._backfills(r, e_r, base_r, own, z)

    def _running_quota(self, r: RunningPack) -> None:
        """The running pack's own trials in their tenants' quotas."""
        m = self.m
        if r.members:
            # Its members hold their tenants' quota until they end, later if a back-fill slows them.
            for mem in r.members:
                c_i = self.members[mem.trial_id]
                self.by_tenant.setdefault(mem.tenant_id, []).append((m.new_interval_var(0, c_i, c_i, "own"), 1))
        else:
            # Its own trials end at ends_at even if back-filled trials keep the pack running longer.
            own_iv = m.new_fixed_size_interval_var(0, r.ends_at, f"own_{r.pack_id}")
            for ten, n in r.tenant_trials:
                self.by_tenant.setdefault(ten, []).append((own_iv, n))

    def _backfills(self, r: RunningPack, e_r: cp_model.IntVar, base_r: int, own: list[Member],
                   z: list[tuple[PendingTrial, cp_model.IntVar]]) -> None:
        """Back-fills of the running pack: within its free slots, caps and memory, starting now, done by its end."""
        m, prep = self.m, self.prep
        n_fill = sum(v for _, v in z)
        m.add(n_fill <= min(r.free_slots, r.max_trials_per_pack - r.trials))
        # Only the additions are constrained: a running pack the model thinks over-full still runs.
        room = max(0, min(prep.worker_mem[gid] for gid in r.worker_ids) - prep.mem_running(r))
        m.add(sum(prep.mem_item(t) * v for t, v in z) <= room)
        for t, v in z:
            self.placed[t.trial_id].append(v)
            m.add(r.trials + n_fill <= t.max_trials_per_pack).only_enforce_if(v)
            m.add(SCALE * self.comp[t.trial_id] >= _first_steps(prep, t.remaining_steps, base_r, own, z)
                  ).only_enforce_if(v)
            m.add(e_r >= self.comp[t.trial_id]).only_enforce_if(v)
            m.add(self.st[t.trial_id] == 0).only_enforce_if(v)
        self.fills.append((r, z))

    def _no_overlap(self) -> None:
        """One pack at a time on each GPU, a busy GPU (not a running pack's) taken until its busy_until."""
        m, inp = self.m, self.prep.inp
        for g in inp.workers:
            if g.busy_until > 0 and not any(g.worker_id in r.worker_ids for r in inp.running):
                self.on_worker[g.worker_id].append(m.new_fixed_size_interval_var(0, g.busy_until, "busy"))
            m.add_no_overlap(self.on_worker[g.worker_id])

    def _each_trial_placed_once(self) -> None:
        """Every pending trial in exactly one pack, new or running; its interval (start to completion) counts
        in its tenant's quota."""
        m = self.m
        for t in self.prep.trials:
            m.add_exactly_one(self.placed[t.trial_id])
            size = m.new_int_var(0, self.h, f"len_{t.trial_id}")
            iv = m.new_interval_var(self.st[t.trial_id], size, self.comp[t.trial_id], f"trial_{t.trial_id}")
            self.by_tenant.setdefault(t.tenant_id, []).append((iv, 1))

    def _quotas(self) -> None:
        """At most a tenant's quota of its trials at once."""
        for ten, ivs in self.by_tenant.items():
            quota = self.prep.quota_cap(ten)
            if quota is not None:
                self.m.add_cumulative([iv for iv, _ in ivs], [n for _, n in ivs], quota)

    def _objective(self, greedy: PlanResult) -> None:
        """Minimise makespan_weight·makespan + Σ weight·completion (running members' too), no worse than greedy;
        then, as a tie-breaker only, the new packs' GPUs that must load a model another GPU holds warm (the
        objective is scaled past their count, so no unit of it is ever traded for a warm GPU)."""
        m, prep = self.m, self.prep
        makespan = m.new_int_var(0, self.h, "makespan")
        m.add_max_equality(makespan, [*self.comp.values(), *self.ends])
        objective = prep.inp.makespan_weight * makespan + sum(
            t.tenant_weight * self.comp[t.trial_id] for t in prep.trials) + sum(w * c for w, c in self.weighted)
        m.add(objective <= greedy.objective)
        m.minimize((len(self.cold) + 1) * objective + sum(self.cold) if self.cold else objective)

    def _hint(self, greedy: PlanResult) -> None:
        """Starts the search from the greedy plan: each greedy pack is the candidate led by its first member in
        Smith's order (the candidates' order)."""
        rank = {t.trial_id: i for i, t in enumerate(self.prep.priority())}
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
                self.m.add_hint(v, p is not None and g in p.worker_ids)
        # A complete hint lets CP-SAT start from a feasible solution instead of repairing a partial one.
        start = {tid: (0 if p.backfill else p.start) for p in greedy.packs for tid in p.trial_ids}
        for tid, c in self.comp.items():
            self.m.add_hint(c, greedy.completion[tid])
            self.m.add_hint(self.st[tid], start[tid])
        for tid, c in self.members.items():
            self.m.add_hint(c, greedy.running_completion[tid])
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
                out.append(ScheduledPack(r.pack_id, r.worker_ids, r.base_model, tuple(trials), 0, 0, backfill=True))
        return out
