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


@celery_app.task(name=BUILD_EXPORT_TASK, acks_late=False)
def build_export(*, request: dict[str, Any]) -> None:
    """Builds a trial's export (worker/exports.py); an unreadable request is logged, counted and dropped (the
    API sends it again once its request has waited `api/services/adapters.py`'s `EXPORT_RESEND_S`)."""
    message = parse_export(request, on_drop=telemetry.message_dropped)
    if message is not None:
        exports.build_export(message, store=get_artifact_store(), cache_dir=get_settings().resolved_model_cache_dir)
