"""The CLI and the client on what a newcomer met in the first hour (issue 32): every bad line of an upload, a failed
task's missing best trial explained, one upload of a dataset however often a task spec is created, a task's typed
estimate. Against the real API over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplane.cli import main
from loraplane.client import Client, TaskEstimate
from tests.client import sim
from tests.factories import TenantKey, chat_rows


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def env(api_url: str, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch) -> TenantKey:
    monkeypatch.setenv("LORAPLANE_API_URL", api_url)
    monkeypatch.setenv("LORAPLANE_API_KEY", tenant.key)
    return tenant


def test_an_upload_prints_every_bad_line(env: TenantKey, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = json.dumps({"prompt": "2 plus 2 is", "completion": " 4"})
    lines = [good, "{not json", good, json.dumps({"prompt": "p"}), json.dumps({"messages": []}), good]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, "files", "upload", str(path))
    assert code == 1 and out == ""
    first, *details = err.splitlines()
    assert first.startswith("loraplane: error: The file is not valid training data (3 problem(s))"), err
    assert [d.split(":")[0].strip() for d in details] == ["line 2", "line 4", "line 5"], err
    assert all(d.startswith("  line ") and len(d.split(": ", 1)[1]) > 3 for d in details), err


def test_one_bad_line_stays_one_line(env: TenantKey, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n{oops\n")
    code, _, err = run(capsys, "files", "upload", str(path))
    assert code == 1 and len(err.splitlines()) == 1 and "line 2" in err, err


def test_show_says_a_failed_task_has_no_best_trial_and_why(env: TenantKey, api_url: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with Client(api_url, env.key) as lp:
        file_id = lp.files.upload(chat_rows(), filename="t.jsonl").id
        task = lp.tasks.create({"base_model": "tiny-random-llama", "training_file": file_id,
                                "search_space": {"lora_rank": [4, 8]}, "max_steps": 3})
        _, running, _ = run(capsys, "tasks", "show", task.id)
        assert "best trial: none yet" in running
        sim.finish(task.id, [None, None], ["failed", "failed"])
        failed = lp.tasks.get(task.id)
    assert failed.state == "failed" and failed.error
    code, out, _ = run(capsys, "tasks", "show", task.id)
    assert code == 0
    assert f"best trial: none: the task failed ({failed.error})" in out, out
    code, _, err = run(capsys, "tasks", "download", task.id, "-o", "unused")
    assert code == 1 and "no_best_trial" in err and failed.error in err and "yet" not in err, err


def test_tasks_create_uploads_a_dataset_once(env: TenantKey, api_url: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.jsonl").write_bytes(chat_rows(20))
    spec = tmp_path / "task.yaml"
    spec.write_text("base_model: tiny-random-llama\ntraining_file: train.jsonl\nmax_steps: 2\n"
                    "search_space: {lora_rank: [4]}\n")
    ids = []
    for _ in range(3):
        code, out, err = run(capsys, "tasks", "create", str(spec), "--json")
        assert code == 0, err
        ids.append(json.loads(out)["training_file"])
    assert len(set(ids)) == 1
    with Client(api_url, env.key) as lp:
        assert [f.id for f in lp.files.list().data] == ids[:1]
    # Another content is another file.
    (tmp_path / "train.jsonl").write_bytes(chat_rows(21))
    code, out, err = run(capsys, "tasks", "create", str(spec), "--json")
    assert code == 0 and json.loads(out)["training_file"] != ids[0] and "uploaded train.jsonl as" in err, err


def test_a_task_has_a_typed_estimate(env: TenantKey, api_url: str) -> None:
    with Client(api_url, env.key) as lp:
        file_id = lp.files.upload(chat_rows(), filename="t.jsonl").id
        task = lp.tasks.create({"base_model": "tiny-random-llama", "training_file": file_id,
                                "search_space": {"lora_rank": [4, 8]}, "max_steps": 3})
        assert isinstance(task.estimate, TaskEstimate)
        assert task.estimate.tokens == task.raw["estimate"]["tokens"] > 0
        assert task.estimate.gpu_seconds == task.raw["estimate"]["gpu_seconds"]
        assert task.estimate.actual is None  # until it ends
        sim.finish(task.id, [4.5, 4.4])
        done = lp.tasks.get(task.id)
    assert done.estimate is not None and done.estimate.actual is not None
    assert done.estimate.actual.tokens == done.raw["estimate"]["actual"]["tokens"]
