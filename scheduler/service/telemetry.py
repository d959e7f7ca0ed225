"""The scheduler's Prometheus metrics (common/telemetry.py defines them): what each round measures.

Served on `LORAPLANE_SCHEDULER_METRICS_PORT` (0, the default: off, and the rounds measure nothing).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from common import states
from common.messages import Report, Wake
from common.settings import Settings
from common.tables import Pack, Task, Trial, Worker
from common.telemetry import MetricsServer, scheduler_metrics, serve

_LIVE_TRIAL_STATES = (states.TRIAL_PENDING, states.TRIAL_RUNNING, states.TRIAL_WAITING)


@dataclass
class SchedulerTelemetry:
    """Held by the daemon; every method is a no-op while metrics are off."""

    enabled: bool
    server: MetricsServer | None = None
    _models_seen: set[str] = field(default_factory=set)  # base models given a pending gauge: set to 0 when gone

    @classmethod
    def start(cls, settings: Settings) -> SchedulerTelemetry:
        server = serve(scheduler_metrics().registry, settings.scheduler_metrics_port, settings.metrics_host,
                       "scheduler")
        return cls(enabled=server is not None, server=server)

    def ingested(self, messages: Iterable[Report]) -> None:
        """Ingest lag: now minus the `sent_at` every worker message carries (heartbeats and pack reports, the
        worker's clock, so it includes any clock skew between the hosts)."""
        if not self.enabled:
            return
        metrics, now = scheduler_metrics(), time.time()
        for message in messages:
            metrics.reports.inc()
            sent_at = None if isinstance(message, Wake) else message.sent_at
            if sent_at is not None:
                metrics.ingest_lag.observe(max(0.0, now - sent_at))

    def replanned(self, seconds: float) -> None:
        if self.enabled:
            scheduler_metrics().replan.observe(seconds)

    def observe_state(self, session: Session, now: datetime) -> None:
        """Trials per live state, pending trials per base model, running packs, quarantined workers: four indexed
        counts a round."""
        if not self.enabled:
            return
        metrics = scheduler_metrics()
        by_state = dict(session.execute(
            select(Trial.state, func.count()).where(Trial.state.in_(_LIVE_TRIAL_STATES)).group_by(Trial.state)
        ).tuples().all())
        for state in _LIVE_TRIAL_STATES:
            metrics.trials.labels(state=state).set(by_state.get(state, 0))
        pending = dict(session.execute(
            select(Task.base_model, func.count()).join(Trial, Trial.task_id == Task.id)
            .where(Trial.state == states.TRIAL_PENDING).group_by(Task.base_model)
        ).tuples().all())
        self._models_seen |= set(pending)
        for model in self._models_seen:
            metrics.pending.labels(base_model=model).set(pending.get(model, 0))
        running = session.scalar(select(func.count()).select_from(Pack).where(Pack.state == states.PACK_RUNNING))
        metrics.packs_running.set(running or 0)
        quarantined = session.scalar(select(func.count()).select_from(Worker).where(
            Worker.state == states.WORKER_ALIVE, Worker.quarantined_until > now))
        metrics.workers_quarantined.set(quarantined or 0)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def message_dropped(reason: str) -> None:
    """A bus message the scheduler could not read (common/messages.py). Counted whether or not metrics are served
    (a drop is rare, and its count should not wait for a server)."""
    scheduler_metrics().messages_dropped.labels(reason=reason).inc()
