"""Experiment trackers (scheduler/service/trackers.py): what a trial's run is given, and the sync against a real MLflow
server started here (its own virtualenv, `make mlflow`), read back through MLflow's own client. The server is down
first: the sync falls behind, loses nothing, and catches up once it answers. W&B in offline mode: the run file its
client writes, read back record by record."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from common import states
from common.artifacts import adapter_key, get_artifact_store
from common.db import session_scope
from common.egress import Egress, EgressPolicy
from common.tables import MetricPoint, Task, Tracker, TrackerRun, Trial, new_id, utcnow
from scheduler.service.mlflow_rest import artifact_path
from scheduler.service.trackers import (
    TrackerSync,
    adapter_files,
    end_tags,
    point_metrics,
    retry_delay,
    run_params,
)
from tests.e2e.procs import free_port
from tests.scheduler.test_daemon import make_task

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = ROOT / ".venv-mlflow" / "bin"
LOOPBACK = Egress(policy=EgressPolicy.parse("127.0.0.1"))
SERVER_START_S = 300.0  # a cold MLflow server on a loaded 2-core machine: its first start migrates its database


def test_retry_waits_double_up_to_their_ceiling() -> None:
    assert [retry_delay(n, 60) for n in (1, 2, 3, 4, 5, 50)] == [5, 10, 20, 40, 60, 60]


def test_what_a_run_is_given() -> None:
    assert run_params({"lora_rank": 8, "target_modules": ["q_proj", "v_proj"], "learning_rate": 0.001}, 30) == {
        "learning_rate": "0.001", "lora_rank": "8", "target_modules": "q_proj,v_proj", "total_steps": "30"}
    at = utcnow()
    points = [MetricPoint(trial_id="t", step=3, split="val", loss=1.5, created_at=at),
              MetricPoint(trial_id="t", step=3, split="metric", loss=0.25, created_at=at)]
    assert [(m["key"], m["step"], m["value"]) for m in point_metrics(points, "exact_match")] == [
        ("val_loss", 3, 1.5), ("exact_match", 3, 0.25)]
    assert point_metrics(points, "exact_match")[0]["timestamp"] == int(at.timestamp() * 1000)
    trial = Trial(state="stopped_early", stop_reason="underperforming at rung 1", best_step=4, best_val_loss=1.25,
                  error=None)
    assert end_tags(trial) == {"loraplane.state": "stopped_early", "loraplane.stop_reason": "underperforming at rung 1",
                               "loraplane.best_step": "4", "loraplane.best_val_loss": "1.25"}
    assert artifact_path("mlflow-artifacts:/1/abc/artifacts") == "1/abc/artifacts"
    assert artifact_path("mlflow-artifacts://srv:5000/1/abc/artifacts") == "1/abc/artifacts"
    assert artifact_path("s3://bucket/1/abc/artifacts") is None and artifact_path(None) is None


def _archive(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def test_adapter_files_are_the_archives_top_level_files_only() -> None:
    archive = _archive({"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights", "../evil": b"x",
                        "sub/inner": b"y"})
    assert adapter_files(archive) == [("adapter_config.json", b"{}"), ("adapter_model.safetensors", b"weights")]


@pytest.fixture
def mlflow_port(tmp_path: Path) -> Iterator[tuple[int, Any]]:
    """A port for an MLflow server, and a function that starts it there (it stops after the test)."""
    if not (MLFLOW / "mlflow").is_file():
        pytest.skip(f"MLflow is not installed at {MLFLOW.parent} (`make mlflow` installs it)")
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        log = (tmp_path / "mlflow.log").open("wb")
        procs.append(subprocess.Popen(
            [str(MLFLOW / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
             "--artifacts-destination", str(tmp_path / "mlartifacts")],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            assert procs[0].poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the MLflow server did not answer within {SERVER_START_S:.0f} s")

    yield port, start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def read_back(port: int, experiment: str) -> dict[str, Any]:
    """Every run of ``experiment`` as MLflow's own client reads it: tags, params, metric histories, status and the
    files under ``adapter/``."""
    script = f"""
import json, os, tempfile
from mlflow.tracking import MlflowClient
c = MlflowClient("http://127.0.0.1:{port}")
exp = c.get_experiment_by_name({experiment!r})
out = {{}}
for run in c.search_runs([exp.experiment_id]):
    rid = run.info.run_id
    files = {{}}
    if any(a.path == "adapter" for a in c.list_artifacts(rid)):
        d = c.download_artifacts(rid, "adapter", tempfile.mkdtemp())
        files = {{n: open(os.path.join(d, n), "rb").read().decode("latin-1") for n in sorted(os.listdir(d))}}
    out[run.data.tags["loraplane.trial_id"]] = {{
        "status": run.info.status, "name": run.info.run_name, "tags": run.data.tags, "params": run.data.params,
        "metrics": {{k: sorted((m.step, m.value) for m in c.get_metric_history(rid, k)) for k in run.data.metrics}},
        "files": files}}
print(json.dumps(out))
"""
    done = subprocess.run([str(MLFLOW / "python"), "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _trained_task(port: int, tracker: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """A task of two trials that trained (one completed with its adapter stored, one failed) and ended, with an
    MLflow tracker at ``port`` (or the ``tracker`` given)."""
    task_id, trials = make_task(2, evaluation={"metric": "exact_match", "max_new_tokens": 8})
    key = adapter_key(task_id, trials[0])
    get_artifact_store().put_bytes(key, _archive({"adapter_config.json": b'{"r": 4}',
                                                  "adapter_model.safetensors": b"weights"}))
    now = utcnow()
    with session_scope() as s:
        task = s.get(Task, task_id)
        assert task is not None
        task.state, task.finished_at = states.TASK_SUCCEEDED, now
        s.add(Tracker(id=new_id("trk"), tenant_id=task.tenant_id, task_id=task_id, **(tracker or {
            "type": "mlflow", "tracking_uri": f"http://127.0.0.1:{port}", "experiment": "team-a/sweep"})))
        for i, trial_id in enumerate(trials):
            trial = s.get(Trial, trial_id)
            assert trial is not None
            trial.started_at, trial.finished_at = now - timedelta(minutes=5), now
            if i == 0:
                trial.state, trial.adapter_key, trial.best_step, trial.best_val_loss = "completed", key, 4, 1.25
            else:
                trial.state, trial.error = "failed", "OutOfMemoryError: CUDA out of memory"
            for step in (1, 2, 3, 4):
                s.add(MetricPoint(trial_id=trial_id, step=step, split="train", loss=2.0 - step / 10))
            s.add(MetricPoint(trial_id=trial_id, step=4, split="val", loss=1.25 + i))
        s.add(MetricPoint(trial_id=trials[0], step=4, split="metric", loss=0.5))
    return task_id, trials


def _runs() -> list[TrackerRun]:
    with session_scope() as s:
        runs = list(s.scalars(select(TrackerRun).order_by(TrackerRun.id)))
        s.expunge_all()
        return runs


def test_every_trial_is_a_run_and_an_outage_only_delays_it(clean_db: None, mlflow_port: tuple[int, Any]) -> None:
    port, start = mlflow_port
    task_id, (done, failed) = _trained_task(port)
    sync = TrackerSync(egress=LOOPBACK, sync_s=0.1, retry_max_s=1.0)
    # The server is down: each run records why and waits, nothing is marked sent.
    assert sync.run_once() == 2
    runs = _runs()
    assert [(r.attempts, r.last_error, r.run_id, r.point_cursor, r.finished) for r in runs] == [
        (1, "could not connect", None, 0, False)] * 2
    assert all(r.next_attempt_at > utcnow() for r in runs)
    assert sync.run_once() == 0  # not due again before its wait

    start()
    deadline = time.monotonic() + 120
    while not all(r.finished for r in _runs()):
        assert time.monotonic() < deadline, [(r.last_error, r.attempts) for r in _runs()]
        sync.run_once(now=utcnow() + timedelta(seconds=5))  # past the backoff, as time would pass
    sync.run_once()
    with session_scope() as s:
        tracker = s.scalar(select(Tracker).where(Tracker.task_id == task_id))
        assert tracker is not None and tracker.done_at is not None  # the task ended and every run is finished
    synced = [(r.attempts, r.last_error, r.run_id, r.finished) for r in _runs()]
    assert all(attempts == 0 and error is None and run_id for attempts, error, run_id, _ in synced), synced
    # A scheduler that died after the tracker took everything but before it recorded so sends it all again: the
    # run is found by its tag (not created twice) and each point stays one point.
    with session_scope() as s:
        for run in s.scalars(select(TrackerRun)):
            run.run_id, run.params_synced, run.point_cursor, run.finished = None, False, 0, False
    # Past each run's wait after its last sync (sync_s): a fast machine gets here within it.
    sync.run_once(now=utcnow() + timedelta(seconds=5))
    assert all(r.finished for r in _runs()), [(r.last_error, r.attempts, r.finished) for r in _runs()]

    runs = read_back(port, "team-a/sweep")
    assert set(runs) == {done, failed}
    ok, bad = runs[done], runs[failed]
    assert ok["status"] == "FINISHED" and bad["status"] == "FAILED"
    assert ok["name"] == f"{task_id}/trial-0" and ok["tags"]["loraplane.task_id"] == task_id
    assert ok["params"] == {"learning_rate": "0.001", "lora_rank": "4", "lora_alpha": "8", "batch_size": "2",
                            "lora_dropout": "0.0", "target_modules": "q_proj", "seed": "0", "total_steps": "4"}
    assert ok["metrics"] == {"train_loss": [[step, 2.0 - step / 10] for step in (1, 2, 3, 4)],
                             "val_loss": [[4, 1.25]], "exact_match": [[4, 0.5]]}  # each point once, sent twice
    assert ok["tags"]["loraplane.best_step"] == "4" and ok["tags"]["loraplane.state"] == "completed"
    assert ok["files"] == {"adapter_config.json": '{"r": 4}', "adapter_model.safetensors": "weights"}
    assert bad["tags"]["loraplane.error"].startswith("OutOfMemoryError") and bad["files"] == {}


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB's log format (32 KiB
    blocks of records, each with a 7-byte header: CRC, length, type FULL/FIRST/MIDDLE/LAST), each record a
    protobuf `Record` of W&B's."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, part, records = 7, b"", []
    while pos + 7 <= len(raw):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        part += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def test_wandb_offline_writes_each_ended_trial_as_a_run(clean_db: None) -> None:
    task_id, (done, failed) = _trained_task(0, {"type": "wandb", "tracking_uri": "https://api.wandb.ai",
                                                "experiment": "sweeps", "mode": "offline"})
    with session_scope() as s:  # the failed trial still trains: its run waits for its end
        trial = s.get(Trial, failed)
        assert trial is not None
        trial.state, trial.finished_at = "running", None
    sync = TrackerSync(egress=LOOPBACK, sync_s=0.1)
    assert sync.run_once() == 2
    assert [(r.trial_id, r.finished, r.last_error) for r in _runs()] == [(done, True, None), (failed, False, None)]
    runs = sorted((get_artifact_store().root / "wandb" / task_id / "wandb").glob("offline-run-*"))
    assert [p.name.endswith(done) for p in runs] == [True]
    records = wandb_records(runs[0] / f"run-{done}.wandb")
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (done, "sweeps", f"{task_id}/trial-0",
                                                                           ["completed"])
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config["lora_rank"] == 4 and config["task_id"] == task_id and config["target_modules"] == ["q_proj"]
    history = [{(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item
                if not (i.key or ".".join(i.nested_key)).startswith("_")}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert history == [{"train_loss": 1.9}, {"train_loss": 1.8}, {"train_loss": 1.7},
                       {"train_loss": 1.6, "val_loss": 1.25, "exact_match": 0.5}]
    summary = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update}
    assert summary["state"] == "completed" and summary["best_step"] == "4"
    assert any(r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model" for r in records)
    assert next(r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit") == 0
