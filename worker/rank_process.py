"""The process of a rank 1..n-1 of a worker over several GPUs (worker/ranks.py says what the ranks share and how):
its entry point, apart from the rank protocol, so that the protocol, which the pack runner uses, imports no runner.
`loraplane worker --gpus` hands ``rank_main`` to its ``RankPool``."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from common.artifacts import get_artifact_store
from common.bus import get_bus
from common.settings import get_settings
from worker.availability import ModelAvailability
from worker.model_cache import preload_models
from worker.ranks import RankConfig, join
from worker.runner import PackRunner

log = logging.getLogger(__name__)


def rank_main(rank: int, config: RankConfig, packs: Any, ended: Any) -> None:
    """A rank process of a worker over several GPUs: joins the worker's process group, then runs its share of each
    pack rank 0 hands it until it is handed None."""
    logging.basicConfig(level=config.loglevel, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s %(message)s")
    # A rank ends when its worker says so (`RankPool.close`), or when the worker is gone: not on the signals a
    # terminal or a process manager sends the worker's whole process group, which the worker shuts down on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    hf_logging.disable_progress_bar()
    ranks = join(rank, config)
    bus = get_bus()
    runner = PackRunner(worker_id=config.worker_id, device=torch.device(config.devices[rank]), bus=bus,
                        store=get_artifact_store(), model_cache_dir=get_settings().resolved_model_cache_dir,
                        incarnation=config.incarnation, ranks=ranks)
    log.info("rank %d of worker %s on %s", rank, config.worker_id, config.devices[rank])
    if config.preload:
        preload_models(runner.model, config.preload, ModelAvailability(bus).registry())
    while (pack := packs.get()) is not None:
        runner.run_share(pack)
        ended.put((rank, pack.pack_id))
    dist.destroy_process_group()


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when the worker process that started it is gone (killed, so it could not say so)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
