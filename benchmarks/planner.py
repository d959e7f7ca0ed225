"""Planner quality and speed on simulated traces (issue 5): `python -m benchmarks.planner [--time-limit S]`.

(a) ALTO's 11-task mix on 8 GPUs and (b) the tLoRA-style tenant stream on 16 GPUs, under fifo, greedy and
cpsat (scheduler/simulate.py); the stream also at 2× and 5× its default load (tLoRA §4.3 scales arrivals the
same way), as sensitivity rows, not the target's. (c) Planner speed: the replan p95 of a simulated 64-GPU,
200-task stream under cpsat; one replan of 200 pending trials on 64 free GPUs; one replan of 10,000 pending
trials on 1,000 GPUs (plan_cpsat, which falls back to the greedy plan when the model is too big).
CPU only: the planner needs no accelerator.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import write_result
from scheduler.cpsat import plan_cpsat
from scheduler.planning import GpuSpec, PlanningInput, PlanTrial
from scheduler.simulate import POLICIES, SimResult, simulate
from scheduler.traces import Trace, alto_mix, tenant_stream


def snapshot(trace: Trace, gpus: int) -> PlanningInput:
    """Every trial of `trace` pending at once on `gpus` free GPUs: the largest replan the trace can cause."""
    trials = tuple(PlanTrial(tr.trial_id, t.task_id, t.tenant_id, t.tenant_weight, t.base_model, t.gpus_needed,
                             tr.tokens_per_step, tr.steps, tr.slot_bytes, tr.max_trials_per_pack)
                   for t in trace.tasks for tr in t.trials)
    return PlanningInput(trials=trials, gpus=tuple(GpuSpec(f"gpu{i:04d}", trace.gpu_memory_bytes) for i in range(gpus)),
                         costs=trace.costs)


def timed_replan(inp: PlanningInput, time_limit_s: float) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    res = plan_cpsat(inp, time_limit_s=time_limit_s)
    return (time.perf_counter() - t0) * 1000, res.status, len(res.start_now)


def row(case: str, r: SimResult) -> list[object]:
    return [case, r.policy, round(r.makespan_s, 1), round(r.mean_jct_s, 1), round(r.p95_jct_s, 1),
            round(r.gpu_util, 3), round(r.replan_p95_ms, 1), r.replans, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per replan")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows: list[list[object]] = []
    results: dict[str, dict[str, SimResult]] = {}

    def run(case: str, trace: Trace, gpus: int) -> None:
        results[case] = {}
        for policy in POLICIES:
            r = simulate(trace, gpus, policy, time_limit_s=args.time_limit, seed=args.seed)
            results[case][policy] = r
            rows.append(row(case, r))
            print(rows[-1], flush=True)

    run("alto-mix/8", alto_mix(args.seed), 8)
    run("stream/16", tenant_stream(args.seed, 16), 16)
    for load in (1.8, 4.5):  # tLoRA's 2× and 5× sooner arrivals of the default 0.9 load
        run(f"stream/16 load {load}", tenant_stream(args.seed, 16, load=load), 16)

    speed = simulate(tenant_stream(args.seed, 64, tasks=200), 64, "cpsat", time_limit_s=args.time_limit,
                     seed=args.seed)
    rows.append(row("stream/64 200 tasks", speed))
    ms64, status64, _ = timed_replan(snapshot(tenant_stream(args.seed, 64, tasks=200), 64), args.time_limit)
    rows.append(["replan 64 GPUs x 200 pending", "cpsat", "", "", "", "", round(ms64, 1), 1, status64])
    ms1k, status1k, n1k = timed_replan(snapshot(tenant_stream(args.seed, 1000, tasks=10_000), 1000),
                                       args.time_limit)
    rows.append(["replan 1000 GPUs x 10000 pending", "cpsat", "", "", "", "", round(ms1k, 1), 1, status1k])

    alto, stream = results["alto-mix/8"], results["stream/16"]
    alto_ratio = alto["fifo"].makespan_s / alto["cpsat"].makespan_s
    alto_vs_greedy = alto["cpsat"].makespan_s <= alto["greedy"].makespan_s * (1 + 1e-9)
    stream_ratio = stream["fifo"].mean_jct_s / stream["cpsat"].mean_jct_s
    targets = {
        "alto_fifo_over_cpsat_makespan": round(alto_ratio, 3),
        "alto_fifo_over_greedy_makespan": round(alto["fifo"].makespan_s / alto["greedy"].makespan_s, 3),
        "stream_fifo_over_cpsat_mean_jct": round(stream_ratio, 3),
        "stream_fifo_over_greedy_mean_jct": round(stream["fifo"].mean_jct_s / stream["greedy"].mean_jct_s, 3),
        "replan_p95_ms_64_gpus_200_tasks": round(speed.replan_p95_ms, 1),
        "replan_ms_64_gpus_200_pending": round(ms64, 1),
        "replan_ms_1000_gpus_10000_pending": round(ms1k, 1),
        "met": {
            "alto: cpsat makespan <= fifo/1.3": alto_ratio >= 1.3,
            "alto: cpsat makespan <= greedy": alto_vs_greedy,
            "stream: cpsat mean JCT >= 2x better than fifo": stream_ratio >= 2.0,
            "replan p95 < 1 s at 64 GPUs x 200 tasks": speed.replan_p95_ms < 1000 and ms64 < 1000,
            "usable plan < 5 s at 1000 GPUs x 10000 pending": ms1k < 5000 and n1k > 0,
        },
    }
    write_result("planner", ["case", "policy", "makespan_s", "mean_jct_s", "p95_jct_s", "gpu_util",
                             "replan_p95_ms", "replans", "note"], rows,
                 {"time_limit_s": args.time_limit, "seed": args.seed, "targets": targets,
                  "statuses": {f"{case}/{p}": r.statuses for case, rs in results.items() for p, r in rs.items()}
                  | {"stream/64 200 tasks/cpsat": speed.statuses}})


if __name__ == "__main__":
    main()
