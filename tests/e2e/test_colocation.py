"""Two packs of two base models on one worker at once, through a real `loraplane up` (issue 34): tenant A's long
task on `tiny-random-llama` trains alone; tenant B's short task on a second registered model (a tiny Qwen2) arrives
and trains beside it on the same worker (worker/colocation.py) instead of waiting for A's pack to end. A is never
paused for it; B's adapter equals the one B gets running alone; A's curve keeps each step once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

from loraplane.client import Client
from tests.e2e.flow import (
    arithmetic_rows,
    follow_events,
    submit,
    task_progress,
    tenant_client,
    upload,
    wait_progressing,
)
from tests.e2e.procs import cluster, free_port, start_embedded
from tests.e2e.test_embedded import EMBEDDED_UNSET
from tests.model_dirs import tiny_model_dir

SECOND_MODEL = "tiny-qwen2"


def one_trial(file_id: str, base_model: str, max_steps: int) -> dict[str, Any]:
    return {"base_model": base_model, "training_file": file_id, "validation_split": 0.2,
            "search_space": {"learning_rate": [2e-3], "lora_rank": [4], "batch_size": [4],
                             "target_modules": [["q_proj", "v_proj"]], "lora_dropout": [0.1]},
            "max_steps": max_steps, "max_seq_len": 64, "eval_interval": 10, "seed": 11}


def register_second_model(base_url: str, token: str, tmp_path: Path) -> None:
    with Client(base_url, admin_token=token, timeout=30) as operator:
        operator.admin.register_model(SECOND_MODEL, str(tiny_model_dir("qwen2", tmp_path / SECOND_MODEL)))


def packs(base_url: str, token: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base_url}/v1/admin/packs", params={"state": "all"}, headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def adapter_weights(lp: Client, task_id: str, into: Path) -> dict[str, torch.Tensor]:
    directory = lp.tasks.download_adapter(task_id, into)
    return load_file(str(Path(directory) / "adapter_model.safetensors"))


def test_a_short_task_of_another_model_trains_beside_a_long_pack_on_one_worker(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1", "LORAPLANE_WORKER_MAX_PACKS": "2", "OMP_NUM_THREADS": "1"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp_path) as c:
        _, token = start_embedded(c, port)
        register_second_model(base_url, token, tmp_path)
        with tenant_client(base_url, token, "team-long") as a, tenant_client(base_url, token, "team-short") as b:
            long_task = submit(a, one_trial(upload(a, arithmetic_rows()), "tiny-random-llama", 20_000))
            (long_trial,) = a.tasks.trials(long_task.id).data
            wait_progressing(lambda: a.tasks.trial(long_task.id, long_trial.id).steps_done >= 10,
                             lambda: task_progress(a, long_task.id), "the long trial's first steps")
            short_file = upload(b, arithmetic_rows(24))
            beside = submit(b, one_trial(short_file, SECOND_MODEL, 30))
            events, ended = follow_events(b, beside.id)
            assert ended.state == "succeeded", [(e.type, e.message) for e in events]

            # A trained on all along: never paused, still in its first pack, which B's pack ran beside.
            still = a.tasks.trial(long_task.id, long_trial.id)
            assert still.state == "running" and still.attempts == 1 and still.steps_done < 20_000
            assert not [e for e in a.tasks.events(long_task.id).data if e.type in ("trial.paused", "trial.preempted")]
            by_model = {p["base_model"]: p for p in packs(base_url, token)}
            assert set(by_model) == {"tiny-random-llama", SECOND_MODEL}, by_model
            a_pack, b_pack = by_model["tiny-random-llama"], by_model[SECOND_MODEL]
            assert a_pack["worker_id"] == b_pack["worker_id"] == "embedded"
            assert a_pack["state"] == "running" and b_pack["state"] == "finished"
            assert b_pack["profile"] is not None and b_pack["profile"].get("shared_device") is True

            a.tasks.cancel(long_task.id)
            steps = [p.step for p in a.tasks.metrics(long_task.id, long_trial.id).train]
            assert steps == list(range(1, len(steps) + 1)), "a step recorded twice or missing"

            # B again, alone on the worker once A's pack has ended: the same adapter to 1e-5.
            wait_progressing(lambda: all(p["state"] != "running" for p in packs(base_url, token)),
                             lambda: tuple(p["state"] for p in packs(base_url, token)), "the long pack to end")
            alone = submit(b, one_trial(short_file, SECOND_MODEL, 30))
            _, ended_alone = follow_events(b, alone.id)
            assert ended_alone.state == "succeeded"
            got = adapter_weights(b, beside.id, tmp_path / "beside")
            want = adapter_weights(b, alone.id, tmp_path / "alone")
            assert got.keys() == want.keys() and got
            for name, tensor in want.items():
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)
            alone_pack = next(p for p in packs(base_url, token) if p["base_model"] == SECOND_MODEL
                              and p["id"] != b_pack["id"])
            assert not (alone_pack["profile"] or {}).get("shared_device")
