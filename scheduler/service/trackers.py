"""Experiment trackers: each trial of a task with `integrations` logged to its MLflow server as a run (hyperparameters
as params, loss and metric curves, its end as the run's status and stop reason, its adapter as artifacts), or to
Weights & Biases once it has ended (W&B's client, in a process of its own: scheduler/service/wandb_run.py).

The outbox is the record itself: a trial's points, state and adapter are committed by the scheduler as they come,
and `tracker_runs` keeps, per (tracker, trial), what the tracker has acknowledged (the run's id, the last point
logged, whether its end is). `TrackerSync` (a thread of the scheduler daemon, as the webhook sender) catches each run
up with its trial: a tracker that is down only falls behind, is tried again with doubling waits (up to
`LORAPLANE_TRACKER_RETRY_MAX_S`) for as long as it takes, and nothing in scheduling waits for it. A run is claimed
(its next attempt moved `CLAIM_S` ahead, under a row lock that skips rows another scheduler holds) before anything is
sent, and each step's progress is committed as soon as the tracker acknowledged it: a scheduler that dies mid-way
sends at most that step again (a point logged twice with its own step and time is one point to MLflow's store; a
run created before the record of it was lost is found by its `loraplane.trial_id` tag, not created again).

The pure parts come first: what a run is given (`run_tags`, `run_params`, `point_metrics`, `end_tags`,
`wandb_history`) and the retry schedule (`retry_delay`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, select
from sqlalchemy.orm import Session

from common import states
from common.artifacts import get_artifact_store
from common.db import session_scope
from common.egress import Egress
from common.metrics import METRIC_SPLIT
from common.secret_box import get_secret_box
from common.settings import get_settings
from common.tables import MetricPoint, Task, Tracker, TrackerRun, Trial, as_utc, utcnow
from scheduler.service.mlflow_rest import MlflowRest, TrackerError, artifact_path

log = logging.getLogger(__name__)

CLAIM_S = 120.0  # a claimed run is taken again after this long if its sync never recorded (the scheduler died)
BATCH_POINTS = 1000  # MLflow's log-batch takes at most 1000 metrics
CLAIMS_PER_ROUND = 20
TRIAL_TAG = "loraplane.trial_id"
# A trial stopped early has its best adapter exported by its pack after the stop: its run waits this long for it.
ADAPTER_GRACE_S = 120.0
END_STATUS = {states.TRIAL_COMPLETED: "FINISHED", states.TRIAL_STOPPED_EARLY: "FINISHED",
              states.TRIAL_FAILED: "FAILED", states.TRIAL_CANCELLED: "KILLED"}


def retry_delay(attempts: int, max_s: float) -> float:
    """The wait after the ``attempts``-th failure in a row: 5 s doubling, at most ``max_s``."""
    return float(min(max_s, 5.0 * 2 ** min(attempts - 1, 20)))


def run_tags(task_id: str, trial_id: str, index: int, base_model: str) -> dict[str, str]:
    return {TRIAL_TAG: trial_id, "loraplane.task_id": task_id, "loraplane.trial_index": str(index),
            "loraplane.base_model": base_model}


def run_params(hyperparameters: dict[str, Any], total_steps: int) -> dict[str, str]:
    """The trial's hyperparameters as MLflow params (a list joined by commas), and its steps."""
    params = {k: ",".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in sorted(hyperparameters.items())}
    params["total_steps"] = str(total_steps)
    return {k[:250]: v[:6000] for k, v in params.items()}


def metric_key(split: str, metric: str) -> str:
    """A point's metric name: ``train_loss``, ``val_loss``, or the task's generative metric (``exact_match``, ...)."""
    return metric if split == METRIC_SPLIT else f"{split}_loss"


def point_metrics(points: Sequence[MetricPoint], metric: str) -> list[dict[str, Any]]:
    """Points as MLflow metrics, each at its own step and time (a point sent twice is the same metric)."""
    return [{"key": metric_key(p.split, metric), "value": p.loss, "step": p.step,
             "timestamp": int(as_utc(p.created_at).timestamp() * 1000)} for p in points]


def end_tags(trial: Trial) -> dict[str, str]:
    tags = {"loraplane.state": trial.state}
    for name, value in (("loraplane.stop_reason", trial.stop_reason), ("loraplane.error", trial.error),
                        ("loraplane.best_step", trial.best_step), ("loraplane.best_val_loss", trial.best_val_loss)):
        if value is not None:
            tags[name] = str(value)[:5000]
    return tags


def wandb_history(points: Sequence[MetricPoint], metric: str) -> list[tuple[int, dict[str, float]]]:
    """Points as W&B's history: one row per step, in step order (W&B takes each step's values together)."""
    rows: dict[int, dict[str, float]] = {}
    for p in points:
        rows.setdefault(p.step, {})[metric_key(p.split, metric)] = p.loss
    return sorted(rows.items())


def adapter_files(archive: bytes) -> list[tuple[str, bytes]]:
    """The files of a stored adapter archive (a flat PEFT directory, worker/pack_runner.py's ``tar_dir``), read in
    memory; anything but a plain file at the top is skipped."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
        for member in tar.getmembers():
            if member.isfile() and "/" not in member.name and member.name not in ("", ".", ".."):
                handle = tar.extractfile(member)
                if handle is not None:
                    out.append((member.name, handle.read()))
    return out


@dataclass(frozen=True)
class Claimed:
    """A trial's run in a tracker, held by this sync until ``CLAIM_S`` after it took it."""

    run_row: int
    type: str  # "mlflow" | "wandb"
    tracking_uri: str
    token_encrypted: str | None
    experiment: str
    entity: str | None
    mode: str | None
    trial_id: str
    run_id: str | None
    artifact_uri: str | None
    params_synced: bool
    point_cursor: int


class TrackerSync:
    def __init__(self, *, egress: Egress | None = None, sync_s: float | None = None,
                 retry_max_s: float | None = None) -> None:
        settings = get_settings()
        self.egress = egress or Egress(policy=settings.webhook_egress_policy)
        self.sync_s = sync_s if sync_s is not None else settings.tracker_sync_s
        self.retry_max_s = retry_max_s if retry_max_s is not None else settings.tracker_retry_max_s

    def run(self, stop: threading.Event) -> None:
        log.info("tracker sync running")
        while not stop.is_set():
            try:
                busy = self.run_once()
            except Exception:  # noqa: BLE001 - the database is away, say: claims run out, nothing is lost
                log.exception("tracker sync round failed; retrying")
                busy = 0
            if not busy:
                stop.wait(self.sync_s)

    def run_once(self, now: datetime | None = None) -> int:
        """One round: the runs due now synced (each as far as its tracker takes it). Returns how many were due."""
        at = now or utcnow()
        with session_scope() as session:
            self._open_runs(session, at)
            self._close_trackers(session, at)
        claimed = self._claim(at)
        for job in claimed:
            self._sync(job)
        return len(claimed)

    # -- bookkeeping ----------------------------------------------------------------------------------------------

    @staticmethod
    def _open_runs(session: Session, now: datetime) -> None:
        """A run row for each trial that has started, of each tracker still syncing, due ``now``."""
        missing = session.execute(
            select(Tracker.id, Trial.id).join(Trial, Trial.task_id == Tracker.task_id)
            .where(Tracker.done_at.is_(None), Trial.started_at.is_not(None),
                   ~exists().where(and_(TrackerRun.tracker_id == Tracker.id, TrackerRun.trial_id == Trial.id)))
        ).all()
        for tracker_id, trial_id in missing:
            session.add(TrackerRun(tracker_id=tracker_id, trial_id=trial_id, next_attempt_at=now))

    @staticmethod
    def _close_trackers(session: Session, now: datetime) -> None:
        """A tracker whose task has ended and every started trial's run is finished has nothing left to sync."""
        trackers = session.scalars(select(Tracker).join(Task, Task.id == Tracker.task_id)
                                   .where(Tracker.done_at.is_(None), Task.state.in_(states.TASK_FINAL)))
        for tracker in trackers:
            open_runs = session.scalar(select(exists().where(TrackerRun.tracker_id == tracker.id,
                                                             TrackerRun.finished.is_(False))))
            unopened = session.scalar(select(exists().where(
                Trial.task_id == tracker.task_id, Trial.started_at.is_not(None),
                ~exists().where(and_(TrackerRun.tracker_id == tracker.id, TrackerRun.trial_id == Trial.id)))))
            if not open_runs and not unopened:
                tracker.done_at = now

    def _claim(self, now: datetime) -> list[Claimed]:
        with session_scope() as session:
            rows = session.execute(
                select(TrackerRun, Tracker).join(Tracker, Tracker.id == TrackerRun.tracker_id)
                .where(TrackerRun.finished.is_(False), TrackerRun.next_attempt_at <= now)
                .order_by(TrackerRun.next_attempt_at, TrackerRun.id).limit(CLAIMS_PER_ROUND)
                .with_for_update(of=TrackerRun, skip_locked=True, key_share=True)
            ).all()
            claimed = []
            for run, tracker in rows:
                run.next_attempt_at = now + timedelta(seconds=CLAIM_S)
                claimed.append(Claimed(run.id, tracker.type, tracker.tracking_uri, tracker.token_encrypted,
                                       tracker.experiment, tracker.entity, tracker.mode, run.trial_id, run.run_id,
                                       run.artifact_uri, run.params_synced, run.point_cursor))
            return claimed

    @staticmethod
    def _save(run_row: int, **fields: Any) -> None:
        with session_scope() as session:
            run = session.get(TrackerRun, run_row, with_for_update={"key_share": True})
            if run is not None:
                for name, value in fields.items():
                    setattr(run, name, value)
                run.updated_at = utcnow()

    # -- one run ----------------------------------------------------------------------------------------------------

    def _sync(self, job: Claimed) -> None:
        """Catches the run up with its trial, each step saved once the tracker took it; a failure is recorded with
        the next attempt after the backoff (the steps already taken stay taken)."""
        try:
            token = get_secret_box().decrypt(job.token_encrypted) if job.token_encrypted else None
        except Exception:  # noqa: BLE001 - no configured key reads it: the operator's to fix, the tenant is told
            log.exception("tracker token of run %s cannot be decrypted", job.run_row)
            self._failed(job, "token unreadable (the operator's secret key changed)")
            return
        if job.type == "wandb":
            try:
                self._wandb(job, token)
            except TrackerError as exc:
                self._failed(job, str(exc))
                return
            more = False
        else:
            client = MlflowRest(job.tracking_uri, token, self.egress)
            try:
                more = self._catch_up(job, client)
            except TrackerError as exc:
                self._failed(job, str(exc))
                return
            except (KeyError, TypeError, ValueError) as exc:  # an answer that is not MLflow's
                log.info("tracker %s answered unexpectedly: %r", job.tracking_uri, exc)
                self._failed(job, "unexpected answer from the tracker")
                return
            finally:
                client.close()
        wait = 0.0 if more else self.sync_s
        self._save(job.run_row, attempts=0, last_error=None, next_attempt_at=utcnow() + timedelta(seconds=wait))

    def _failed(self, job: Claimed, error: str) -> None:
        with session_scope() as session:
            run = session.get(TrackerRun, job.run_row, with_for_update={"key_share": True})
            if run is None:
                return
            run.attempts += 1
            run.last_error = error
            run.next_attempt_at = utcnow() + timedelta(seconds=retry_delay(run.attempts, self.retry_max_s))
            run.updated_at = utcnow()

    def _catch_up(self, job: Claimed, client: MlflowRest) -> bool:
        """Returns whether more is waiting (points past one batch)."""
        with session_scope() as session:
            trial = session.get(Trial, job.trial_id)
            task = session.get(Task, trial.task_id) if trial is not None else None
            if trial is None or task is None:
                return False
            session.expunge_all()
        run_id, artifact_uri = job.run_id, job.artifact_uri
        if run_id is None:
            experiment = client.experiment_id(job.experiment)
            found = client.find_run(experiment, TRIAL_TAG, trial.id)
            started = as_utc(trial.started_at or trial.created_at)
            run_id, artifact_uri = found or client.create_run(
                experiment, f"{task.id}/trial-{trial.index}", int(started.timestamp() * 1000),
                run_tags(task.id, trial.id, trial.index, task.base_model))
            self._save(job.run_row, run_id=run_id, artifact_uri=artifact_uri)
        if not job.params_synced:
            client.log_batch(run_id, params=run_params(trial.hyperparameters, trial.total_steps))
            self._save(job.run_row, params_synced=True)
        with session_scope() as session:
            points = list(session.scalars(select(MetricPoint).where(MetricPoint.trial_id == trial.id,
                                                                    MetricPoint.id > job.point_cursor)
                                          .order_by(MetricPoint.id).limit(BATCH_POINTS)))
            session.expunge_all()
        if points:
            client.log_batch(run_id, metrics=point_metrics(points, task.parsed_spec.metric))
            self._save(job.run_row, point_cursor=points[-1].id)
            if len(points) == BATCH_POINTS:
                return True
        if trial.state in states.TRIAL_FINAL and self._may_end(trial):
            self._end(client, run_id, artifact_uri, trial)
            self._save(job.run_row, finished=True)
        return False

    @staticmethod
    def _may_end(trial: Trial) -> bool:
        """A trial stopped early gets its adapter from its pack after the stop: its run waits a while for it."""
        if trial.state != states.TRIAL_STOPPED_EARLY or trial.adapter_key or trial.finished_at is None:
            return True
        return (utcnow() - as_utc(trial.finished_at)).total_seconds() > ADAPTER_GRACE_S

    @staticmethod
    def _end(client: MlflowRest, run_id: str, artifact_uri: str | None, trial: Trial) -> None:
        """The adapter's files under ``adapter/`` (where the server takes artifacts), the end's tags, the status."""
        tags = end_tags(trial)
        artifacts_at = artifact_path(artifact_uri)
        store = get_artifact_store()
        if trial.adapter_key and store.exists(trial.adapter_key):
            if artifacts_at is None:
                tags["loraplane.adapter"] = "not uploaded: the server takes no artifact uploads (no --serve-artifacts)"
            else:
                for name, data in adapter_files(store.get_bytes(trial.adapter_key)):
                    client.upload_artifact(artifacts_at, f"adapter/{name}", data)
        client.log_batch(run_id, tags=tags)
        ended = as_utc(trial.finished_at or utcnow())
        client.finish_run(run_id, END_STATUS.get(trial.state, "FINISHED"), int(ended.timestamp() * 1000))

    # -- Weights & Biases -------------------------------------------------------------------------------------------

    def _wandb(self, job: Claimed, api_key: str | None) -> None:
        """A trial that has ended, written to W&B whole by W&B's client in a process of its own (its key alone in
        its environment, `WANDB_RUN_TIMEOUT_S` at most); a trial still training waits (W&B's offline runs cannot be
        written in parts)."""
        with session_scope() as session:
            trial = session.get(Trial, job.trial_id)
            task = session.get(Task, trial.task_id) if trial is not None else None
            if trial is None or task is None or trial.state not in states.TRIAL_FINAL or not self._may_end(trial):
                return
            points = list(session.scalars(select(MetricPoint).where(MetricPoint.trial_id == trial.id)
                                          .order_by(MetricPoint.id)))
            session.expunge_all()
        store = get_artifact_store()
        with tempfile.TemporaryDirectory(prefix="wandb-") as tmp_name:
            adapter_dir = None
            if trial.adapter_key and store.exists(trial.adapter_key):
                adapter_dir = os.path.join(tmp_name, "adapter")
                os.mkdir(adapter_dir)
                for name, data in adapter_files(store.get_bytes(trial.adapter_key)):
                    with open(os.path.join(adapter_dir, name), "wb") as f:
                        f.write(data)
            run_dir = get_settings().resolved_artifact_dir / "wandb" / task.id
            run_dir.mkdir(parents=True, exist_ok=True)
            spec = {"project": job.experiment, "entity": job.entity, "mode": job.mode or "online",
                    "run_id": trial.id, "name": f"{task.id}/trial-{trial.index}", "dir": str(run_dir),
                    "config": {**trial.hyperparameters, "total_steps": trial.total_steps, "task_id": task.id,
                               "base_model": task.base_model},
                    "tags": [trial.state], "history": wandb_history(points, task.parsed_spec.metric),
                    "summary": {k.removeprefix("loraplane."): v for k, v in end_tags(trial).items()},
                    "adapter_dir": adapter_dir, "ok": trial.state in (states.TRIAL_COMPLETED,
                                                                       states.TRIAL_STOPPED_EARLY)}
            _run_wandb(spec, api_key, tmp_name)
        self._save(job.run_row, run_id=trial.id, point_cursor=points[-1].id if points else 0, finished=True)


WANDB_RUN_TIMEOUT_S = 600.0


def _run_wandb(spec: dict[str, Any], api_key: str | None, home: str) -> None:
    """Runs scheduler/service/wandb_run.py on ``spec``; TrackerError with a generic reason when it fails."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": home, "TMPDIR": home, "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": home, "WANDB_CACHE_DIR": home, "WANDB_DATA_DIR": home}
    if api_key:
        env["WANDB_API_KEY"] = api_key
    try:
        done = subprocess.run([sys.executable, "-m", "scheduler.service.wandb_run"], input=json.dumps(spec),
                              capture_output=True, text=True, timeout=WANDB_RUN_TIMEOUT_S, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    except subprocess.TimeoutExpired:
        raise TrackerError("timeout") from None
    if done.returncode != 0:
        log.info("W&B run %s failed: %s", spec["run_id"], done.stderr[-2000:])
        raise TrackerError("W&B's client failed (the key, the project or the connection)")
