"""The planners' one vocabulary (pure data): what the daemon reads of the cluster, what a solver takes and gives.

Two views of the same things, one converted into the other in one place (`planning_input`, below):
- the daemon's `Snapshot`, in seconds and workers, as scheduler/service/planner_io.py reads it from the database:
  pending trials, idle and busy workers, running packs with room (`LivePack`); and the `Plan` it records (new packs
  on idle workers, back-fills into running packs);
- the solvers' `PlanningInput`, in integer time units and workers (`WorkerSpec`, `RunningPack` with
  `RunningMember`s), which the CP-SAT model (cpsat.py), the greedy planner (greedy.py), the estimates (estimate.py)
  and the simulator (scheduler/sim/) share, and the `PlanResult` they return.
A pending trial is one type in both (`PendingTrial`).

One name per quantity: a planner's unit is a worker (`worker_id`, `workers`, `worker_ids`), one planning unit
whatever its GPUs; "gpus" counts real GPUs (a worker's `gpus`, a trial's `gpus_needed`, GPU seconds). How many
trials may share one pack is `max_trials_per_pack` everywhere (the task's, lowered by `lower_to_slots`; a running or
planned pack's); times are integer time units (`busy_until`, `ends_at`, `start`, `end`) in the solvers and
seconds, suffixed `_s`, in the daemon's snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from scheduler.planning.cost import PRIOR_COST, ModelCost

# A GPU whose worker did not report its memory: plan as for an 80 GB H100 (the profile's fit then decides).
DEFAULT_GPU_BYTES = 80 * 2**30


@dataclass(frozen=True, kw_only=True)
class PendingTrial:
    """A trial waiting for a slot: what every planner weighs, and what a running pack must fit to take it."""

    trial_id: str
    task_id: str
    tenant_id: str
    tenant_weight: int = 1  # ≥ 1: weight of this trial's completion time in the objective
    base_model: str
    # The task's own cap on how many trials share one pack (`scheduling.max_trials_per_pack`).
    max_trials_per_pack: int
    remaining_steps: int
    tokens_per_step: int  # padded tokens this trial adds to its pack's step (batch × max_seq_len: an upper bound)
    gpus_needed: int = 1  # the model needs this many GPUs together (ALTO: 70B → 4, 32B → 2, 8B → 1)
    slot_bytes: int = 0  # adapter + optimizer bytes of this slot (16 · adapter_params); 0: inside the fitted k0
    # What a running pack must fit to take this trial as a back-fill.
    lora_rank: int = 8
    target_modules: tuple[str, ...] = ("all-linear",)
    # It has trained before (paused at its warm-up boundary and kept, or requeued): it rejoins a running pack
    # of its own task that has room before anything else is planned (placement.py, `rejoin`).
    resumed: bool = False


@dataclass(frozen=True)
class WorkerSpec:
    """A worker as the solvers see it: one planning unit, whatever its GPUs (its memory is all of theirs,
    `unit_memory_bytes`). The daemon puts a pack on one worker; the simulator (scheduler/sim/) makes each simulated
    GPU a worker of one GPU, and a trial of `gpus_needed` > 1 takes that many of them together (ALTO's rigid
    multi-GPU jobs)."""

    worker_id: str
    memory_bytes: int
    busy_until: int = 0  # time units from now; 0 = free now
    # The base models it can load; None: every one. A pack goes only on workers that all load its model.
    models: frozenset[str] | None = None
    # The base models it holds loaded (its heartbeat's warm_models): all else equal, a pack of one of them
    # goes here rather than to a worker that must load it first.
    warm: frozenset[str] = frozenset()


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
    worker_ids: tuple[str, ...]
    base_model: str
    ends_at: int  # predicted end of its current members, time units from now
    trials: int
    free_slots: int
    tokens_per_step: int
    slot_bytes: int
    max_trials_per_pack: int
    tenant_trials: tuple[tuple[str, int], ...] = ()  # running trials per tenant, for quotas
    members: tuple[RunningMember, ...] = ()  # empty, or all `trials` members


def loads(models: frozenset[str] | None, model: str) -> bool:
    """Whether a worker that says it can load ``models`` (None: it does not say, taken as every one) loads
    ``model``."""
    return models is None or model in models


@dataclass(frozen=True)
class LiveWorker:
    """A live worker, one planning unit whatever its GPUs (a worker over several runs one pack at a time over all of
    them): idle, busy with a pack predicted to end in ``busy_for_s``, or running packs with room for one more beside
    them (``beside_packs``: planned as idle, with the memory they left)."""

    worker_id: str
    max_slots: int
    memory_bytes: int | None = None  # of ONE of its GPUs; None: not reported (planned as DEFAULT_GPU_BYTES)
    # The registered models it can load (its heartbeat says); None: it does not say, taken as every one.
    models: frozenset[str] | None = None
    busy_for_s: float = 0.0  # predicted seconds until its pack ends; 0 while idle
    gpus: int = 1  # the GPUs of one host it runs each pack over (`loraplane worker --gpus 0,1`)
    warm: frozenset[str] = frozenset()  # the base models it holds loaded (its heartbeat's warm_models)
    # It runs packs already and is planned as idle with the memory they left, for a pack of another model
    # (scheduler/service/planner_io.py `room_beside_packs`; worker/colocation.py).
    beside_packs: bool = False

    def can_load(self, model: str) -> bool:
        return loads(self.models, model)


@dataclass(frozen=True)
class LivePack:
    """A running pack with room: trials of its base model that fit its engine may join it."""

    pack_id: str
    worker_id: str
    base_model: str
    free_slots: int
    members: int
    max_rank: int
    target_modules: tuple[str, ...]  # the layer patterns its engine wraps
    tokens_per_step: int  # its members' pooled tokens
    busy_for_s: float  # predicted seconds until its current members are done
    member_list: tuple[RunningMember, ...] = ()  # each member as the planner weighs it
    task_ids: frozenset[str] = frozenset()  # the tasks its members belong to

    def fits(self, trial: PendingTrial) -> bool:
        """The engine can take ``trial``: same model, rank within its padding, targets among its layers; and the
        trial's own cap lets it share a pack of this many members (a trial that trains alone joins none)."""
        wrapped, targets = set(self.target_modules), set(trial.target_modules)
        # Compared as patterns (conservative): "all-linear" covers every layer but the output embedding.
        covered = targets <= wrapped or ("all-linear" in wrapped and "lm_head" not in targets)
        return (trial.base_model == self.base_model and trial.lora_rank <= self.max_rank and covered
                and self.members < trial.max_trials_per_pack)


@dataclass(frozen=True)
class Snapshot:
    # In submission order (task created_at, then trial index): the planners' ties fall back to it.
    pending: tuple[PendingTrial, ...]
    idle_workers: tuple[LiveWorker, ...]
    busy_workers: tuple[LiveWorker, ...] = ()  # each with its `busy_for_s`
    live_packs: tuple[LivePack, ...] = ()  # running packs with free slots


@dataclass(frozen=True)
class PlannedPack:
    worker_id: str
    base_model: str
    trial_ids: tuple[str, ...]
    # The engine's shape, for back-fills later (None: the pack takes none).
    max_trials_per_pack: int | None = None  # the pack's `capacity` column
    max_rank: int | None = None
    target_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Backfill:
    """Pending trials to join a running pack's free slots now."""

    pack_id: str
    worker_id: str
    trial_ids: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    packs: tuple[PlannedPack, ...] = field(default_factory=tuple)
    backfills: tuple[Backfill, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class PlanningInput:
    trials: tuple[PendingTrial, ...]  # pending, oldest first
    workers: tuple[WorkerSpec, ...]
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
    worker_ids: tuple[str, ...]
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
    unschedulable: tuple[str, ...]  # pending trials no set of workers can hold (memory) or load (the model) now
    makespan: int
    objective: int
    solve_s: float
    status: str  # "optimal" | "feasible" | "greedy_fallback" (CP-SAT found none) | "greedy" (LORAPLANE_PLANNER=greedy)
    # Running members' completions (units) after this plan's back-fills: only for packs given with `members`.
    running_completion: Mapping[str, int] = field(default_factory=dict)


BESIDE = "+beside"  # the planning unit of the room beside a worker's running packs


def unit_id(worker: LiveWorker) -> str:
    """The planning unit of ``worker`` in the solvers: its id, or for the room beside its running packs a unit of its
    own (the solvers hold a running pack's worker until the pack ends; the room beside it is free now)."""
    return worker.worker_id + BESIDE if worker.beside_packs else worker.worker_id


def unit_memory_bytes(worker: LiveWorker) -> int:
    """The memory a pack on ``worker`` may use: all of its GPUs' together. A pack there shards the frozen base over
    them (FSDP2) and deals its trials (adapter, optimizer state, activations) to them, so its peak summed over them
    is what must fit (with the trials dealt evenly), and that sum is what its profile reports. What stays whole on
    every GPU (the embeddings, the final norm, the output projection) is counted once here: a few GB of a large
    model, about 4 GB of Llama-3.1-70B's 140 (docs/multi-gpu.md)."""
    return (worker.memory_bytes or DEFAULT_GPU_BYTES) * worker.gpus


def lower_to_slots(max_trials_per_pack: int, worker_slots: Iterable[int]) -> int:
    """A task's `max_trials_per_pack` as every planner applies it (the daemon's snapshot, a new pack's size, the
    estimates): lowered to the smallest worker's slots, one limit for the whole cluster (the workers of one
    deployment share it), and at least 1. No workers (or a worker of no slots): the task's own."""
    smallest = min(worker_slots, default=None)
    return max(1, min(max_trials_per_pack, smallest or max_trials_per_pack))


def planning_input(snapshot: Snapshot, costs: Mapping[str, ModelCost], *, unit_s: float) -> PlanningInput:
    """The snapshot in the solvers' terms: one `WorkerSpec` per worker (holding all of its GPUs' memory; free now, or
    busy until its pack's predicted end, in whole units; the room beside a worker's running packs a unit of its own,
    `unit_id`), its pending trials' `max_trials_per_pack` lowered to the
    workers' slots (`lower_to_slots`), its running packs member by member, and a cost model for every pending
    trial's base model: the one in ``costs`` (the daemon's hold a fitted one or the priors for the model's size, for
    every registered model: cluster_state.load_costs), else `PRIOR_COST`."""
    slots = [w.max_slots for w in (*snapshot.idle_workers, *snapshot.busy_workers)]
    workers = tuple(
        WorkerSpec(worker_id=unit_id(w), memory_bytes=unit_memory_bytes(w), models=w.models, warm=w.warm)
        for w in snapshot.idle_workers
    ) + tuple(
        WorkerSpec(worker_id=w.worker_id, memory_bytes=unit_memory_bytes(w),
                   busy_until=max(1, math.ceil(w.busy_for_s / unit_s)), models=w.models, warm=w.warm)
        for w in snapshot.busy_workers
    )  # fmt: skip
    trials = tuple(
        replace(t, remaining_steps=max(1, t.remaining_steps),
                max_trials_per_pack=lower_to_slots(t.max_trials_per_pack, slots))
        for t in snapshot.pending
    )
    planned = {w.worker_id for w in workers}
    running = tuple(
        RunningPack(
            pack_id=p.pack_id, worker_ids=(p.worker_id,), base_model=p.base_model,
            ends_at=max(1, math.ceil(p.busy_for_s / unit_s)), trials=p.members, free_slots=p.free_slots,
            tokens_per_step=p.tokens_per_step, slot_bytes=0, max_trials_per_pack=p.members + p.free_slots,
            # Member by member: a back-fill then pays in the objective for the members it slows.
            members=p.member_list,
        )
        # Only a pack whose worker is one of the planning's: the solvers hold its worker's memory. A worker whose
        # heartbeats went stale (a scheduler behind its bus) is left out of the workers until it beats again or is
        # declared lost, while its pack is still live: every round then failed on it (issue 53, 256 hollow workers).
        for p in snapshot.live_packs if p.worker_id in planned
    )  # fmt: skip
    models = {t.base_model for t in trials}
    return PlanningInput(trials=trials, workers=workers, costs={m: costs.get(m, PRIOR_COST) for m in models},
                         running=running, unit_s=unit_s)
