"""Celery tasks of the GPU agent. The body lives in worker/pack_runner.py; this only binds it to Celery."""

from __future__ import annotations

from typing import Any

from common.artifacts import get_artifact_store
from common.celery import BUILD_EXPORT_TASK, RUN_PACK_TASK, get_celery
from common.messages import parse_export, parse_pack
from common.settings import get_settings
from worker import exports, telemetry
from worker.pack_runner import PackRunner

celery_app = get_celery()
_runner: PackRunner | None = None


def install_runner(runner: PackRunner) -> None:
    global _runner
    _runner = runner


@celery_app.task(name=RUN_PACK_TASK, acks_late=False)
def run_pack(*, pack: dict[str, Any]) -> None:
    """Runs one pack to the end (see PackRunner.run for the states before and after). A pack message that cannot be
    read (common/messages.py) is logged, counted and dropped (the scheduler, hearing nothing of it, sends it again
    after its worker timeout)."""
    if _runner is None:
        raise RuntimeError("this process was not started with `loraplane worker`")
    message = parse_pack(pack, on_drop=telemetry.message_dropped)
    if message is not None:
        _runner.run(message)


# Acknowledged on receipt, as packs are: a build whose worker dies is not given back by the broker in time (the Redis
# transport redelivers after its visibility timeout, an hour; the embedded filesystem transport never does). The
# worker claims it instead (its id and process), and the API sends it again once that process is gone
# (common/export_builds.py).
@celery_app.task(name=BUILD_EXPORT_TASK, acks_late=False)
def build_export(*, request: dict[str, Any]) -> None:
    """Builds a trial's export (worker/exports.py), claimed under this worker's id and process first; an unreadable
    request is logged, counted and dropped (the API sends it again once no worker has claimed it for
    `common.export_builds.UNCLAIMED_RESEND_S`)."""
    message = parse_export(request, on_drop=telemetry.message_dropped)
    if message is None:
        return
    claimant = None if _runner is None else exports.Claimant(_runner.worker_id, _runner.incarnation.id,
                                                              _runner.incarnation.started_at)
    exports.build_export(message, store=get_artifact_store(), cache_dir=get_settings().resolved_model_cache_dir,
                         claimant=claimant)
