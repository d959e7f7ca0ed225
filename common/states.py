"""State names of tasks, trials, packs and workers, and which of them are final."""

from __future__ import annotations

TASK_VALIDATING = "validating"
TASK_QUEUED = "queued"
TASK_RUNNING = "running"
TASK_SUCCEEDED = "succeeded"
TASK_FAILED = "failed"
TASK_CANCELLED = "cancelled"
TASK_FINAL = frozenset({TASK_SUCCEEDED, TASK_FAILED, TASK_CANCELLED})

TRIAL_PENDING = "pending"
TRIAL_RUNNING = "running"
# Reached its warm-up boundary before the rest of its task (early exit `alto`): checkpointed, holding no slot,
# until the task's warm-up ranking keeps it (back to pending) or stops it.
TRIAL_WAITING = "waiting"
TRIAL_COMPLETED = "completed"
TRIAL_STOPPED_EARLY = "stopped_early"
TRIAL_FAILED = "failed"
TRIAL_CANCELLED = "cancelled"
TRIAL_STATES = (
    TRIAL_PENDING, TRIAL_RUNNING, TRIAL_WAITING, TRIAL_COMPLETED, TRIAL_STOPPED_EARLY, TRIAL_FAILED, TRIAL_CANCELLED,
)
TRIAL_FINAL = frozenset({TRIAL_COMPLETED, TRIAL_STOPPED_EARLY, TRIAL_FAILED, TRIAL_CANCELLED})
TRIAL_ACTIVE = frozenset({TRIAL_PENDING, TRIAL_RUNNING, TRIAL_WAITING})

PACK_PLANNED = "planned"
PACK_DISPATCHED = "dispatched"
PACK_RUNNING = "running"
PACK_FINISHED = "finished"
PACK_LOST = "lost"
PACK_LIVE = frozenset({PACK_PLANNED, PACK_DISPATCHED, PACK_RUNNING})

WORKER_ALIVE = "alive"
WORKER_LOST = "lost"

# A trial that failed this many times (its worker died each time) fails for good.
MAX_TRIAL_ATTEMPTS = 3
