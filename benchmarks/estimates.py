"""How close the estimates are (issue 18): estimate / actual over the committed sweeps and the simulator's traces.

- Sweeps (`benchmarks/results/sweeps/*-full*.json`): each is one sweep's trials trained in one pack on one H100,
  with their steps and the measured `train_wall_s`. The estimate rebuilt for it is what the API would have said
  at submission on an idle one-GPU cluster before any SmolLM2 pack was profiled: the cost priors
  (scheduler/planning/cost.py `PRIOR_COST`), each trial's steps and batch x max_seq_len tokens per step.
- Traces (scheduler/sim/traces.py; scheduler/sim/simulate.py, greedy policy): each task's estimate at its arrival, on
  the trace's cluster with every GPU busy until its pack's end in the simulation (the "running packs' remaining
  time" the service reads, here exact), against the task's simulated completion (its last trial's end minus its
  arrival). The trace's cost model is the simulator's truth, so the spread is what the estimate does not model:
  the other tasks still pending, and how the planner shares GPUs among them.

    python -m benchmarks.estimates
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from scheduler.planning.cost import PRIOR_COST
from scheduler.planning.estimate import TrialLoad, UsableWorker, estimate
from scheduler.sim.simulate import SimResult, simulate
from scheduler.sim.traces import Trace, TraceTask, alto_mix, tenant_stream

SWEEPS = Path(__file__).resolve().parent / "results" / "sweeps"
H100_BYTES = 80 * 10**9


def sweep_row(path: Path) -> list[Any]:
    sweep = json.loads(path.read_text())
    seq = int(sweep["max_seq_len"])
    trials = [TrialLoad(int(r["steps"]), int(r["batch_size"]) * seq) for r in sweep["results"]]
    e = estimate(trials, PRIOR_COST, [UsableWorker(H100_BYTES)], max_trials_per_pack=32, on_priors=True)
    actual = float(sweep["train_wall_s"])
    assert e.wall_seconds is not None
    return [path.stem, len(trials), e.tokens, round(e.wall_seconds, 1), actual, round(e.wall_seconds / actual, 3), ""]


def _busy_at(sim: SimResult, worker_ids: list[str], t: float) -> list[UsableWorker]:
    """Each GPU busy until the end of the simulated pack that holds it at `t` (free: 0)."""
    until = dict.fromkeys(worker_ids, t)
    for p in sim.packs:
        if p.start_s <= t < p.end_s:
            for g in p.worker_ids:
                until[g] = max(until[g], p.end_s)
    return [UsableWorker(busy_for_s=until[g] - t) for g in worker_ids]


def trace_ratios(trace: Trace, gpus: int) -> list[float]:
    """estimate / simulated completion of each task of the trace."""
    sim = simulate(trace, gpus, "greedy")
    worker_ids = [f"gpu{i:04d}" for i in range(gpus)]  # the simulator's names
    ratios = []
    for task in trace.tasks:
        done = [sim.completed_s[t.trial_id] for t in task.trials if t.trial_id in sim.completed_s]
        if len(done) < len(task.trials):
            continue  # a trial the simulation never placed
        actual = max(done) - task.arrival_s
        e = _task_estimate(trace, task, _busy_at(sim, worker_ids, task.arrival_s))
        if e is not None and actual > 0:
            ratios.append(e / actual)
    return ratios


def _task_estimate(trace: Trace, task: TraceTask, gpus: list[UsableWorker]) -> float | None:
    cost = trace.costs[task.base_model]
    trials = [TrialLoad(t.steps, t.tokens_per_step) for t in task.trials]
    cap = min(t.max_trials_per_pack for t in task.trials)
    gpus = [UsableWorker(trace.gpu_memory_bytes, g.busy_for_s) for g in gpus]
    return estimate(trials, cost, gpus, max_trials_per_pack=cap, on_priors=False,
                    gpus_per_pack=task.gpus_needed).wall_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream-tasks", type=int, default=60, help="tasks of the tenant stream")
    args = parser.parse_args()
    headers = ["source", "trials or tasks", "tokens", "estimate wall s", "actual wall s", "estimate/actual (median)",
               "estimate/actual p10-p90"]
    rows: list[list[Any]] = []
    sweep_ratios = []
    for path in sorted(SWEEPS.glob("*-full*.json")):
        row = sweep_row(path)
        sweep_ratios.append(row[-2])
        rows.append(row)
    for name, trace, gpus in (("alto_mix on 16 GPUs", alto_mix(0), 16),
                              ("tenant_stream on 16 GPUs", tenant_stream(0, 16, tasks=args.stream_tasks), 16)):
        ratios = sorted(trace_ratios(trace, gpus))
        deciles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
        rows.append([name, len(ratios), "", "", "", round(statistics.median(ratios), 3),
                     f"{deciles[0]:.3f}-{deciles[-1]:.3f}"])
    write_result("estimates", headers, rows, {
        "notes": "Sweeps: estimate on the cost priors for one idle H100 vs the sweep's measured train_wall_s "
                 "(estimate/actual per sweep; the oldest sweeps, ~560 s, ran on an earlier, slower engine). "
                 "Traces: each task's estimated wall time at its arrival (GPUs busy until their simulated packs "
                 "end) vs its simulated completion.",
        "sweep_ratio_median": statistics.median(sweep_ratios) if sweep_ratios else None,
    })


if __name__ == "__main__":
    main()
