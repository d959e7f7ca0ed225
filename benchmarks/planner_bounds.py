"""How far each policy is from the best possible (issue 54): `python -m benchmarks.planner_bounds [--policies ...]`.

Issue 54's three traces on the simulator, each policy run as the scheduler runs it by default (preemption on),
beside the trace's lower bounds (scheduler/sim/bounds.py: no policy does better) and the run's largest gap to a
weighted share: contended on 8 GPUs, shared-gpu on 8 GPUs, the tenant stream on 64 GPUs at load 1.5. Prints makespan,
mean and p95 JCT, each policy's ratio to the bounds, the share gap and the preemptions. CPU only; CP-SAT runs under a
wall-clock limit, so its rows move a little from run to run, while fifo and greedy are deterministic.
"""

from __future__ import annotations

import argparse

from benchmarks.common import write_result
from scheduler.planning.fairness import FairnessPolicy
from scheduler.sim.bounds import makespan_lower_bound, mean_jct_lower_bound, share_gap_max
from scheduler.sim.simulate import POLICIES, simulate
from scheduler.sim.traces import make_trace

CASES = (("contended", 8, None), ("shared-gpu", 8, None), ("tenant-stream", 64, 1.5))  # (trace, GPUs, load)
HEADERS = ["trace", "gpus", "policy", "makespan s", "bound", "x bound", "mean JCT s", "bound", "x bound",
           "p95 JCT s", "share gap max", "preempted"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["fifo", "greedy", "cpsat"], choices=POLICIES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT's seconds per replan")
    args = parser.parse_args()
    fairness = FairnessPolicy()
    rows: list[list[object]] = []
    for name, gpus, load in CASES:
        trace = make_trace(name, args.seed, gpus, None, load)
        makespan_bound, mean_bound = makespan_lower_bound(trace, gpus), mean_jct_lower_bound(trace, gpus)
        for policy in args.policies:
            r = simulate(trace, gpus, policy, time_limit_s=args.time_limit, seed=args.seed, fairness=fairness)
            gap = share_gap_max(trace, r, fairness.window_s)
            rows.append([name, gpus, policy, round(r.makespan_s), round(makespan_bound),
                         round(r.makespan_s / makespan_bound, 2), round(r.mean_jct_s), round(mean_bound),
                         round(r.mean_jct_s / mean_bound, 2), round(r.p95_jct_s),
                         None if gap is None else round(gap, 3), r.preempted])
            print(rows[-1], flush=True)
    write_result("planner-bounds", HEADERS, rows, {"seed": args.seed, "time_limit_s": args.time_limit,
                                                   "preemption": {"min_slice_s": fairness.min_slice_s,
                                                                  "window_s": fairness.window_s}})


if __name__ == "__main__":
    main()
