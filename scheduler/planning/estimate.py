"""A task's cost before it runs: tokens, GPU seconds and wall-clock seconds (pure, no I/O).

The task's trials are planned as the daemon would plan them, with the same cost model and the same arithmetic
(coefficients.py), from the same snapshot types (`types.planning_input`): the first-fit planner (the CP-SAT planner's
hint and fallback, deterministic and fast enough for a request), then the daemon's two rules after its solver
(rules.py: `work_conserving` and, for a model planned on the priors, `fill_now`). The GPUs are the workers that
can load the model now, each free from when its running pack is predicted to end. So:

- tokens: Σ steps × tokens per step (batch × max_seq_len, `scheduler.planning.cost.tokens_per_step`). Rows are at most
  max_seq_len long, so this is an upper bound on the tokens trained (the planner's own count, padding included).
- gpu_seconds: Σ over the planned packs of (end − start) × its GPUs: the GPU time the task's packs hold.
- wall_seconds: when the last of its trials is planned to finish, from now; None when no usable GPU can hold
  (or load) a trial now: nothing says when one will.
- basis and band: what the cost model rests on (the priors of the workers' device kind, or a fit from N packs of the
  model on that kind: `Basis`), and the range the actual wall time is expected in (`PRIOR_BAND`, `FITTED_BAND`).

What it does not see: trials of other tasks still pending (the planner orders all pending trials together,
shortest first, so a backlog can delay this task, or this task delay it), back-fills into running packs (which
can only start it sooner) and early exit (trials stopped early end sooner). The cost model's own error is the
rest: on the priors, a small model's step is dominated by fixed costs the priors do not know.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.planning.cost import CPU_DEVICE_KIND, GPU_DEVICE_KIND, ModelCost
from scheduler.planning.greedy import plan_greedy
from scheduler.planning.rules import after_solver
from scheduler.planning.types import LiveWorker, PendingTrial, Snapshot, planning_input

# The plan's time unit for an estimate: finer than the daemon's second (placement.UNIT_S) because a short task's
# numbers are shown to its user, and every member's completion is rounded up to a whole unit.
ESTIMATE_UNIT_S = 0.1
_MODEL = "model"  # the one base model of the estimated trials (a name is all the planner needs of it)


@dataclass(frozen=True)
class TrialLoad:
    """What one trial asks of the cluster."""

    steps: int
    tokens_per_step: int


@dataclass(frozen=True)
class UsableWorker:
    """A worker that can load the task's model: one planning unit, as the daemon plans it, whatever its GPUs."""

    # Of one of its GPUs; None: not reported (planned as DEFAULT_GPU_BYTES, as the daemon does).
    memory_bytes: int | None = None
    busy_for_s: float = 0.0  # until its running pack is predicted to end; 0: free now
    gpus: int = 1  # its GPUs: a pack on it may use all of their memory (`types.unit_memory_bytes`)


# The wall time's error band: actual / estimated wall time, low and high, by what the estimate rests on.
# - GPU priors: benchmarks/results/estimates-cpu-20261124.json, ten SmolLM2 sweeps on one H100 estimated on the priors:
#   estimate/actual 0.334-1.322, i.e. actual 0.76-3.0 x the estimate.
# - CPU priors: measured on one 2-core machine (benchmarks/results/cpu_priors-cpu-20261126.json); another machine's
#   cores, threads and load can differ by several times either way, so the band is wider: 0.33-3 x (the fit's own
#   error on the measured packs is far smaller; the machine is the unknown).
# - Fitted (the model's own packs on this device kind): the same sweep re-run on the same engine varied by ~10%
#   (145-173 s), and what the estimate does not plan, other tasks' pending trials, made the simulator's alto_mix
#   tasks take up to 1/0.519 = 1.9x their estimate (estimates-cpu-20261124.json): 0.8-2 x.
PRIOR_BAND = {GPU_DEVICE_KIND: (0.75, 3.0), CPU_DEVICE_KIND: (0.33, 3.0)}
FITTED_BAND = (0.8, 2.0)
SOURCE_PRIOR, SOURCE_FITTED = "prior", "fitted"


@dataclass(frozen=True)
class Basis:
    """What an estimate rests on: the priors of a device kind, or the cost model fitted from `packs` packs of the
    model on that device kind (their profiles, and running packs' measured step times)."""

    source: str  # SOURCE_PRIOR | SOURCE_FITTED
    device_kind: str  # cost.device_kind: "cpu" | "cuda"
    packs: int

    @classmethod
    def of(cls, cost: ModelCost, kind: str) -> Basis:
        return cls(SOURCE_PRIOR if cost.prior else SOURCE_FITTED, kind, 0 if cost.prior else cost.packs)

    @property
    def band(self) -> tuple[float, float]:
        """(low, high) multipliers of the estimated wall time (`PRIOR_BAND`, `FITTED_BAND`)."""
        if self.source == SOURCE_FITTED:
            return FITTED_BAND
        return PRIOR_BAND.get(self.device_kind, PRIOR_BAND[GPU_DEVICE_KIND])

    def as_dict(self) -> dict[str, str | int]:
        return {"source": self.source, "device_kind": self.device_kind, "packs": self.packs}


@dataclass(frozen=True)
class Estimate:
    tokens: int
    gpu_seconds: float
    wall_seconds: float | None  # None: no usable GPU can take the trials now
    basis: Basis = Basis(SOURCE_PRIOR, GPU_DEVICE_KIND, 0)

    @property
    def wall_band(self) -> tuple[float, float] | None:
        """(low, high) wall seconds the task's actual wall time is expected within (None: no wall time)."""
        if self.wall_seconds is None:
            return None
        low, high = self.basis.band
        return round(self.wall_seconds * low, 3), round(self.wall_seconds * high, 3)

    def as_dict(self) -> dict[str, Any]:
        low, high = self.wall_band or (None, None)
        return {"tokens": self.tokens, "gpu_seconds": self.gpu_seconds, "wall_seconds": self.wall_seconds,
                "wall_seconds_low": low, "wall_seconds_high": high, "basis": self.basis.as_dict()}


def estimate(
    trials: Sequence[TrialLoad], cost: ModelCost, workers: Sequence[UsableWorker], *, max_trials_per_pack: int,
    on_priors: bool, gpus_per_pack: int = 1, kind: str = GPU_DEVICE_KIND,
) -> Estimate:
    """The task's tokens, GPU seconds and wall seconds, planned on ``workers`` with ``cost``.

    Args:
        trials: the task's trials, in trial order.
        cost: the base model's fitted cost model, or its priors (`cost.prior_cost`).
        workers: the workers that can load the model now (none: GPU time is planned on one free default worker of
            one GPU, and the wall time is unknown).
        max_trials_per_pack: the task's, already lowered to the workers' slots (`types.lower_to_slots`).
        on_priors: ``cost`` is the priors (the daemon then applies `fill_now`).
        gpus_per_pack: GPUs one pack of the model takes together (the service runs 1; the simulator's traces more).
        kind: the device kind of ``workers`` and ``cost`` (`cost.device_kind`): the estimate's `Basis` names it.
    """
    tokens = sum(t.steps * t.tokens_per_step for t in trials)
    basis = Basis.of(cost, kind)
    if not trials:
        return Estimate(tokens=0, gpu_seconds=0.0, wall_seconds=0.0, basis=basis)
    usable = tuple(workers) or (UsableWorker(),) * gpus_per_pack
    max_trials_per_pack = max(1, max_trials_per_pack)
    snapshot = Snapshot(
        pending=tuple(
            PendingTrial(trial_id=f"t{i}", task_id="task", tenant_id="tenant", base_model=_MODEL,
                         max_trials_per_pack=max_trials_per_pack, remaining_steps=t.steps,
                         tokens_per_step=t.tokens_per_step, gpus_needed=gpus_per_pack)
            for i, t in enumerate(trials)
        ),
        idle_workers=tuple(LiveWorker(f"gpu{i}", max_trials_per_pack, w.memory_bytes, gpus=w.gpus)
                           for i, w in enumerate(usable) if w.busy_for_s <= 0),
        busy_workers=tuple(LiveWorker(f"gpu{i}", max_trials_per_pack, w.memory_bytes, busy_for_s=w.busy_for_s,
                                      gpus=w.gpus)
                           for i, w in enumerate(usable) if w.busy_for_s > 0),
    )
    inp = planning_input(snapshot, {_MODEL: cost}, unit_s=ESTIMATE_UNIT_S)
    result = after_solver(inp, plan_greedy(inp), on_priors={_MODEL} if on_priors else set())
    # A pack holds every GPU of the workers it is planned on.
    gpus_of = {f"gpu{i}": w.gpus for i, w in enumerate(usable)}
    units = sum((p.end - p.start) * sum(gpus_of[g] for g in p.worker_ids) for p in result.packs)
    # A trial no usable worker can hold is priced alone (it cannot be placed now: no wall time).
    solo = sum(
        t.remaining_steps * cost.step.predict(t.tokens_per_step, 1) * gpus_per_pack
        for t in inp.trials if t.trial_id in set(result.unschedulable)
    )
    wall = None if result.unschedulable or not workers else round(max(p.end for p in result.packs) * ESTIMATE_UNIT_S, 3)
    return Estimate(tokens=tokens, gpu_seconds=round(units * ESTIMATE_UNIT_S + solo, 3), wall_seconds=wall,
                    basis=basis)
