"""Who pays for a failure, and for how long (pure): the requeue backoff of a trial whose worker was lost, and the
quarantine of a worker that keeps losing packs.

A trial's own failure (an exception in its step, its data, its OOM: reported by its worker as that trial's
failure) spends one of its `MAX_TRIAL_ATTEMPTS`. A worker's loss (its process died or restarted, its heartbeat
stopped, a rank died, its outbox overflowed, or its whole pack failed before any trial's own work) is not the
trial's doing: the trial goes back to pending with its attempt given back, may be placed again only after
`requeue_delay_s`, and the loss counts against the worker. A worker id that loses `quarantine_losses` packs
within `quarantine_window_s` gets no packs for `quarantine_s`, doubled for each quarantine in a row up to
`quarantine_max_s` (`quarantine_s_for`). A trial whose workers were lost `ALONE_AFTER_WORKER_LOSSES` times trains
alone (`max_trials_per_pack_after_losses`), and one lost `MAX_TRIAL_WORKER_LOSSES` times fails: it may be what
crashes them.
scheduler/service/faults.py applies these in the scheduler's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.states import MAX_TRIAL_WORKER_LOSSES

# From this many worker losses on, a trial trains alone (a pack of its own, no back-fill beside it). A trial that
# crashes every process it runs in takes its pack mates' workers down with it: their losses would climb with its own
# and fail them too at MAX_TRIAL_WORKER_LOSSES. Alone, it pays the rest of the way by itself, and a mate lost at most
# this many less one to it. Half the bound: a trial merely caught in a crash-looping worker (a few losses, the worker
# quarantined after LORAPLANE_WORKER_QUARANTINE_LOSSES) keeps its packing.
ALONE_AFTER_WORKER_LOSSES = MAX_TRIAL_WORKER_LOSSES // 2


@dataclass(frozen=True)
class FaultPolicy:
    """The parameters; each one's default is its setting's (common/settings.py), where they are explained."""

    requeue_backoff_s: float
    requeue_backoff_max_s: float
    quarantine_losses: int
    quarantine_window_s: float
    quarantine_s: float
    quarantine_max_s: float


def requeue_delay_s(worker_losses: int, policy: FaultPolicy) -> float:
    """Seconds a trial waits before it may be placed again after its ``worker_losses``-th worker loss (≥ 1):
    ``min(max, base · 2^(losses - 1))``. The wait gives a crashed worker time to come back (or stay away) and the
    scheduler time to see it before the trial lands on it again, and it grows as the trial keeps losing workers
    (a trial that crashes every worker it lands on is slowed, then stopped: `MAX_TRIAL_WORKER_LOSSES`)."""
    exponent = max(0, worker_losses - 1)
    if exponent >= 64:  # 2^64 · any base is far past every cap (and avoids a float overflow)
        return policy.requeue_backoff_max_s
    return min(policy.requeue_backoff_max_s, policy.requeue_backoff_s * 2.0**exponent)


def recent_losses(history: Sequence[float], now: float, policy: FaultPolicy) -> list[float]:
    """The times (epoch seconds) of ``history`` within the quarantine window before ``now``, oldest first: what a
    worker's lost-pack history keeps (older losses say nothing of it now)."""
    return sorted(t for t in history if now - policy.quarantine_window_s < t <= now)


def quarantine_s_for(losses_in_window: int, quarantines_in_a_row: int, policy: FaultPolicy) -> float | None:
    """How long a worker is quarantined after a lost pack, or None when it is not: ``losses_in_window`` counts
    that loss too; ``quarantines_in_a_row`` the quarantines it had since a pack last ended well on it (each one
    doubles the next, up to the cap)."""
    if losses_in_window < policy.quarantine_losses:
        return None
    exponent = max(0, quarantines_in_a_row)
    if exponent >= 64:
        return policy.quarantine_max_s
    return min(policy.quarantine_max_s, policy.quarantine_s * 2.0**exponent)


def max_trials_per_pack_after_losses(max_trials_per_pack: int, worker_losses: int) -> int:
    """The most trials a pack holding this trial may hold: its task's `max_trials_per_pack`, or 1 once the trial's
    workers were lost `ALONE_AFTER_WORKER_LOSSES` times."""
    return 1 if worker_losses >= ALONE_AFTER_WORKER_LOSSES else max_trials_per_pack
