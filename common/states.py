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
PACK_REFUSED = "refused"  # its worker would not start it (no room beside its other packs): nothing of it ran
PACK_LIVE = frozenset({PACK_PLANNED, PACK_DISPATCHED, PACK_RUNNING})

WORKER_ALIVE = "alive"
# Shutting down on SIGTERM (worker/drain.py): it hands its trials back and gets no pack; lost once its beats stop.
WORKER_DRAINING = "draining"
WORKER_LOST = "lost"

# A trial that failed this many times by its own doing (an exception in its step, its data, its OOM, a back-fill
# its pack refused) fails for good. A worker's loss spends no attempt (scheduler/planning/faults.py).
MAX_TRIAL_ATTEMPTS = 3
# ...but a trial whose worker is lost this many times fails too: a trial that kills every process it runs in (one
# that segfaults the interpreter or exhausts the host's memory is reported by no one: its worker just dies) would
# otherwise take worker after worker down for ever. Far above what crashes of the workers themselves cost a trial:
# a worker that loses packs is quarantined after LORAPLANE_WORKER_QUARANTINE_LOSSES (3) of them, so a flapping
# worker costs each trial a few losses, while a poison trial goes on losing every worker it is placed on, each
# time after a longer backoff (at the defaults, ten losses take ~20 minutes). From half of them on it trains alone
# (scheduler/planning/faults.py): its pack mates do not go down with it to the bound.
MAX_TRIAL_WORKER_LOSSES = 10
