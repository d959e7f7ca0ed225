"""A task's experiment trackers (its `integrations`): checked and stored at submission, and how far each trial's run
is synced, for `GET /v1/tasks/{id}/integrations`. The syncing itself is the scheduler's
(scheduler/service/trackers.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.schemas.tasks import MlflowIntegration, WandbIntegration
from api.services.webhooks import check_reachable, check_url
from common.egress import Egress
from common.secret_box import get_secret_box
from common.tables import Task, Tracker, TrackerRun, Trial, new_id

Integration = MlflowIntegration | WandbIntegration
WANDB_SERVICE = "https://api.wandb.ai"  # where W&B's client sends online runs; a tenant names no other


def shown_integration(integration: Integration) -> dict[str, Any]:
    """What the task's view shows of a tracker: all but its token."""
    if isinstance(integration, WandbIntegration):
        return {"type": "wandb", "project": integration.project, "entity": integration.entity,
                "mode": integration.mode, "token_set": integration.api_key is not None}
    return {"type": integration.type, "tracking_uri": integration.tracking_uri, "experiment": integration.experiment,
            "token_set": integration.token is not None}


def check_integrations(integrations: list[Integration], egress: Egress) -> None:
    """Each MLflow server's URL is an http(s) URL to a public address (or one the operator allows), as a webhook's;
    422 on the one that is not. (W&B's service is W&B's own.)"""
    for i, integration in enumerate(integrations):
        if isinstance(integration, MlflowIntegration):
            param = f"integrations[{i}].tracking_uri"
            check_reachable(check_url(integration.tracking_uri, param), egress, param, "trackers are reached")


def add_trackers(session: Session, task: Task, integrations: list[Integration]) -> None:
    """The task's trackers, their tokens encrypted (common/secret_box.py); not committed."""
    for integration in integrations:
        if isinstance(integration, WandbIntegration):
            fields = {"tracking_uri": WANDB_SERVICE, "experiment": integration.project, "entity": integration.entity,
                      "mode": integration.mode}
            token = integration.api_key
        else:
            fields = {"tracking_uri": integration.tracking_uri, "experiment": integration.experiment}
            token = integration.token
        session.add(Tracker(id=new_id("trk"), tenant_id=task.tenant_id, task_id=task.id, type=integration.type,
                            token_encrypted=get_secret_box().encrypt(token) if token else None, **fields))


def tracker_states(session: Session, task: Task) -> list[dict[str, Any]]:
    """Each of the task's trackers as shown, with each trial's run there: its id in the tracker, whether its end is
    logged, and the last failure while the tracker is behind."""
    out = []
    trackers = session.scalars(select(Tracker).where(Tracker.task_id == task.id).order_by(Tracker.created_at,
                                                                                          Tracker.id))
    for tracker in trackers:
        runs = session.execute(select(TrackerRun, Trial.index).join(Trial, Trial.id == TrackerRun.trial_id)
                               .where(TrackerRun.tracker_id == tracker.id).order_by(Trial.index)).all()
        out.append({
            "id": tracker.id, "type": tracker.type, "tracking_uri": tracker.tracking_uri,
            "experiment": tracker.experiment, "entity": tracker.entity, "mode": tracker.mode,
            "token_set": tracker.token_encrypted is not None,
            "done": tracker.done_at is not None,
            "runs": [{"trial_id": run.trial_id, "trial_index": index, "run_id": run.run_id,
                      "finished": run.finished, "attempts": run.attempts, "last_error": run.last_error}
                     for run, index in runs],
        })
    return out
