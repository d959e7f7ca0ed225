"""Planner quality and speed on simulated traces (issue 5): `python -m benchmarks.planner [--time-limit S]`.

(a) ALTO's 11-task mix on 8 GPUs (makespan); (b) the tLoRA-style tenant stream on 16 GPUs at offered loads
0.9 (the trace's default), 1.5 and 3.0 (tLoRA §4.3 scales arrivals the same way; the jobs are the same at
every load), mean and p95 JCT and their ratio to fifo's, beside a lower bound on the mean JCT that no policy
can beat (`bounds.mean_jct_lower_bound`), so "fifo / bound" is the best ratio any planner could show;
(c) planner speed: the replan p95 of a simulated 64-GPU, 200-task stream under cpsat; one replan of 200
pending trials on 64 free GPUs; one replan of 10,000 pending trials on 1,000 GPUs. All under fifo, greedy and
cpsat (scheduler/sim/simulate.py), each with its trace's default planner objective
(`simulate.default_makespan_weight`: Σ weight·completion plus the makespan for the ALTO batch, Σ
weight·completion alone for the stream), and the stream at load 3.0 once more under cpsat with the makespan
weighted 1, to show what that choice costs. CPU only: the planner needs no accelerator. CP-SAT runs under a
wall-clock limit, so its rows move by a few percent from run to run on a loaded machine; fifo and greedy are
deterministic.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import write_result
from scheduler.planning.cpsat import plan_cpsat
from scheduler.planning.types import PendingTrial, PlanningInput, WorkerSpec
from scheduler.sim.bounds import mean_jct_lower_bound
from scheduler.sim.simulate import POLICIES, SimResult, simulate
from scheduler.sim.traces import Trace, alto_mix, tenant_stream

STREAM_LOADS = (0.9, 1.5, 3.0)


def snapshot(trace: Trace, gpus: int) -> PlanningInput:
    """Every trial of `trace` pending at once on `gpus` free GPUs: the largest replan the trace can cause."""
    trials = tuple(PendingTrial(trial_id=tr.trial_id, task_id=t.task_id, tenant_id=t.tenant_id,
                                tenant_weight=t.tenant_weight, base_model=t.base_model, gpus_needed=t.gpus_needed,
                                tokens_per_step=tr.tokens_per_step, remaining_steps=tr.steps, slot_bytes=tr.slot_bytes,
                                max_trials_per_pack=tr.max_trials_per_pack)
                   for t in trace.tasks for tr in t.trials)
    workers = tuple(WorkerSpec(f"gpu{i:04d}", trace.gpu_memory_bytes) for i in range(gpus))  # a GPU a worker
    return PlanningInput(trials=trials, workers=workers, costs=trace.costs)


def timed_replan(inp: PlanningInput, time_limit_s: float) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    res = plan_cpsat(inp, time_limit_s=time_limit_s)
    return (time.perf_counter() - t0) * 1000, res.status, len(res.start_now)


HEADERS = ["case", "policy", "makespan_s", "mean_jct_s", "p95_jct_s", "fifo_over_mean", "fifo_over_p95", "gpu_util",
           "replan_p95_ms", "replans", "note"]


def row(case: str, r: SimResult, fifo: SimResult | None, note: str = "") -> list[object]:
    over: list[object] = ["", ""]
    if fifo is not None:
        over = [round(fifo.mean_jct_s / r.mean_jct_s, 3), round(fifo.p95_jct_s / r.p95_jct_s, 3)]
    return [case, r.policy, round(r.makespan_s, 1), round(r.mean_jct_s, 1), round(r.p95_jct_s, 1), *over,
            round(r.gpu_util, 3), round(r.replan_p95_ms, 1), r.replans, note]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per replan")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows: list[list[object]] = []
    results: dict[str, dict[str, SimResult]] = {}
    bounds: dict[str, float] = {}

    def run(case: str, trace: Trace, gpus: int, stream: bool) -> None:
        results[case] = {}
        if stream:
            bounds[case] = mean_jct_lower_bound(trace, gpus)
            rows.append([case, "bound", "", round(bounds[case], 1), "", "", "", "", "", "", "lower bound on mean JCT"])
        for policy in POLICIES:
            r = simulate(trace, gpus, policy, time_limit_s=args.time_limit, seed=args.seed)
            results[case][policy] = r
            rows.append(row(case, r, results[case]["fifo"]))
            print(rows[-1], flush=True)
        if stream:
            rows.append([case, "fifo/bound", "", "", "", round(results[case]["fifo"].mean_jct_s / bounds[case], 3),
                         "", "", "", "", "the largest fifo_over_mean any policy can reach"])

    run("alto-mix/8", alto_mix(args.seed), 8, stream=False)
    for load in STREAM_LOADS:
        run(f"stream/16 load {load}", tenant_stream(args.seed, 16, load=load), 16, stream=True)
    case = f"stream/16 load {STREAM_LOADS[-1]}"
    mw1 = simulate(tenant_stream(args.seed, 16, load=STREAM_LOADS[-1]), 16, "cpsat", time_limit_s=args.time_limit,
                   seed=args.seed, makespan_weight=1)
    rows.append(row(case, mw1, results[case]["fifo"], "makespan weighted 1 in the objective"))

    speed = simulate(tenant_stream(args.seed, 64, tasks=200), 64, "cpsat", time_limit_s=args.time_limit,
                     seed=args.seed)
    rows.append(row("stream/64 200 tasks", speed, None))
    ms64, status64, _ = timed_replan(snapshot(tenant_stream(args.seed, 64, tasks=200), 64), args.time_limit)
    rows.append(["replan 64 GPUs x 200 pending", "cpsat", "", "", "", "", "", "", round(ms64, 1), 1, status64])
    ms1k, status1k, n1k = timed_replan(snapshot(tenant_stream(args.seed, 1000, tasks=10_000), 1000),
                                       args.time_limit)
    rows.append(["replan 1000 GPUs x 10000 pending", "cpsat", "", "", "", "", "", "", round(ms1k, 1), 1, status1k])

    alto = results["alto-mix/8"]
    alto_ratio = alto["fifo"].makespan_s / alto["cpsat"].makespan_s
    alto_vs_greedy = alto["cpsat"].makespan_s <= alto["greedy"].makespan_s * (1 + 1e-9)
    stream = {load: results[f"stream/16 load {load}"] for load in STREAM_LOADS}
    ratio = {load: {p: round(rs["fifo"].mean_jct_s / rs[p].mean_jct_s, 3) for p in ("greedy", "cpsat")}
             for load, rs in stream.items()}
    targets = {
        "alto_fifo_over_cpsat_makespan": round(alto_ratio, 3),
        "alto_fifo_over_greedy_makespan": round(alto["fifo"].makespan_s / alto["greedy"].makespan_s, 3),
        "stream_fifo_over_mean_jct": {str(load): r for load, r in ratio.items()},
        "stream_fifo_over_bound_mean_jct": {str(load): round(stream[load]["fifo"].mean_jct_s
                                                             / bounds[f"stream/16 load {load}"], 3)
                                            for load in STREAM_LOADS},
        "replan_p95_ms_64_gpus_200_tasks": round(speed.replan_p95_ms, 1),
        "replan_ms_64_gpus_200_pending": round(ms64, 1),
        "replan_ms_1000_gpus_10000_pending": round(ms1k, 1),
        "met": {
            "alto: cpsat makespan <= fifo/1.3": alto_ratio >= 1.3,
            "alto: cpsat makespan <= greedy": alto_vs_greedy,
            **{f"stream load {load}: cpsat mean JCT >= 2x better than fifo": ratio[load]["cpsat"] >= 2.0
               for load in STREAM_LOADS},
            "replan p95 < 1 s at 64 GPUs x 200 tasks": speed.replan_p95_ms < 1000 and ms64 < 1000,
            "usable plan < 5 s at 1000 GPUs x 10000 pending": ms1k < 5000 and n1k > 0,
        },
    }
    write_result("planner", HEADERS, rows,
                 {"time_limit_s": args.time_limit, "seed": args.seed, "targets": targets,
                  "makespan_weight": {case: rs["fifo"].makespan_weight for case, rs in results.items()},
                  "statuses": {f"{case}/{p}": r.statuses for case, rs in results.items() for p, r in rs.items()}
                  | {"stream/64 200 tasks/cpsat": speed.statuses, f"{case}/cpsat makespan weight 1": mw1.statuses}})


if __name__ == "__main__":
    main()
