"""The Celery application's configuration, shared by the scheduler (which only sends) and the workers
(which register the tasks in worker/celery_app.py). Kept free of torch so the scheduler image stays small."""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from common.private_files import private_dir
from common.settings import Settings, get_settings

RUN_PACK_TASK = "loraplane.run_pack"
BUILD_EXPORT_TASK = "loraplane.build_export"


def worker_queue(settings: Settings, worker_id: str) -> str:
    return f"{settings.namespace}.worker.{worker_id}"


def exports_queue(settings: Settings) -> str:
    """The queue of export builds (a merged model), which every worker consumes beside its own."""
    return f"{settings.namespace}.exports"


def consumer_argv(queues: list[str], *, name: str, pool: str, concurrency: int, loglevel: str,
                  quiet: bool) -> list[str]:
    """The arguments of a worker process's Celery consumer (`Celery.worker_main`): its queues, its pool, its node
    name, and none of Celery's gossip, mingle or heartbeat (the scheduler knows the workers from their own beats)."""
    return [
        *(["--quiet"] if quiet else []),
        "worker", "-Q", ",".join(queues), "--pool", pool, "--concurrency", str(concurrency), "-n", f"{name}@%h",
        "--loglevel", loglevel, "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]


def make_celery(settings: Settings) -> Celery:
    app = Celery("loraplane", broker=settings.resolved_broker_url)
    transport_options: dict[str, object] = {}
    if app.conf.broker_url.startswith("filesystem"):
        folder = settings.broker_dir
        private_dir(folder / "processed")  # 0700: the messages name tenants' tasks
        transport_options = {
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "processed_folder": str(folder / "processed"),
            # kombu's default is ./control, relative to whatever directory the process started in.
            "control_folder": str(folder / "control"),
            "store_processed": False,
        }
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        # A worker waits out a broker outage (a Redis restart) however long it lasts, instead of exiting
        # after Celery's default 100 retries.
        broker_connection_max_retries=None,
        # One pack at a time per GPU, and no message held in reserve that another worker could run.
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        # Acked on receipt on purpose: the scheduler, not the broker, recovers a pack whose worker died
        # (heartbeat timeout -> trials back to pending -> replanned). Redelivery by the broker on top of
        # that would run the pack twice.
        task_acks_late=False,
        task_default_queue=f"{settings.namespace}.default",
        worker_hijack_root_logger=False,
    )
    return app


@lru_cache
def get_celery() -> Celery:
    return make_celery(get_settings())
