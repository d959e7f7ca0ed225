"""How close a simulated schedule is to what any policy could reach on its trace (pure, no I/O; issue 54).

Two lower bounds that no planner can beat, whatever it packs or preempts, and one measure of weighted fairness:

- `makespan_lower_bound`: the last arrival plus its solo time, or any arrival plus all work arriving from then on
  spread over every GPU, whichever is larger;
- `mean_jct_lower_bound`: each task's solo time, or the flow time of preemptive shortest-remaining-work-first on one
  machine as fast as all the GPUs together, whichever is larger;
- `share_deviations` / `share_gap_max`: per window in which two or more tenants are backlogged throughout, how far
  each one's GPU time is from its weighted share among them.

Both bounds price a trial's step by the trace's cost model `a + b·tokens + c·slots`: alone, a trial pays the whole
step; packed, at best only its own `b·tokens + c` (the shared `a` split among ever more members), so its "work" is
`steps·(b·tokens + c)` GPU seconds per GPU it needs. `loraplane simulate --json` prints them beside each policy.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from scheduler.planning.fairness import usage_in_window
from scheduler.sim.traces import Trace, TraceTask

if TYPE_CHECKING:
    from scheduler.sim.simulate import SimResult

SHARE_SAMPLE_S = 60.0  # how often a window is sampled for which tenants have work waiting or running


def _solo_s(trace: Trace, task: TraceTask) -> float:
    """The task's longest trial alone on its GPUs: no schedule finishes the task sooner after it arrives."""
    step = trace.costs[task.base_model].step
    return max(tr.steps * step.predict(tr.tokens_per_step, 1) for tr in task.trials)


def _work_s(trace: Trace, task: TraceTask) -> float:
    """The task's GPU seconds at the best any packing can do (each member pays only its own share of a step)."""
    step = trace.costs[task.base_model].step
    return sum(task.gpus_needed * tr.steps * (step.b_s_per_token * tr.tokens_per_step + step.c_s_per_slot)
               for tr in task.trials)


def makespan_lower_bound(trace: Trace, gpus: int) -> float:
    """A lower bound on the makespan (first arrival to last completion, as `SimResult.makespan_s`) of any policy on
    ``trace`` with ``gpus`` GPUs: each task ends no sooner than its arrival plus its solo time, and the work that
    arrives at or after any instant takes at least its GPU seconds over ``gpus`` from that instant."""
    if not trace.tasks:
        return 0.0
    first = min(t.arrival_s for t in trace.tasks)
    solo = max(t.arrival_s + _solo_s(trace, t) for t in trace.tasks)
    spread, after = 0.0, 0.0
    for task in sorted(trace.tasks, key=lambda t: t.arrival_s, reverse=True):
        after += _work_s(trace, task)
        spread = max(spread, task.arrival_s + after / gpus)
    return max(solo, spread) - first


def mean_jct_lower_bound(trace: Trace, gpus: int) -> float:
    """A lower bound on the mean JCT that any policy can reach on `trace` with `gpus` GPUs.

    Two bounds, each valid alone, the larger returned: (1) a job is never faster than alone (a pack's step
    `a + b·tokens + c·slots` only grows with members), so its JCT is at least its solo time; (2) however the
    GPUs are packed, a GPU does at most one second of per-member work `steps·(b·tokens + c)` per second (the
    shared `a` is free at best), so the schedule is no better than preemptive shortest-remaining-work-first on
    one machine `gpus` times as fast, which minimises the total flow time of such a machine. Tasks of several
    trials take their longest trial's solo time in (1) and their summed work in (2) (still lower bounds).
    """
    if not trace.tasks:
        return 0.0
    solo = [_solo_s(trace, task) for task in trace.tasks]
    work = [_work_s(trace, task) for task in trace.tasks]
    arrival = [task.arrival_s for task in trace.tasks]
    # Preemptive SRPT on one machine of speed `gpus`: event by event, always the least remaining work.
    order = sorted(range(len(work)), key=lambda i: arrival[i])
    queue: list[list[float]] = []  # heap of [remaining work, arrival]
    now, flow, k = 0.0, 0.0, 0
    while k < len(order) or queue:
        if not queue:
            now = max(now, arrival[order[k]])
        while k < len(order) and arrival[order[k]] <= now:
            heapq.heappush(queue, [work[order[k]], arrival[order[k]]])
            k += 1
        nxt = arrival[order[k]] if k < len(order) else math.inf
        finish = now + queue[0][0] / gpus
        if finish <= nxt:
            flow += finish - heapq.heappop(queue)[1]
            now = finish
        else:
            queue[0][0] -= (nxt - now) * gpus
            now = nxt
    return max(sum(solo), flow) / len(trace.tasks)


def share_deviations(trace: Trace, result: SimResult, window_s: float,
                     sample_s: float = SHARE_SAMPLE_S) -> list[float]:
    """Per window of ``window_s`` (from time 0) in which two or more tenants had work waiting or running at every
    sample (each ``sample_s``): the largest |share − target| / target among them, where a tenant's share is its part
    of their GPU seconds in the window and its target its weight's part of their weights."""
    tenant_of = {tr.trial_id: t.tenant_id for t in trace.tasks for tr in t.trials}
    weights = {t.tenant_id: t.tenant_weight for t in trace.tasks}
    busy: dict[str, list[tuple[float, float]]] = {}
    for t in trace.tasks:
        busy.setdefault(t.tenant_id, []).append(
            (t.arrival_s, max(result.completed_s.get(tr.trial_id, math.inf) for tr in t.trials)))
    segments = []
    for p in result.packs:
        for (start, members), (end, _) in zip(p.members, p.members[1:], strict=False):
            tenants: dict[str, int] = {}
            for i in members:
                tenants[tenant_of[i]] = tenants.get(tenant_of[i], 0) + 1
            segments.append((start, end, float(len(p.worker_ids)), tenants))
    deviations = []
    end = max(result.completed_s.values(), default=0.0)
    k = 1
    while k * window_s <= end:
        lo, hi = (k - 1) * window_s, k * window_s
        samples = [lo + j * sample_s for j in range(int(window_s / sample_s) + 1)]
        backlogged = [t for t, spans in busy.items() if all(any(a <= x <= b for a, b in spans) for x in samples)]
        usage = usage_in_window(segments, hi, window_s)
        total, weight = sum(usage.get(t, 0.0) for t in backlogged), sum(weights[t] for t in backlogged)
        if len(backlogged) >= 2 and total > 0:
            deviations.append(max(abs(usage.get(t, 0.0) / total - weights[t] / weight) / (weights[t] / weight)
                                  for t in backlogged))
        k += 1
    return deviations


def share_gap_max(trace: Trace, result: SimResult, window_s: float) -> float | None:
    """The largest of `share_deviations` (None: no window had two tenants backlogged throughout)."""
    return max(share_deviations(trace, result, window_s), default=None)


def bounded_summary(trace: Trace, gpus: int, result: SimResult, window_s: float) -> dict[str, object]:
    """`SimResult.summary` with the trace's two bounds and the run's `share_gap_max` over windows of ``window_s``:
    the JSON object of `loraplane simulate --json`."""
    gap = share_gap_max(trace, result, window_s)
    return {**result.summary(), "makespan_lower_bound_s": round(makespan_lower_bound(trace, gpus), 3),
            "mean_jct_lower_bound_s": round(mean_jct_lower_bound(trace, gpus), 3),
            "share_gap_max": None if gap is None else round(gap, 4)}
