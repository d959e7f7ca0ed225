"""The `loraplane` client commands end to end: `main(argv)` against the real API over HTTP, with stdout,
stderr and the exit code checked (and one run through a real subprocess)."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from loraplane.cli import main
from loraplane.client import Client
from tests.client import sim
from tests.e2e.procs import ROOT, free_port
from tests.egress import allowed_networks
from tests.factories import TenantKey, chat_rows, task_body


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def json_lines(self) -> list[Any]:
        return [json.loads(line) for line in self.out.splitlines()]


Cli = Callable[..., Result]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """Runs `loraplane ARGV...` in this process; `stdin` replaces standard input."""

    def run(*argv: str, stdin: str | None = None) -> Result:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def env(api_url: str, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch) -> TenantKey:
    """The tenant's key and the API's URL in the environment, as a script would set them."""
    monkeypatch.setenv("LORAPLANE_API_URL", api_url)
    monkeypatch.setenv("LORAPLANE_API_KEY", tenant.key)
    return tenant


@pytest.fixture
def lp(api_url: str, tenant: TenantKey) -> Iterator[Client]:
    with Client(api_url, tenant.key) as client:
        yield client


def one_error_line(result: Result, *fragments: str) -> str:
    lines = result.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraplane: error: "), result.err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def submit(lp: Client, **overrides: Any) -> str:
    f = lp.files.upload(chat_rows(), filename="train.jsonl")
    return lp.tasks.create(task_body(f.id, max_steps=4, epochs=None, **overrides)).id


# ---- login and settings ------------------------------------------------------------------------------------


def test_login_checks_the_key_and_writes_a_private_config_file(
    cli: Cli, api_url: str, tenant: TenantKey, isolated_settings: Path
) -> None:
    r = cli("login", "--api-url", api_url + "/", "--api-key", tenant.key)
    assert r.code == 0, r.err
    assert f"Logged in to {api_url} with key {tenant.key[:12]}..." in r.out and str(isolated_settings) in r.out
    assert json.loads(isolated_settings.read_text()) == {"api_url": api_url, "api_key": tenant.key}
    assert stat.S_IMODE(isolated_settings.stat().st_mode) == 0o600
    assert stat.S_IMODE(isolated_settings.parent.stat().st_mode) == 0o700

    listed = cli("files", "list", "--json")  # no option, no variable: the config file
    assert listed.code == 0 and listed.json() == {"object": "list", "data": [], "has_more": False}


def test_login_reads_the_key_from_stdin_and_refuses_a_wrong_key(
    cli: Cli, api_url: str, tenant: TenantKey, isolated_settings: Path
) -> None:
    wrong = cli("login", "--api-url", api_url, "--api-key", "lp_wrong")
    assert wrong.code == 1 and wrong.out == ""
    one_error_line(wrong, "The API key is not valid", "HTTP 401", "invalid_api_key")
    assert not isolated_settings.exists()

    piped = cli("login", "--api-url", api_url, "--json", stdin=tenant.key + "\n")
    assert piped.code == 0 and piped.json() == {"api_url": api_url, "config_file": str(isolated_settings)}
    assert json.loads(isolated_settings.read_text())["api_key"] == tenant.key
    assert cli("login", "--api-url", api_url, stdin="").code == 2

    unreachable = cli("login", "--api-url", f"http://127.0.0.1:{free_port()}", "--api-key", tenant.key)
    assert unreachable.code == 3
    one_error_line(unreachable, "cannot reach the API at http://127.0.0.1:")


def test_without_a_key_nothing_is_sent_and_the_exit_code_is_2(cli: Cli, api_url: str, clean_db: None) -> None:
    r = cli("tasks", "list", "--api-url", api_url)
    assert r.code == 2 and r.out == ""
    one_error_line(r, "no API key", "loraplane login", "LORAPLANE_API_KEY")
    assert cli("tasks").code == 2  # argparse: a command is missing
    assert cli("tasks", "list", "--state", "sleeping").code == 2


def test_an_unreachable_api_exits_3(cli: Cli) -> None:
    r = cli("models", "--api-url", f"http://127.0.0.1:{free_port()}", "--api-key", "lp_x")
    assert r.code == 3 and r.out == ""
    one_error_line(r, "cannot reach the API")


@pytest.fixture
def failing_api() -> Iterator[str]:
    """A server that answers every request 503 with the API's error body (a deployment that is down)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            body = json.dumps({"error": {"type": "service_unavailable_error", "code": "database_unavailable",
                                         "message": "The database is unavailable.", "param": None}}).encode()
            self.send_response(503)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_server_error_exits_3_with_its_message(cli: Cli, failing_api: str) -> None:
    r = cli("tasks", "list", "--api-url", failing_api, "--api-key", "lp_x", "--json")
    assert r.code == 3
    one_error_line(r, "The database is unavailable. (HTTP 503, database_unavailable)")
    assert r.json()["error"]["code"] == "database_unavailable"


# ---- files and models ----------------------------------------------------------------------------------------


def test_files_upload_list_show_delete(cli: Cli, env: TenantKey, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_rows(12))
    up = cli("files", "upload", str(path))
    assert up.code == 0, up.err
    file_id = up.out.split()[0]
    assert file_id.startswith("file-") and "train.jsonl: 12 rows (messages)" in up.out
    as_json = cli("files", "upload", str(path), "--json").json()
    assert as_json["object"] == "file" and as_json["rows"] == 12

    listed = cli("files", "list")
    assert listed.code == 0 and listed.out.splitlines()[0].split() == ["ID", "FILENAME", "ROWS", "FORMAT", "SIZE",
                                                                       "CREATED"]
    assert [line.split()[0] for line in listed.out.splitlines()[1:]] == [as_json["id"], file_id]
    paged = cli("files", "list", "--limit", "1")
    assert f"(more: --after {as_json['id']})" in paged.out
    assert [f["id"] for f in cli("files", "list", "--json", "--after", as_json["id"]).json()["data"]] == [file_id]
    shown = cli("files", "show", file_id, "--json")
    assert shown.json()["id"] == file_id and "sha256" in cli("files", "show", file_id).out

    deleted = cli("files", "delete", file_id, "--json")
    assert deleted.code == 0 and deleted.json() == {"id": file_id, "object": "file", "deleted": True}
    gone = cli("files", "show", file_id)
    assert gone.code == 1
    one_error_line(gone, f"No file with id '{file_id}'.", "HTTP 404", "file_not_found")


def test_a_bad_upload_is_an_error_line_with_the_param_then_each_bad_row(cli: Cli, env: TenantKey,
                                                                         tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p"}\nnot json\n')
    r = cli("files", "upload", str(bad))
    assert r.code == 1 and r.out == ""
    first, *rows = r.err.splitlines()
    assert first.startswith("loraplane: error: The file is not valid training data (2 problem(s)); first: line 1:")
    assert "[param: file]" in first
    assert rows == ["  line 1: 'completion' must be a non-empty string", "  line 2: invalid JSON: Expecting value"]
    as_json = cli("files", "upload", str(bad), "--json")
    assert as_json.code == 1 and as_json.json()["error"]["error_count"] == 2  # the API's error object
    missing = cli("files", "upload", str(tmp_path / "missing.jsonl"))
    assert missing.code == 2
    one_error_line(missing, "missing.jsonl: No such file or directory")


def test_models(cli: Cli, env: TenantKey) -> None:
    r = cli("models")
    assert r.code == 0 and r.out.splitlines()[0].split() == ["ID", "KIND", "PARAMS", "DESCRIPTION"]
    assert "tiny-random-llama" in r.out
    assert "tiny-random-llama" in {m["id"] for m in cli("models", "--json").json()["data"]}
    assert cli("models", "tiny-random-llama", "--json").json()["id"] == "tiny-random-llama"
    missing = cli("models", "nope")
    assert missing.code == 1
    one_error_line(missing, "model_not_found")


# ---- tasks -------------------------------------------------------------------------------------------------------


TASK_YAML = """\
# a 2x2 grid: 4 trials
base_model: tiny-random-llama
training_file: data/train.jsonl        # a local path: uploaded first
validation_split: 0.2
search_space:
  learning_rate: [1e-3, 3e-3]
  lora_rank: [4, 8]
max_steps: 30
max_seq_len: 64
"""


def test_tasks_create_from_yaml_uploads_a_local_training_file(cli: Cli, env: TenantKey, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(chat_rows(20))
    spec = tmp_path / "task.yaml"
    spec.write_text(TASK_YAML)
    monkeypatch.chdir(ROOT)  # the path is relative to the spec file, not to where the command runs
    r = cli("tasks", "create", str(spec), "--json")
    assert r.code == 0, r.err
    task = r.json()
    assert task["object"] == "task" and task["state"] == "queued" and task["trial_counts"]["pending"] == 4
    assert task["search_space"]["learning_rate"] == [1e-3, 3e-3]  # numbers, not the strings YAML 1.1 reads
    assert task["training_file"].startswith("file-") and task["validation_split"] == 0.2
    assert r.err == f"uploaded data/train.jsonl as {task['training_file']} (20 rows, messages)\n"

    human = cli("tasks", "create", str(spec))
    assert human.code == 0 and " queued: 4 trials of tiny-random-llama on file-" in human.out
    assert "loraplane tasks watch task-" in human.out


def test_tasks_create_from_json_stdin_and_file_ids(cli: Cli, env: TenantKey, lp: Client, tmp_path: Path) -> None:
    f = lp.files.upload(chat_rows())
    body = task_body(f.id)
    spec = tmp_path / "task.json"
    spec.write_text(json.dumps(body))
    by_file = cli("tasks", "create", str(spec), "--json", "--idempotency-key", "once")
    assert by_file.code == 0 and by_file.err == "" and by_file.json()["training_file"] == f.id
    again = cli("tasks", "create", str(spec), "--json", "--idempotency-key", "once")
    assert again.json()["id"] == by_file.json()["id"]
    from_stdin = cli("tasks", "create", "-", "--json", stdin=json.dumps(body))
    assert from_stdin.code == 0 and from_stdin.json()["id"] != by_file.json()["id"]
    no_extension = tmp_path / "spec"
    no_extension.write_text(json.dumps(body))  # JSON by content
    assert cli("tasks", "create", str(no_extension), "--json").json()["training_file"] == f.id


def test_tasks_create_errors(cli: Cli, env: TenantKey, lp: Client, tmp_path: Path) -> None:
    f = lp.files.upload(chat_rows())
    spec = tmp_path / "task.yaml"
    spec.write_text(f"base_model: tiny-random-llama\ntraining_file: {f.id}\nsearch_space:\n  learning_rate: [-1e-3]\n")
    refused = cli("tasks", "create", str(spec))
    assert refused.code == 1 and refused.out == ""
    one_error_line(refused, "search_space.learning_rate[0]: ", "(HTTP 422, invalid_value)")

    spec.write_text("base_model: tiny-random-llama\ntraining_file: ./nowhere.jsonl\nsearch_space: {}\n")
    missing = cli("tasks", "create", str(spec))
    assert missing.code == 2
    one_error_line(missing, "training_file: no such file: ", "nowhere.jsonl")

    spec.write_text("base_model: [unclosed\n")
    broken = cli("tasks", "create", str(spec))
    assert broken.code == 2
    one_error_line(broken, f"{spec}: line 2: ")
    spec.write_text("- a list\n")
    assert cli("tasks", "create", str(spec)).code == 2
    assert cli("tasks", "create", str(tmp_path / "absent.yaml")).code == 2
    for deep in (tmp_path / "deep.yaml", tmp_path / "deep.json"):  # the parsers' RecursionError, not a traceback
        deep.write_text('{"base_model": ' + "[" * 50_000 + "]" * 50_000 + "}")
        too_deep = cli("tasks", "create", str(deep))
        assert too_deep.code == 2
        one_error_line(too_deep, f"{deep}: nested too deeply to read")
    assert lp.tasks.list().data == []


def test_tasks_list_show_cancel(cli: Cli, env: TenantKey, lp: Client) -> None:
    done_id = submit(lp)
    trial_ids = sim.finish(done_id, [5.2, 4.9, None, 5.0], states=["completed", "completed", "failed", "completed"])
    queued_id = submit(lp)

    listed = cli("tasks", "list")
    assert listed.code == 0
    assert listed.out.splitlines()[0].split() == ["ID", "STATE", "PROGRESS", "TRIALS", "BEST", "VAL", "MODEL",
                                                  "CREATED"]
    rows = [line.split() for line in listed.out.splitlines()[1:]]
    assert [r[:5] for r in rows] == [[queued_id, "queued", "0%", "0/4", "-"],
                                     [done_id, "succeeded", "100%", "4/4", "4.9000"]]
    assert [t["id"] for t in cli("tasks", "list", "--state", "succeeded", "--json").json()["data"]] == [done_id]
    assert f"(more: --after {queued_id})" in cli("tasks", "list", "--limit", "1").out

    shown = cli("tasks", "show", done_id)
    assert shown.code == 0, shown.err
    lines = shown.out.splitlines()
    assert lines[0].split()[:3] == [done_id, "succeeded", "100%"]
    header = next(i for i, line in enumerate(lines) if line.startswith("#"))
    # Trials by validation loss, the one without any last.
    assert [line.split()[1] for line in lines[header + 1:header + 5]] == [trial_ids[i] for i in (1, 3, 0, 2)]
    assert "  #2: CUDA out of memory" in lines
    assert f"best trial: {trial_ids[1]} (#1)  val loss 4.9000 at step 4  lr=0.0001 rank=16 alpha=32" in shown.out
    as_json = cli("tasks", "show", done_id, "--json").json()
    assert as_json["task"]["id"] == done_id
    assert [t["id"] for t in as_json["trials"]] == [trial_ids[i] for i in (1, 3, 0, 2)]
    assert "best trial: none yet" in cli("tasks", "show", queued_id).out

    cancelled = cli("tasks", "cancel", queued_id)
    assert cancelled.code == 0 and cancelled.out == f"{queued_id} cancelled: 4 cancelled\n"
    again = cli("tasks", "cancel", queued_id, "--json")
    assert again.code == 1 and again.json()["error"]["code"] == "task_finished"
    one_error_line(again, "HTTP 409, task_finished")
    missing = cli("tasks", "show", "task-missing")
    assert missing.code == 1
    one_error_line(missing, "No task with id 'task-missing'.", "task_not_found")


def test_tasks_show_a_generative_metric_with_its_column_and_ranking(cli: Cli, env: TenantKey, lp: Client) -> None:
    task_id = submit(lp, evaluation={"metric": "regex", "pattern": r"^\d+$", "max_new_tokens": 8})
    # Trial 1 has the lowest validation loss, trial 3 the highest score; trial 2 failed before it was scored.
    trial_ids = sim.finish(task_id, [5.2, 4.9, None, 5.0], states=["completed", "completed", "failed", "completed"],
                           metric_scores=[0.5, 0.25, None, 0.75])
    task = lp.tasks.get(task_id)
    assert (task.metric, task.scored) == ("regex", True)
    assert task.evaluation == {"metric": "regex", "max_new_tokens": 8, "pattern": r"^\d+$"}
    assert task.best_trial is not None and (task.best_trial.id, task.best_trial.metric_score) == (trial_ids[3], 0.75)
    assert [t.metric_score for t in lp.tasks.trials(task_id)] == [0.5, 0.25, None, 0.75]
    metrics = lp.tasks.metrics(task_id, trial_ids[3])
    assert [(p.step, p.score) for p in metrics.metric] == [(4, 0.75)]

    shown = cli("tasks", "show", task_id)
    assert shown.code == 0, shown.err
    lines = shown.out.splitlines()
    assert "  judged by   regex /^\\d+$/ on the validation rows, up to 8 new tokens per answer" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("#"))
    assert lines[header].split()[:8] == ["#", "TRIAL", "STATE", "STEPS", "TRAIN", "BEST", "VAL", "METRIC"]
    rows = [line.split() for line in lines[header + 1:header + 5]]
    # By score (the one without any last), each with its score.
    assert [(r[1], r[6]) for r in rows] == [(trial_ids[3], "0.750"), (trial_ids[0], "0.500"),
                                            (trial_ids[1], "0.250"), (trial_ids[2], "-")]
    assert f"best trial: {trial_ids[3]} (#3)  regex 0.750  val loss 5.0000" in shown.out

    loss_id = submit(lp)
    sim.finish(loss_id, [5.2, 4.9, 5.1, 5.0])
    plain = cli("tasks", "show", loss_id).out
    assert "METRIC" not in plain and "judged by" not in plain and "best trial: " in plain


def test_tasks_download_unpacks_adapters(cli: Cli, env: TenantKey, lp: Client, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    task_id = submit(lp)
    not_ready = cli("tasks", "download", task_id, "-o", str(tmp_path / "early"))
    assert not_ready.code == 1
    one_error_line(not_ready, "has no best trial yet", "adapter_not_ready")
    trial_ids = sim.finish(task_id, [5.2, 4.9, 5.1, 5.0])

    best = cli("tasks", "download", task_id, "-o", str(tmp_path / "best"))
    assert best.code == 0, best.err
    assert f"the best trial, {trial_ids[1]} (val loss 4.9000" in best.out
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "best" / "adapter_config.json").read_text())["r"] == 16

    monkeypatch.chdir(tmp_path)
    one = cli("tasks", "download", task_id, "--trial", trial_ids[0], "--json")
    assert one.code == 0 and one.json() == {
        "task_id": task_id, "trial_id": trial_ids[0], "directory": f"{task_id}-{trial_ids[0]}-adapter",
        "files": ["adapter_config.json", "adapter_model.safetensors"]}
    assert json.loads((tmp_path / one.json()["directory"] / "adapter_config.json").read_text())["r"] == 8

    curves = cli("tasks", "curves", task_id, "-o", str(tmp_path / "curves.jsonl"))
    assert curves.code == 0 and "4 trials' curves written to" in curves.out
    lines = (tmp_path / "curves.jsonl").read_text().splitlines()
    assert [json.loads(line)["trial_id"] for line in lines] == trial_ids
    assert cli("tasks", "curves", task_id).out.splitlines() == lines


# ---- watch ---------------------------------------------------------------------------------------------------------


def test_watch_follows_a_running_task_and_exits_0_when_it_succeeds(cli: Cli, env: TenantKey, lp: Client) -> None:
    task_id = submit(lp)
    worker = sim.later(0.3, lambda: sim.start(task_id), lambda: sim.finish(task_id, [3.0, 2.0, 2.5, 2.8]))
    r = cli("tasks", "watch", task_id)
    worker.join()
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == f"{task_id} queued 0% (4 pending)"
    events = [line.split()[1] for line in lines if line[:2].isdigit() and line[2] == ":"]
    assert events[0] == "task.created" and events[-1] == "task.succeeded"
    assert events.count("trial.running") == 4 and events.count("trial.completed") == 4
    assert lines[-3].startswith(f"{task_id} succeeded in ") and lines[-3].endswith(": 4 completed.")
    best = lp.tasks.get(task_id).best_trial
    assert best is not None
    assert lines[-2] == (f"best trial: {best.id} (#1)  val loss 2.0000 at step 4  lr=0.0001 rank=16 alpha=32 batch=4 "
                         "dropout=0 modules=all-linear seed=1")
    assert lines[-1] == f"download it: loraplane tasks download {task_id}"


def test_watch_exits_4_when_the_task_fails_or_is_cancelled(cli: Cli, env: TenantKey, lp: Client) -> None:
    failed_id = submit(lp)
    sim.finish(failed_id, [None] * 4, states=["failed"] * 4)
    r = cli("tasks", "watch", failed_id)
    assert r.code == 4 and r.out.splitlines()[-1] == f"{failed_id} failed in 0s: no trial completed: CUDA out of memory"

    cancelled_id = submit(lp)
    sim.later(0.3, lambda: lp.tasks.cancel(cancelled_id))
    r = cli("tasks", "watch", cancelled_id, "--json")
    assert r.code == 4
    objects = r.json_lines()
    assert [o["type"] for o in objects[:-1]] == ["task.created", "task.small_validation", "task.cancelled"]
    assert objects[-1]["object"] == "task" and objects[-1]["state"] == "cancelled"


def test_watch_timeout_exits_5_and_an_unknown_task_exits_1(cli: Cli, env: TenantKey, lp: Client) -> None:
    task_id = submit(lp)
    r = cli("tasks", "watch", task_id, "--timeout", "0.5")
    assert r.code == 5
    one_error_line(r, f"{task_id} is not finished after the timeout")
    missing = cli("tasks", "watch", "task-missing")
    assert missing.code == 1 and missing.out == ""
    one_error_line(missing, "task_not_found")


def test_create_with_watch(cli: Cli, env: TenantKey, lp: Client, tmp_path: Path) -> None:
    f = lp.files.upload(chat_rows())
    spec = tmp_path / "task.json"
    spec.write_text(json.dumps(task_body(f.id, max_steps=4, epochs=None)))

    def finish_newest() -> None:
        newest = lp.tasks.list(limit=1).data[0].id
        sim.finish(newest, [3.0, 2.0, 2.5, 2.8])

    sim.later(0.5, finish_newest)
    r = cli("tasks", "create", str(spec), "--watch", "--json")
    assert r.code == 0, r.err
    objects = r.json_lines()
    assert objects[0]["type"] == "task.created" and objects[-1]["state"] == "succeeded"


class Terminal(io.StringIO):
    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


def test_watch_on_a_terminal_redraws_a_progress_bar_and_the_trials(env: TenantKey, lp: Client,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplane.commands.watch import watch

    # The screen's size as a terminal of 100 x 30 says it (else whatever the process running the tests inherited).
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("LINES", "30")
    task_id = submit(lp)
    # The task runs for more than the view's redraw period (REFRESH_S), so a frame always catches it running.
    sim.later(1.2, lambda: sim.start(task_id, steps_done=2), lambda: sim.finish(task_id, [3.0, 2.0, 2.5, 2.8]))
    screen = Terminal()
    assert watch(lp, task_id, stream=screen) == 0
    text = screen.getvalue()
    assert text.startswith("\x1b[?25l") and "\x1b[?25h" in text  # the cursor hidden while drawing, then back
    frames = text.split("\x1b[J")[1:]
    # Each frame is followed by a move back up over it (cursor up N lines), then cleared and redrawn.
    assert len(frames) >= 3 and all(re.search(r"\n\x1b\[\d+F$", f) for f in frames[:-1]), frames
    assert f"{task_id}  queued  [░░░░░░░░░░░░░░░░░░░░░░░░]   0%  4 pending" in frames[0]
    assert any("running  [" in f and "50%  4 running" in f and "2/4" in f for f in frames)
    last = frames[-1]
    assert f"{task_id}  succeeded  [████████████████████████] 100%  4 completed" in last
    assert last.splitlines()[1].split() == ["#", "STATE", "STEPS", "TRAIN", "BEST", "VAL", "HYPERPARAMETERS"]
    assert "task.succeeded: 4 of 4 trials completed; best is trial 1" in last
    assert last.rstrip().splitlines()[-1] == f"download it: loraplane tasks download {task_id}"


# ---- admin -----------------------------------------------------------------------------------------------------------


def test_admin_tenants_and_keys(cli: Cli, api_url: str, clean_db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_API_URL", api_url)
    created = cli("admin", "tenants", "create", "acme", "--weight", "2", "--max-trials-per-task", "8", "--json")
    assert created.code == 0, created.err
    tenant = created.json()
    assert (tenant["object"], tenant["name"], tenant["weight"], tenant["max_trials_per_task"]) == (
        "tenant", "acme", 2.0, 8)
    human = cli("admin", "tenants", "create", "globex")
    assert human.code == 0 and "globex" in human.out and "next: loraplane admin keys create globex" in human.out
    dup = cli("admin", "tenants", "create", "acme")
    assert dup.code == 1
    one_error_line(dup, "A tenant named 'acme' already exists. [param: name] (HTTP 409, tenant_exists)")

    listed = cli("admin", "tenants")
    assert listed.code == 0 and [line.split()[1] for line in listed.out.splitlines()[1:]] == ["globex", "acme"]
    assert [t["name"] for t in cli("admin", "tenants", "--json").json()["data"]] == ["globex", "acme"]
    assert cli("admin", "tenants", "show", "acme", "--json").json()["id"] == tenant["id"]
    assert cli("admin", "tenants", "--json", "show", tenant["id"]).json()["name"] == "acme"  # options before, too

    key = cli("admin", "keys", "create", "acme", "--name", "laptop", "--json")
    assert key.code == 0, key.err
    secret = key.json()["key"]
    assert key.json()["tenant_id"] == tenant["id"] and secret.startswith("lp_")
    shown = cli("admin", "keys", "create", tenant["id"])
    assert shown.code == 0 and "shown only this once" in shown.out
    second_secret = shown.out.split("\n\n")[1].strip()
    assert second_secret.startswith("lp_") and second_secret != secret
    assert cli("models", "--api-key", second_secret).code == 0

    keys = cli("admin", "keys", "--json").json()["data"]
    assert [k["name"] for k in keys] == ["laptop", ""] and all("key" not in k for k in keys)
    table = cli("admin", "keys", "--tenant", "acme")
    assert table.code == 0 and table.out.splitlines()[1].split()[:4] == [keys[0]["id"], "acme", keys[0]["prefix"]
                                                                         + "...", "laptop"]
    revoked = cli("admin", "keys", "revoke", keys[0]["id"])
    assert revoked.code == 0 and revoked.out.startswith(f"Revoked {keys[0]['id']}")
    refused = cli("models", "--api-key", secret)
    assert refused.code == 1
    one_error_line(refused, "invalid_api_key")
    assert cli("admin", "keys", "create", "initech").code == 2  # no such tenant name

    workers = cli("admin", "workers")
    assert workers.code == 0 and workers.out == "No workers.\n"
    assert cli("admin", "workers", "--json").json()["data"] == []

    deleted = cli("admin", "tenants", "delete", "acme")
    assert deleted.code == 0, deleted.err
    assert deleted.out.startswith(f"Deleted tenant acme ({tenant['id']}) at ") and "keys are revoked" in deleted.out
    refused = cli("models", "--api-key", second_secret)
    assert refused.code == 1
    one_error_line(refused, "invalid_api_key")
    assert [t["name"] for t in cli("admin", "tenants", "--json").json()["data"]] == ["globex"]
    everyone = cli("admin", "tenants", "--include-deleted")
    assert everyone.code == 0 and everyone.out.splitlines()[0].split()[-1] == "DELETED"
    assert [line.split()[1] for line in everyone.out.splitlines()[1:]] == ["globex", "acme"]
    assert cli("admin", "tenants", "delete", "acme").code == 2  # no (live) tenant of that name any more
    gone = cli("admin", "tenants", "delete", tenant["id"])
    assert gone.code == 1
    one_error_line(gone, "(HTTP 404, tenant_not_found)")
    assert cli("admin", "tenants", "delete", "globex", "--json").json()["deleted_at"].endswith("Z")

    wrong = cli("admin", "tenants", "--admin-token", "wrong")
    assert wrong.code == 1
    one_error_line(wrong, "The admin token is not valid.", "HTTP 403")
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN")
    none = cli("admin", "workers")
    assert none.code == 2
    one_error_line(none, "no admin token: give --admin-token or set LORAPLANE_ADMIN_TOKEN")


# ---- the installed command ---------------------------------------------------------------------------------------


def test_the_command_runs_as_a_process_with_its_exit_code(api_url: str, tenant: TenantKey, tmp_path: Path) -> None:
    env = {**os.environ, "LORAPLANE_API_URL": api_url, "LORAPLANE_API_KEY": tenant.key,
           "PYTHONPATH": str(ROOT)}
    missing = subprocess.run([sys.executable, "-m", "loraplane.cli", "tasks", "show", "task-missing"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == ("loraplane: error: No task with id 'task-missing'. (HTTP 404, task_not_found)\n")
    models = subprocess.run([sys.executable, "-m", "loraplane.cli", "models", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert models.returncode == 0 and json.loads(models.stdout)["object"] == "list" and models.stderr == ""


def test_the_client_and_its_commands_import_nothing_of_the_service() -> None:
    """Dependencies point one way: a laptop with the client needs neither the service's code nor its stack."""
    code = (
        "import sys, loraplane.client\n"
        "from loraplane.cli import build_parser\n"
        "build_parser()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'api', 'common', 'scheduler', 'worker', 'kernels', 'torch', 'sqlalchemy', 'fastapi', 'celery', 'redis'})\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_admin_models_add_list_remove(
    cli: Cli, api_url: str, tenant: TenantKey, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLANE_API_URL", api_url)
    added = cli("admin", "models", "add", "acme/tiny", str(tiny_model_dir), "--description", "ours",
                "--tenant", "acme", "--json")
    assert added.code == 0, added.err
    model = added.json()
    assert (model["name"], model["kind"], model["architecture"], model["tenants"]) == (
        "acme/tiny", "hf", "llama", [tenant.id])

    human = cli("admin", "models", "list")
    assert human.code == 0 and "acme/tiny" in human.out and "llama" in human.out and "acme" in human.out
    names = [m["name"] for m in cli("admin", "models", "list", "--json").json()["data"]]
    assert "acme/tiny" in names and "tiny-random-llama" in names
    with Client(api_url, tenant.key) as lp:
        assert lp.models.get("acme/tiny").target_modules[:2] == ["q_proj", "k_proj"]  # type: ignore[index]

    dup = cli("admin", "models", "add", "acme/tiny", str(tiny_model_dir))
    assert dup.code == 1 and "already exists" in dup.err
    broken = cli("admin", "models", "add", "other", str(tiny_model_dir / "nowhere"))
    assert broken.code == 1 and "does not exist" in broken.err

    removed = cli("admin", "models", "remove", "acme/tiny")
    assert removed.code == 0 and "Removed model acme/tiny" in removed.out
    assert "acme/tiny" not in [m["name"] for m in cli("admin", "models", "--json").json()["data"]]
    assert cli("admin", "models", "remove", "acme/tiny").code == 1

    retired = cli("admin", "models", "list", "--include-deleted")
    assert retired.code == 0 and "RETIRED" in retired.out.splitlines()[0]
    assert [line.split()[0] for line in retired.out.splitlines()[1:]].count("acme/tiny") == 1
    restored = cli("admin", "models", "restore", "acme/tiny")
    assert restored.code == 0 and restored.out == "Restored model acme/tiny: new tasks can use it again.\n"
    assert "acme/tiny" in [m["name"] for m in cli("admin", "models", "--json").json()["data"]]
    again = cli("admin", "models", "restore", "acme/tiny", "--json")
    assert again.code == 1
    one_error_line(again, "(HTTP 409, model_exists)")
    assert cli("admin", "models", "remove", "tiny-random-llama").code == 0
    assert cli("admin", "models", "restore", "tiny-random-llama", "--json").json()["deleted_at"] is None


def test_usage_for_a_tenant_and_for_the_operator(
    cli: Cli, api_url: str, clean_db: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAPLANE_API_URL", api_url)
    tenant = cli("admin", "tenants", "create", "initech", "--json").json()
    secret = cli("admin", "keys", "create", "initech", "--json").json()["key"]
    (tmp_path / "train.jsonl").write_bytes(chat_rows(5))
    assert cli("files", "upload", str(tmp_path / "train.jsonl"), "--api-key", secret).code == 0
    mine = cli("usage", "--api-key", secret, "--json")
    assert mine.code == 0, mine.err
    assert (mine.json()["tenant_id"], mine.json()["gpu_seconds"], mine.json()["tokens"]) == (tenant["id"], 0.0, 0)
    assert mine.json()["storage_bytes"] > 0
    human = cli("usage", "--api-key", secret, "--from", "2026-01-01", "--to", "2026-02-01")
    assert human.code == 0 and human.out.splitlines()[0].split()[:3] == ["TENANT", "GPU", "HOURS"], human.out
    assert human.out.splitlines()[1].split()[:4] == [tenant["id"], "0.000", "0.0", "0"]
    bad = cli("usage", "--api-key", secret, "--from", "2026-02-01", "--to", "2026-01-01")
    assert bad.code == 1
    one_error_line(bad, "'from' must be before 'to'. [param: from] (HTTP 422, invalid_value)")
    everyone = cli("admin", "usage")
    assert everyone.code == 0 and any(line.split()[0] == "initech" for line in everyone.out.splitlines()[1:])
    assert tenant["id"] in [u["tenant_id"] for u in cli("admin", "usage", "--json").json()["data"]]


def test_webhooks_add_list_deliveries_and_remove(cli: Cli, env: TenantKey, lp: Client) -> None:
    with allowed_networks("127.0.0.1"):  # the operator's allow-list: loopback is refused otherwise
        added = cli("webhooks", "add", "http://127.0.0.1:9/hook", "--event", "task.cancelled", "--description", "ci")
    assert added.code == 0, added.err
    secret = added.out.split("\n\n")[1].strip()
    assert secret.startswith("whsec_") and "shown only this once" in added.out
    (hook,) = cli("webhooks", "list", "--json").json()["data"]
    assert (hook["url"], hook["events"], hook["description"]) == ("http://127.0.0.1:9/hook", ["task.cancelled"], "ci")
    assert "secret" not in hook and secret not in cli("webhooks", "list").out
    bad = cli("webhooks", "add", "ftp://example.com/hook")
    assert bad.code == 1
    one_error_line(bad, "url: must be an http or https URL. (HTTP 422, invalid_url)")

    task_id = submit(lp)
    assert cli("tasks", "cancel", task_id).code == 0  # task.cancelled: one delivery in the outbox
    log = cli("webhooks", "deliveries", hook["id"], "--json").json()["data"]
    assert [(d["event_type"], d["state"], d["attempts"]) for d in log] == [("task.cancelled", "pending", 0)]
    table = cli("webhooks", "deliveries", hook["id"])
    assert table.code == 0 and table.out.splitlines()[1].split()[1:4] == ["task.cancelled", "pending", "0"]

    removed = cli("webhooks", "remove", hook["id"])
    assert removed.code == 0 and removed.out == f"Removed {hook['id']}.\n"
    assert cli("webhooks", "list").out == "No webhooks.\n"
    gone = cli("webhooks", "deliveries", hook["id"])
    assert gone.code == 1
