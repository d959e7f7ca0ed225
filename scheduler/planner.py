"""The planner: a pure function from a snapshot of the cluster to packs to start now.

The greedy FIFO packer (`LORAPLANE_PLANNER=greedy`); the daemon's default is the CP-SAT placement in
scheduler/placement.py, which takes the same snapshot. No I/O here; scheduler/lifecycle.py builds the
snapshot from the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.planning import RunningMember


@dataclass(frozen=True)
class PendingTrial:
    trial_id: str
    task_id: str
    tenant_id: str
    base_model: str
    # The task's own cap on how many trials share one pack (`scheduling.max_trials_per_pack`).
    max_trials_per_pack: int
    # What the CP-SAT placement (scheduler/placement.py) weighs; the greedy plan here ignores them.
    remaining_steps: int = 1
    tokens_per_step: int = 512  # batch size x the task's max_seq_len: an upper bound
    tenant_weight: int = 1
    # What a running pack must fit to take this trial as a back-fill.
    lora_rank: int = 8
    target_modules: tuple[str, ...] = ("all-linear",)
    # It has trained before (paused at its warm-up boundary and kept, or requeued): it rejoins a running pack
    # of its own task that has room before anything else is planned (scheduler/placement.py, `rejoin`).
    resumed: bool = False


def loads(models: frozenset[str] | None, model: str) -> bool:
    """Whether a worker that says it can load ``models`` (None: it does not say, taken as every one) loads
    ``model``."""
    return models is None or model in models


@dataclass(frozen=True)
class IdleWorker:
    worker_id: str
    max_slots: int
    memory_bytes: int | None = None
    # The registered models it can load (its heartbeat says); None: it does not say, taken as every one.
    models: frozenset[str] | None = None

    def can_load(self, model: str) -> bool:
        return loads(self.models, model)


@dataclass(frozen=True)
class BusyWorker:
    worker_id: str
    max_slots: int
    memory_bytes: int | None
    busy_for_s: float  # predicted seconds until its pack ends
    models: frozenset[str] | None = None  # as IdleWorker's

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
        """The engine can take ``trial``: same model, rank within its padding, targets among its layers."""
        wrapped, targets = set(self.target_modules), set(trial.target_modules)
        # Compared as patterns (conservative): "all-linear" covers every layer but the output embedding.
        covered = targets <= wrapped or ("all-linear" in wrapped and "lm_head" not in targets)
        return trial.base_model == self.base_model and trial.lora_rank <= self.max_rank and covered


@dataclass(frozen=True)
class Snapshot:
    # In submission order (task created_at, then trial index): the greedy planner is FIFO.
    pending: tuple[PendingTrial, ...]
    idle_workers: tuple[IdleWorker, ...]
    busy_workers: tuple[BusyWorker, ...] = ()
    live_packs: tuple[LivePack, ...] = ()  # running packs with free slots


@dataclass(frozen=True)
class PlannedPack:
    worker_id: str
    base_model: str
    trial_ids: tuple[str, ...]
    # The engine's shape, for back-fills later (None: the pack takes none).
    capacity: int | None = None
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


def plan(snapshot: Snapshot) -> Plan:
    """Fill each idle worker with one pack of pending trials that share a base model.

    The oldest pending trial whose base model the worker can load picks the base model of the next pack; later
    trials of the same base model (of any task or tenant: tLoRA §3.4 groups jobs on a shared backbone) join it
    until the pack reaches the smallest cap among the worker's slots and its members' `max_trials_per_pack`.
    """
    remaining = list(snapshot.pending)
    packs: list[PlannedPack] = []
    for worker in sorted(snapshot.idle_workers, key=lambda w: w.worker_id):
        if not remaining:
            break
        at = next((i for i, t in enumerate(remaining) if worker.can_load(t.base_model)), None)
        if at is None:  # it can load none of the models that wait
            continue
        first = remaining[at]
        members = [first]
        cap = min(worker.max_slots, first.max_trials_per_pack)
        for trial in remaining[at + 1:]:
            if len(members) >= cap:
                break
            if trial.base_model != first.base_model:
                continue
            new_cap = min(cap, trial.max_trials_per_pack)
            if len(members) + 1 > new_cap:
                continue
            members.append(trial)
            cap = new_cap
        chosen = {t.trial_id for t in members}
        remaining = [t for t in remaining if t.trial_id not in chosen]
        packs.append(PlannedPack(worker.worker_id, first.base_model, tuple(t.trial_id for t in members)))
    return Plan(tuple(packs))
