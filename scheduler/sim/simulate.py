"""Trace-driven planner simulator: the real planners and cost model on a simulated clock (docs/ARCHITECTURE.md).

Pure except for `time.perf_counter`, which measures each planner call. Events are task arrivals, trial
completions and pack ends; after each batch of events at one instant the chosen policy replans from the
simulated state (pending trials, free GPUs, running packs with their predicted ends and free slots), and
the simulator starts what the plan starts now: new packs on free GPUs and back-fills into running packs.
A pack's members advance at its current step time `a + b·pooled tokens + c·slots` (the trace's cost model,
in exact seconds, not the planner's rounded units), recomputed whenever a member joins or leaves; a pack
ends when its last member completes and frees its GPUs.

Policies: `fifo` (each trial alone, strictly first come first served: the oldest waiting trial blocks the
ones behind it), `greedy` (`greedy.plan_greedy`), `cpsat` (`cpsat.plan_cpsat` with a time limit).
The planner is not called when nothing could start now (no pending trial, or no free GPU and no running pack
with a free slot for a pending trial's model): its plan could then start nothing, so skipping it is exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from scheduler.planning.coefficients import Prepared, finish_plan
from scheduler.planning.cost import ModelCost
from scheduler.planning.cpsat import plan_cpsat
from scheduler.planning.fairness import (
    FairnessPolicy,
    PackView,
    Preemption,
    WaitingTrial,
    past_slice,
    preemptions,
    usage_in_window,
)
from scheduler.planning.greedy import plan_greedy
from scheduler.planning.rules import work_conserving
from scheduler.planning.types import (
    PendingTrial,
    PlanningInput,
    PlanResult,
    RunningMember,
    RunningPack,
    ScheduledPack,
    WorkerSpec,
)
from scheduler.sim.traces import Trace, TraceTask

POLICIES = ("fifo", "greedy", "cpsat", "cpsat-wc")
# A preemption's cost in GPU time: the members' checkpoint, then the next pack's base model loaded (an 8B model's
# bf16 weights read from local NVMe at ~2 GB/s: ~8 s; its first step's CUDA-graph captures: ~10 s), rounded up.
PAUSE_COST_S = 30.0
Planner = Callable[[PlanningInput], PlanResult]
_REL_EPS = 1e-9  # relative tolerance of simulated times: events this close are one instant


def plan_fifo(inp: PlanningInput) -> PlanResult:
    """One trial per pack, oldest first, started now on the first free GPUs that hold it; the first trial that
    cannot start now blocks every later one (strict FCFS, no back-filling)."""
    t0 = time.perf_counter()
    prep = Prepared(inp)
    busy = prep.fixed_busy()
    free = [g for g in inp.workers if busy[g.worker_id] == 0]
    packs: list[ScheduledPack] = []
    for t in prep.trials:
        need = prep.mem_base(t.base_model) + prep.mem_item(t)
        fits = [g for g in free if g.memory_bytes >= need][: t.gpus_needed]
        if len(fits) < t.gpus_needed:
            break
        free = [g for g in free if g not in fits]
        packs.append(ScheduledPack(f"new-{t.trial_id}", tuple(g.worker_id for g in fits), t.base_model,
                                   (t.trial_id,), 0, 0))
    return finish_plan(prep, packs, time.perf_counter() - t0, "fifo")


def default_makespan_weight(trace: Trace) -> int:
    """1 for a batch (every task arrives at once: ALTO's mix, judged by its makespan), 0 for a stream.

    In a stream a replan's makespan is only when the work known so far would end; the next arrivals move it,
    and nobody is judged by it. Weighting it anyway pushes the plan to start the longest trial first (it ends
    last): measured on the tenant stream at load 1.5, CP-SAT then started a 2,158 s job ahead of 84-476 s ones
    to cut a replan's makespan by ~270 s, and its mean JCT was 494 s against 483 s with weight 0.
    """
    return 1 if len({t.arrival_s for t in trace.tasks}) <= 1 else 0


def make_planner(policy: str, *, time_limit_s: float = 1.0, seed: int = 0) -> Planner:
    if policy == "fifo":
        return plan_fifo
    if policy == "greedy":
        return plan_greedy
    if policy == "cpsat":
        return lambda inp: plan_cpsat(inp, time_limit_s=time_limit_s, seed=seed)
    if policy == "cpsat-wc":  # CP-SAT, then no GPU left idle now while a pack waits (rules.work_conserving)
        return lambda inp: work_conserving(inp, plan_cpsat(inp, time_limit_s=time_limit_s, seed=seed))
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")


@dataclass(frozen=True)
class PackRecord:
    """One pack's life: its GPUs, and its members after each change of membership."""

    pack_id: str
    worker_ids: tuple[str, ...]
    base_model: str
    start_s: float
    end_s: float
    members: tuple[tuple[float, tuple[str, ...]], ...]  # (time, trial ids running from then on)


@dataclass(frozen=True)
class SimResult:
    policy: str
    trace: str
    gpus: int
    makespan_s: float
    mean_jct_s: float
    p95_jct_s: float
    gpu_util: float
    replan_p95_ms: float
    replans: int
    unschedulable: tuple[str, ...]  # trial ids never placed (no GPU set holds them, or the planner stalled)
    statuses: dict[str, int]  # planner status -> count of calls
    started_s: dict[str, float]  # trial id -> when it started
    completed_s: dict[str, float]  # trial id -> when its last step finished
    steps_done: dict[str, float]  # trial id -> steps trained
    packs: tuple[PackRecord, ...]
    makespan_weight: int = 1  # the planner objective's weight of each replan's makespan
    preempted: int = 0  # packs preempted by the fairness policy (scheduler/planning/fairness.py)

    def summary(self) -> dict[str, object]:
        """The JSON object of `loraplane simulate --json`."""
        return {"policy": self.policy, "trace": self.trace, "gpus": self.gpus,
                "makespan_s": round(self.makespan_s, 3), "mean_jct_s": round(self.mean_jct_s, 3),
                "p95_jct_s": round(self.p95_jct_s, 3), "gpu_util": round(self.gpu_util, 4),
                "replan_p95_ms": round(self.replan_p95_ms, 3), "replans": self.replans,
                "unschedulable": len(self.unschedulable), "makespan_weight": self.makespan_weight,
                "preempted": self.preempted}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (`q` in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class _Pack:
    pack_id: str
    worker_ids: tuple[str, ...]
    base_model: str
    cost: ModelCost
    start_s: float
    since_s: float  # members' `left` steps are as of this time
    left: dict[str, float] = field(default_factory=dict)  # member trial id -> steps still to train
    history: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def step_s(self, trials: dict[str, PendingTrial]) -> float:
        tokens = sum(trials[i].tokens_per_step for i in self.left)
        return self.cost.step.predict(tokens, len(self.left))

    def next_completion(self, trials: dict[str, PendingTrial]) -> float:
        return self.since_s + min(self.left.values()) * self.step_s(trials)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_EPS * max(1.0, abs(a), abs(b))


def simulate(trace: Trace, gpus: int, policy: str, *, time_limit_s: float = 1.0, seed: int = 0,
             unit_s: float = 1.0, makespan_weight: int | None = None, planner: Planner | None = None,
             fairness: FairnessPolicy | None = None, pause_cost_s: float = PAUSE_COST_S) -> SimResult:
    """Runs `trace` on `gpus` identical GPUs under `policy` and measures it (see the module docstring).

    `unit_s` is the planner's integer time unit; its durations are rounded up and never 0, so it only
    coarsens the plan, never the simulated clock. `makespan_weight` is the weight of each replan's makespan
    in the planner's objective (beside Σ weight·completion); by default `default_makespan_weight(trace)`.
    `planner` overrides the policy's planner (tests). With `fairness`, a pack may be preempted for another
    tenant's waiting trials (scheduler/planning/fairness.py): its members go back to pending with the steps they
    have left, and its GPUs free up `pause_cost_s` later (a checkpoint, then the next base model loaded).
    """
    if gpus < 1:
        raise ValueError("gpus must be ≥ 1")
    if makespan_weight is None:
        makespan_weight = default_makespan_weight(trace)
    plan = planner or make_planner(policy, time_limit_s=time_limit_s, seed=seed)
    sim = _Sim(trace, gpus, plan, unit_s, makespan_weight, pause_cost_s)
    # Every loop turn but the last consumes an arrival, a completion, a release or a planned start (≥ 1 unit later).
    for _ in range(100 * (len(sim.trials) + len(sim.tasks)) + 1000):
        sim.arrive()
        sim.release()
        wake = (sim.replan() if sim.plannable() and _can_start(sim.plannable(), sim.trials, sim.free, sim.running)
                else None)
        if fairness is not None:
            due = sim.preempt(fairness)  # when a pack's slice ends while trials wait: decide again then
            wake = min((t for t in (wake, due) if t is not None), default=None)
        if not sim.advance(wake):
            # Nothing runs, arrives or is planned, yet trials wait: the planner will never place them.
            sim.unschedulable.extend(sim.pending)
            break
        sim.complete()
    else:
        raise RuntimeError("simulation did not converge (planner starts nothing while time advances)")
    return replace(_result(trace, gpus, policy, sim.tasks, sim.task_of, sim.done, sim.started, sim.completed,
                           sim.steps_done, sim.unschedulable, sim.replan_ms, sim.statuses),
                   makespan_weight=makespan_weight, preempted=sim.preempted)


class _Sim:
    """The simulated cluster at time `now`: pending trials, free GPUs, running packs, and what was measured."""

    def __init__(self, trace: Trace, gpus: int, plan: Planner, unit_s: float, makespan_weight: int,
                 pause_cost_s: float = 0.0) -> None:
        self.trace, self.plan, self.unit_s, self.makespan_weight = trace, plan, unit_s, makespan_weight
        self.pause_cost_s = pause_cost_s
        self.steps: dict[str, int] = {}  # trial id -> its steps in the trace (remaining_steps shrinks when paused)
        self.pauses: dict[str, int] = {}  # trial id -> times preempted
        self.held: dict[str, set[str]] = {}  # preempted trial -> the pending trials it made room for
        self.releasing: list[tuple[float, tuple[str, ...]]] = []  # (when, GPUs) of preempted packs
        self.preempted = 0
        self.worker_specs = tuple(WorkerSpec(f"gpu{i:04d}", trace.gpu_memory_bytes) for i in range(gpus))
        self.tasks = sorted(trace.tasks, key=lambda t: t.arrival_s)  # stable: trace order within an instant
        self.trials: dict[str, PendingTrial] = {}
        self.task_of: dict[str, str] = {}
        for task in self.tasks:
            for tr in task.trials:
                self.trials[tr.trial_id] = PendingTrial(
                    trial_id=tr.trial_id, task_id=task.task_id, tenant_id=task.tenant_id,
                    tenant_weight=task.tenant_weight, base_model=task.base_model, gpus_needed=task.gpus_needed,
                    tokens_per_step=tr.tokens_per_step, remaining_steps=tr.steps, slot_bytes=tr.slot_bytes,
                    max_trials_per_pack=tr.max_trials_per_pack)
                self.task_of[tr.trial_id] = task.task_id
                self.steps[tr.trial_id] = tr.steps
        self.pending: list[str] = []
        self.free = {g.worker_id for g in self.worker_specs}
        self.running: dict[str, _Pack] = {}
        self.done: list[_Pack] = []
        self.started: dict[str, float] = {}
        self.completed: dict[str, float] = {}
        self.steps_done: dict[str, float] = {}
        self.unschedulable: list[str] = []
        self.replan_ms: list[float] = []
        self.statuses: dict[str, int] = {}
        self.next_task, self.n_packs = 0, 0
        self.now = self.tasks[0].arrival_s if self.tasks else 0.0

    def arrive(self) -> None:
        """Makes the trials of every task that has arrived by now pending."""
        tasks, now = self.tasks, self.now
        while self.next_task < len(tasks) and (tasks[self.next_task].arrival_s <= now
                                               or _close(tasks[self.next_task].arrival_s, now)):
            self.pending.extend(tr.trial_id for tr in tasks[self.next_task].trials)
            self.next_task += 1

    def plannable(self) -> list[str]:
        """The pending trials the planner sees: all but preempted ones whose beneficiaries still wait."""
        return [i for i in self.pending if i not in self.held]

    def release(self) -> None:
        """Frees the GPUs of preempted packs whose pause is over, and hands preempted trials back to the planner
        once the trials they made room for have started (or left)."""
        now = self.now
        for when, worker_ids in [r for r in self.releasing if r[0] <= now or _close(r[0], now)]:
            self.releasing.remove((when, worker_ids))
            self.free |= set(worker_ids)
        pending = set(self.pending)
        for i in [i for i, waiting_for in self.held.items() if not waiting_for & pending]:
            del self.held[i]

    def preempt(self, policy: FairnessPolicy) -> float | None:
        """Preempts the packs the fairness policy names, if trials wait with no GPU free (fairness.py); returns when
        the next running pack's slice ends while trials still wait (None: none will)."""
        now, trials = self.now, self.trials
        waiting = self.plannable()
        if not waiting or self.free:
            return None
        views = [PackView(p.pack_id, len(p.worker_ids), now - p.start_s,
                          frozenset(trials[i].tenant_id for i in p.left),
                          tuple(self.pauses.get(i, 0) for i in p.left)) for p in self.running.values()]
        chosen: list[Preemption] = []
        if past_slice(views, policy):  # else the tenants' GPU time (every pack's history) need not be summed
            weights = {t.tenant_id: t.tenant_weight for t in self.trials.values()}
            chosen = preemptions(views, [WaitingTrial(i, trials[i].tenant_id, trials[i].gpus_needed)
                                         for i in waiting], self.usage(policy.window_s), weights, policy)
        for choice in chosen:
            pack = self.running.pop(choice.pack_id)
            _advance(pack, trials, now)
            beneficiaries = {i for i in waiting if trials[i].tenant_id == choice.for_tenant}
            for i, left in pack.left.items():
                trials[i] = replace(trials[i], remaining_steps=max(1, math.ceil(left - _REL_EPS * max(1.0, left))),
                                    resumed=True)
                self.pauses[i] = self.pauses.get(i, 0) + 1
                self.held[i] = beneficiaries
                self.pending.append(i)
            pack.left = {}
            pack.history.append((now + self.pause_cost_s, ()))  # the GPUs stay busy for the pause
            self.done.append(pack)
            self.releasing.append((now + self.pause_cost_s, pack.worker_ids))
            self.preempted += 1
        slices = [p.start_s + policy.min_slice_s for p in self.running.values()
                  if p.start_s + policy.min_slice_s > now and not _close(p.start_s + policy.min_slice_s, now)]
        return min(slices, default=None)

    def usage(self, window_s: float) -> dict[str, float]:
        """Each tenant's GPU seconds in the trailing window, from every pack's membership history."""
        segments = []
        for pack in [*self.done, *self.running.values()]:
            history = [*pack.history, (self.now, ())]
            for (start, members), (end, _) in zip(history, history[1:], strict=False):
                tenants: dict[str, int] = {}
                for i in members:
                    tenants[self.trials[i].tenant_id] = tenants.get(self.trials[i].tenant_id, 0) + 1
                segments.append((start, end, float(len(pack.worker_ids)), tenants))
        return usage_in_window(segments, self.now, window_s)

    def replan(self) -> float | None:
        """Calls the planner and starts what its plan starts now; returns when a start it holds back is due."""
        now, unit_s = self.now, self.unit_s
        # A preempted pack's GPUs are busy until its pause ends (its members' checkpoint, the next model's load).
        releasing = {w: max(1, math.ceil((when - now) / unit_s - _REL_EPS)) for when, ws in self.releasing for w in ws}
        workers = tuple(replace(w, busy_until=releasing[w.worker_id]) if w.worker_id in releasing else w
                        for w in self.worker_specs)
        inp = _planning_input(self.plannable(), self.trials, workers, self.free, self.running, self.trace, now,
                              unit_s, self.makespan_weight)
        t0 = time.perf_counter()
        res = self.plan(inp)
        self.replan_ms.append((time.perf_counter() - t0) * 1000)
        self.statuses[res.status] = self.statuses.get(res.status, 0) + 1
        gone = set(res.unschedulable)
        self.unschedulable.extend(i for i in self.pending if i in gone)
        placed = {i for p in res.start_now for i in p.trial_ids}
        for p in res.start_now:
            self._start(p)
        self.pending = [i for i in self.pending if i not in gone and i not in placed]
        # A plan may hold free GPUs back for a later start: wake up then, not only at the next completion.
        later = [p.start for p in res.packs if not p.backfill and p.start > 0 and set(p.worker_ids) <= self.free]
        return now + min(later) * unit_s if later else None

    def _start(self, p: ScheduledPack) -> None:
        """Starts a planned pack now on its free GPUs, or back-fills its trials into the running pack."""
        now, trials = self.now, self.trials
        if p.backfill:
            pack = self.running[p.pack_key]
            _advance(pack, trials, now)
        else:
            if not set(p.worker_ids) <= self.free or len(p.worker_ids) != trials[p.trial_ids[0]].gpus_needed:
                raise AssertionError(f"the planner started {p.pack_key} on GPUs that are not free")
            self.n_packs += 1
            pack = _Pack(f"pack{self.n_packs:05d}", p.worker_ids, p.base_model, self.trace.costs[p.base_model], now,
                         now)
            self.free -= set(p.worker_ids)
            self.running[pack.pack_id] = pack
        for i in p.trial_ids:
            pack.left[i] = float(trials[i].remaining_steps)
            self.started.setdefault(i, now)  # a preempted trial's start is its first
        pack.history.append((now, tuple(pack.left)))

    def advance(self, wake: float | None) -> bool:
        """Moves the clock to the next arrival, completion or `wake`, whichever is first; False if there is none."""
        candidates = [t for t in (
            self.tasks[self.next_task].arrival_s if self.next_task < len(self.tasks) else None,
            min((p.next_completion(self.trials) for p in self.running.values()), default=None),
            min((when for when, _ in self.releasing), default=None),
            wake,
        ) if t is not None]
        if not candidates:
            return False
        self.now = max(self.now, min(candidates))
        return True

    def complete(self) -> None:
        """Retires the members done by now, and ends the packs left without members (their GPUs free up)."""
        now, trials = self.now, self.trials
        for pack in [p for p in self.running.values() if p.next_completion(trials) <= now
                     or _close(p.next_completion(trials), now)]:
            _advance(pack, trials, now)
            finished = [i for i, left in pack.left.items() if left <= 1e-6 * max(1, trials[i].remaining_steps)]
            for i in finished:
                del pack.left[i]
                self.completed[i] = now
                self.steps_done[i] = float(self.steps[i])
            pack.history.append((now, tuple(pack.left)))
            if not pack.left:
                del self.running[pack.pack_id]
                self.free |= set(pack.worker_ids)
                self.done.append(pack)


def _advance(pack: _Pack, trials: dict[str, PendingTrial], now: float) -> None:
    """Moves the pack's members forward to `now` at its current step time."""
    if pack.left:
        steps = (now - pack.since_s) / pack.step_s(trials)
        pack.left = {i: left - steps for i, left in pack.left.items()}
    pack.since_s = now


def _can_start(pending: list[str], trials: dict[str, PendingTrial], free: set[str], running: dict[str, _Pack]) -> bool:
    if free:
        return True
    models = {trials[i].base_model for i in pending}
    return any(p.base_model in models and len(p.left) < min(trials[i].max_trials_per_pack for i in p.left)
               for p in running.values())


def _planning_input(pending: list[str], trials: dict[str, PendingTrial], worker_specs: tuple[WorkerSpec, ...],
                    free: set[str], running: dict[str, _Pack], trace: Trace, now: float, unit_s: float,
                    makespan_weight: int) -> PlanningInput:
    packs = []
    for pack in sorted(running.values(), key=lambda p: p.pack_id):
        _advance(pack, trials, now)
        members = [trials[i] for i in pack.left]
        max_trials_per_pack = min(t.max_trials_per_pack for t in members)
        tenants: dict[str, int] = {}
        for t in members:
            tenants[t.tenant_id] = tenants.get(t.tenant_id, 0) + 1
        # Members leave as they finish: the longest one ends after its steps at the shared cost plus every
        # member's own per-step cost for that member's steps (planning/coefficients.py, in exact seconds).
        step = pack.cost.step
        end_s = max(pack.left.values()) * step.a_s + sum(
            left * (step.b_s_per_token * trials[i].tokens_per_step + step.c_s_per_slot)
            for i, left in pack.left.items())
        packs.append(RunningPack(
            pack.pack_id, pack.worker_ids, pack.base_model, ends_at=max(1, math.ceil(end_s / unit_s - _REL_EPS)),
            trials=len(members), free_slots=max(0, max_trials_per_pack - len(members)),
            tokens_per_step=sum(t.tokens_per_step for t in members), slot_bytes=sum(t.slot_bytes for t in members),
            max_trials_per_pack=max_trials_per_pack, tenant_trials=tuple(sorted(tenants.items())),
            members=tuple(RunningMember(i, trials[i].tenant_id, trials[i].tenant_weight,
                                        max(1, math.ceil(left - _REL_EPS * max(1.0, left))), trials[i].tokens_per_step)
                          for i, left in pack.left.items()),
        ))
    return PlanningInput(trials=tuple(trials[i] for i in pending), workers=worker_specs, costs=trace.costs,
                         running=tuple(packs), unit_s=unit_s, makespan_weight=makespan_weight)


def _result(trace: Trace, gpus: int, policy: str, tasks: list[TraceTask], task_of: dict[str, str], done: list[_Pack],
            started: dict[str, float], completed: dict[str, float], steps_done: dict[str, float],
            unschedulable: list[str], replan_ms: list[float], statuses: dict[str, int]) -> SimResult:
    first = tasks[0].arrival_s if tasks else 0.0
    makespan = max(completed.values(), default=first) - first
    task_done: dict[str, float] = {}
    for i, c in completed.items():
        task_done[task_of[i]] = max(task_done.get(task_of[i], c), c)
    jcts = [task_done[t.task_id] - t.arrival_s for t in tasks if t.task_id in task_done]
    busy = sum((p.history[-1][0] - p.start_s) * len(p.worker_ids) for p in done)
    records = tuple(PackRecord(p.pack_id, p.worker_ids, p.base_model, p.start_s, p.history[-1][0], tuple(p.history))
                    for p in sorted(done, key=lambda p: p.pack_id))
    return SimResult(
        policy=policy, trace=trace.name, gpus=gpus, makespan_s=makespan,
        mean_jct_s=sum(jcts) / len(jcts) if jcts else 0.0, p95_jct_s=percentile(jcts, 95),
        gpu_util=busy / (gpus * makespan) if makespan > 0 else 0.0, replan_p95_ms=percentile(replan_ms, 95),
        replans=len(replan_ms), unschedulable=tuple(unschedulable), statuses=statuses, started_s=started,
        completed_s=completed, steps_done=steps_done, packs=records,
    )
