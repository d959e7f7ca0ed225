"""`loraplane.client.Client` against the real API over HTTP: every method on its happy path and on an
error answer (the API's error object and status), the event stream and its polling fallback."""

from __future__ import annotations

import io
import json
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loraplane.client import (
    APIConnectionError,
    APIError,
    Client,
    ConfigurationError,
    Event,
    File,
    Task,
    WaitTimeout,
    resolve,
    write_config,
)
from tests.client import sim
from tests.conftest import ADMIN_TOKEN
from tests.e2e.procs import free_port
from tests.factories import TenantKey, chat_rows, task_body


@pytest.fixture
def lp(api_url: str, tenant: TenantKey) -> Iterator[Client]:
    with Client(api_url, tenant.key, admin_token=ADMIN_TOKEN) as client:
        yield client


def make_task(lp: Client, **overrides: object) -> Task:
    f = lp.files.upload(chat_rows(), filename="train.jsonl")
    return lp.tasks.create(task_body(f.id, max_steps=4, epochs=None, **overrides))


# ---- files and models --------------------------------------------------------------------------------------


def test_upload_a_path_bytes_and_a_file_object_then_list_get_delete(lp: Client, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_rows(12))
    by_path = lp.files.upload(path)
    by_str = lp.files.upload(str(path))
    by_bytes = lp.files.upload(chat_rows(3), filename="small.jsonl")
    by_handle = lp.files.upload(io.BytesIO(chat_rows(5)), filename="handle.jsonl")
    assert isinstance(by_path, File) and by_path.id.startswith("file-")
    assert (by_path.filename, by_path.rows, by_path.format, by_path.purpose) == ("train.jsonl", 12, "messages",
                                                                                 "fine-tune")
    assert by_path.bytes == len(chat_rows(12)) and by_path.created_at.tzinfo is not None
    assert by_path.raw["object"] == "file" and by_str.rows == 12
    assert (by_bytes.filename, by_bytes.rows, by_handle.rows) == ("small.jsonl", 3, 5)

    first = lp.files.list(limit=3)
    assert [f.id for f in first] == [by_handle.id, by_bytes.id, by_str.id] and first.has_more
    assert first.next_after == by_str.id and first.raw["object"] == "list"
    rest = lp.files.list(after=first.next_after)
    assert [f.id for f in rest] == [by_path.id] and not rest.has_more

    assert lp.files.get(by_path.id) == by_path
    deleted = lp.files.delete(by_path.id)
    assert (deleted.id, deleted.deleted) == (by_path.id, True)
    with pytest.raises(APIError) as err:
        lp.files.get(by_path.id)
    assert (err.value.status_code, err.value.type, err.value.code) == (404, "not_found_error", "file_not_found")


def test_an_invalid_upload_carries_the_api_error_with_every_problem_line(lp: Client) -> None:
    with pytest.raises(APIError) as err:
        lp.files.upload(b'{"prompt": "p"}\nnot json\n', filename="bad.jsonl")
    e = err.value
    assert (e.status_code, e.type, e.code, e.param) == (422, "invalid_request_error", "invalid_file", "file")
    assert e.message.startswith("The file is not valid training data (2 problem(s))")
    assert [x["line"] for x in e.error["errors"]] == [1, 2] and e.body == {"error": e.error}
    assert str(e) == f"{e.message} [param: file] (HTTP 422, invalid_file)"


def test_models_list_and_get(lp: Client) -> None:
    models = lp.models.list()
    assert {"tiny-random-llama", "smollm2-135m-instruct"} <= {m.id for m in models}
    tiny = lp.models.get("tiny-random-llama")
    assert tiny.id == "tiny-random-llama" and tiny.raw["object"] == "model"
    with pytest.raises(APIError) as err:
        lp.models.get("no-such-model")
    assert (err.value.status_code, err.value.code) == (404, "model_not_found")


# ---- tasks ---------------------------------------------------------------------------------------------------


def test_create_list_get_and_cancel_a_task(lp: Client) -> None:
    task = make_task(lp)
    assert task.state == "queued" and task.trial_counts.pending == 4 and task.trial_counts.total == 4
    assert task.progress == 0.0 and task.best_trial is None and not task.done
    assert task.max_steps == 4 and task.search_space["lora_rank"] == [8, 16]
    other = make_task(lp)

    assert [t.id for t in lp.tasks.list()] == [other.id, task.id]
    page = lp.tasks.list(limit=1)
    assert [t.id for t in page] == [other.id] and page.has_more
    assert [t.id for t in lp.tasks.list(after=page.next_after)] == [task.id]
    assert lp.tasks.get(task.id).id == task.id

    cancelled = lp.tasks.cancel(task.id)
    assert cancelled.state == "cancelled" and cancelled.done and cancelled.trial_counts.cancelled == 4
    assert [t.id for t in lp.tasks.list(state="cancelled")] == [task.id]
    assert [t.id for t in lp.tasks.list(state="queued")] == [other.id]
    with pytest.raises(APIError) as err:
        lp.tasks.cancel(task.id)
    assert (err.value.status_code, err.value.type, err.value.code) == (409, "conflict_error", "task_finished")
    with pytest.raises(APIError) as err:
        lp.tasks.list(state="sleeping")
    assert (err.value.status_code, err.value.param) == (422, "state")


def test_an_invalid_task_names_the_offending_field(lp: Client) -> None:
    f = lp.files.upload(chat_rows())
    with pytest.raises(APIError) as err:
        lp.tasks.create(task_body(f.id, search_space={"learning_rate": [-1.0]}))
    e = err.value
    assert (e.status_code, e.code, e.param) == (422, "invalid_value", "search_space.learning_rate[0]")
    assert e.describe().startswith("search_space.learning_rate[0]: ") and "[param:" not in e.describe()


def test_an_idempotency_key_returns_the_first_task(lp: Client) -> None:
    f = lp.files.upload(chat_rows())
    first = lp.tasks.create(task_body(f.id), idempotency_key="retry-1")
    again = lp.tasks.create(task_body(f.id), idempotency_key="retry-1")
    assert again.id == first.id and len(lp.tasks.list()) == 1


def test_trials_metrics_curves_and_adapters(lp: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = make_task(lp)
    with pytest.raises(APIError) as err:
        lp.tasks.download_adapter(task.id, tmp_path / "early")
    assert (err.value.status_code, err.value.code) == (409, "adapter_not_ready")
    assert not (tmp_path / "early").exists()

    ids = sim.finish(task.id, [5.2, 4.9, None, 5.0], states=["completed", "completed", "failed", "completed"])
    task = lp.tasks.get(task.id)
    assert task.state == "succeeded" and task.progress == 1.0 and task.best_trial is not None
    assert task.best_trial.id == ids[1] and task.best_trial.best_val_loss == 4.9
    assert (task.trial_counts.completed, task.trial_counts.failed) == (3, 1)

    trials = lp.tasks.trials(task.id)
    assert [t.index for t in trials] == [0, 1, 2, 3] and [t.id for t in trials] == ids
    assert trials[2].state == "failed" and trials[2].error == "CUDA out of memory" and trials[2].done
    one = lp.tasks.trial(task.id, ids[1])
    assert one == trials[1] and one.hyperparameters["lora_rank"] == 16 and one.steps_done == 4

    metrics = lp.tasks.metrics(task.id, ids[1])
    assert metrics.trial_id == ids[1] and [p.step for p in metrics.train] == [1, 2, 3, 4]
    assert [(p.step, p.loss) for p in metrics.val] == [(4, 4.9)]
    window = lp.tasks.metrics(task.id, ids[1], step_from=2, step_to=3)
    assert [p.step for p in window.train] == [2, 3] and window.val == []

    curves = lp.tasks.curves(task.id)
    assert [c["trial_id"] for c in curves] == ids and curves[1]["val"][0][3] == 4.9

    best = lp.tasks.download_adapter(task.id, tmp_path / "best")
    assert best == tmp_path / "best"
    assert sorted(p.name for p in best.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((best / "adapter_config.json").read_text())["r"] == 16
    monkeypatch.chdir(tmp_path)
    named = lp.tasks.download_adapter(task.id, trial_id=ids[0])  # no directory: named after the archive
    assert named == Path(f"{task.id}-{ids[0]}-adapter")
    assert json.loads((tmp_path / named / "adapter_config.json").read_text())["r"] == 8
    with pytest.raises(APIError) as err:
        lp.tasks.download_adapter(task.id, tmp_path / "failed", trial_id=ids[2])
    assert (err.value.status_code, err.value.code) == (409, "adapter_not_ready")
    with pytest.raises(APIError) as err:
        lp.tasks.metrics(task.id, "trial-missing")
    assert (err.value.status_code, err.value.code) == (404, "trial_not_found")


def test_another_tenants_task_does_not_exist(lp: Client, api_url: str, other_tenant: TenantKey) -> None:
    task = make_task(lp)
    with Client(api_url, other_tenant.key) as theirs:
        for call in (theirs.tasks.get, theirs.tasks.trials, theirs.tasks.cancel, theirs.tasks.events):
            with pytest.raises(APIError) as err:
                call(task.id)
            assert (err.value.status_code, err.value.code) == (404, "task_not_found")
        with pytest.raises(APIError) as err:
            list(theirs.tasks.iter_events(task.id))
        assert err.value.status_code == 404  # an error answer to the stream is raised, not polled around


# ---- events: the stream, polling, waiting ---------------------------------------------------------------


def test_events_pages_and_the_stream_of_a_finished_task(lp: Client) -> None:
    task = make_task(lp)
    sim.start(task.id)
    sim.finish(task.id, [5.0, 4.0, 4.5, 4.8])
    events = lp.tasks.events(task.id, limit=3)  # 4 trials on 2 validation rows: warned
    assert [e.type for e in events] == ["task.created", "task.small_validation", "trial.running"] and events.has_more
    rest = lp.tasks.events(task.id, after=events.next_after)
    everything = [*events, *rest]
    assert everything[-1].type == "task.succeeded" and not rest.has_more
    assert isinstance(everything[0], Event) and everything[0].created_at.tzinfo is not None

    streamed = list(lp.tasks.stream_events(task.id))
    assert [e.id for e in streamed] == [e.id for e in everything]
    assert [e.id for e in lp.tasks.stream_events(task.id, after=everything[-3].id)] == [e.id for e in everything[-2:]]
    assert [e.id for e in lp.tasks.iter_events(task.id)] == [e.id for e in everything]


def test_wait_follows_a_running_task_to_its_end(lp: Client) -> None:
    task = make_task(lp)
    worker = sim.later(0.3, lambda: sim.start(task.id), lambda: sim.finish(task.id, [3.0, 2.0, 2.5, 2.8]))
    seen: list[Event] = []
    done = lp.tasks.wait(task.id, timeout=30, on_event=seen.append)
    worker.join()
    assert done.state == "succeeded" and done.best_trial is not None and done.best_trial.best_val_loss == 2.0
    types = [e.type for e in seen]
    assert types[0] == "task.created" and types[-1] == "task.succeeded"
    assert types.count("trial.running") == 4 and types.count("trial.completed") == 4 and "task.running" in types


def test_a_stream_whose_key_is_revoked_raises_the_api_error(lp: Client, tenant: TenantKey) -> None:
    task = make_task(lp)
    seen: list[str] = []
    with pytest.raises(APIError) as err:
        for event in lp.tasks.iter_events(task.id, timeout=60):
            seen.append(event.type)
            lp.admin.revoke_api_key(tenant.key_id)  # while the stream is open
    # The revocation ends the stream at its next read; what was read before it (the task's first two events) may
    # still come.
    assert seen in (["task.created"], ["task.created", "task.small_validation"])
    assert (err.value.status_code, err.value.type, err.value.code) == (401, "authentication_error", "api_key_revoked")


def test_waiting_past_the_timeout_raises(lp: Client) -> None:
    task = make_task(lp)
    with pytest.raises(WaitTimeout):
        lp.tasks.wait(task.id, timeout=0.8)
    with pytest.raises(WaitTimeout):
        list(lp.tasks.iter_events(task.id, timeout=0.5, poll_interval=0.1))


class BrokenStreams(httpx.HTTPTransport):
    """A proxy in front of the API that cannot pass an event stream: it answers `answer` instead."""

    def __init__(self, answer: httpx.Response) -> None:
        super().__init__()
        self.answer = answer
        self.streams = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events/stream"):
            self.streams += 1
            return self.answer
        return super().handle_request(request)


@pytest.mark.parametrize("answer", [
    httpx.Response(502, html="<html><body>Bad Gateway</body></html>"),
    httpx.Response(200, html="<html>buffered</html>"),
], ids=["bad-gateway", "not-sse"])
def test_without_a_usable_stream_events_are_polled(api_url: str, tenant: TenantKey, answer: httpx.Response) -> None:
    transport = BrokenStreams(answer)
    with Client(api_url, tenant.key, transport=transport) as lp:
        task = make_task(lp)
        worker = sim.later(0.3, lambda: sim.start(task.id), lambda: sim.finish(task.id, [3.0, 2.0, 2.5, 2.8]))
        events = list(lp.tasks.iter_events(task.id, poll_interval=0.1, timeout=30))
        worker.join()
        assert transport.streams == 1
        assert events[0].type == "task.created" and events[-1].type == "task.succeeded"
        assert [e.id for e in events] == [e.id for e in lp.tasks.events(task.id)]  # each once, in order
        assert lp.tasks.wait(task.id, poll_interval=0.1).state == "succeeded"
        with pytest.raises(APIConnectionError, match="event stream"):
            list(lp.tasks.stream_events(task.id))  # the strict stream says so instead


# ---- credentials, connection, admin -------------------------------------------------------------------------


def test_missing_or_wrong_credentials(api_url: str, clean_db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(api_url, "lp_wrong") as wrong:
        with pytest.raises(APIError) as err:
            wrong.models.list()
        e = err.value
        assert (e.status_code, e.type, e.code) == (401, "authentication_error", "invalid_api_key")
    with Client(api_url, admin_token="not-the-token") as bad_admin:
        with pytest.raises(APIError) as err:
            bad_admin.admin.list_tenants()
        assert (err.value.status_code, err.value.code) == (403, "invalid_admin_token")
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN")
    with Client(api_url) as anonymous:  # nothing is sent without the key or token a call needs
        with pytest.raises(ConfigurationError, match="LORAPLANE_API_KEY"):
            anonymous.files.list()
        with pytest.raises(ConfigurationError, match="LORAPLANE_ADMIN_TOKEN"):
            anonymous.admin.list_workers()


def test_an_unreachable_api_is_a_connection_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, "lp_x") as lp:
        with pytest.raises(APIConnectionError) as err:
            lp.models.list()
        assert url in str(err.value) and err.value.url == url
        with pytest.raises(APIConnectionError):
            list(lp.tasks.iter_events("task-x"))


def test_a_non_json_error_answer_still_makes_an_api_error() -> None:
    e = APIError.from_response(httpx.Response(503, html="<html>\n <b>Service Unavailable</b></html>"))
    assert (e.status_code, e.type, e.code, e.param) == (503, "api_error", "http_503", None) and e.is_server_error
    assert e.message == "<html> <b>Service Unavailable</b></html>"


def test_admin_tenants_keys_and_workers(lp: Client, tenant: TenantKey) -> None:
    made = lp.admin.create_tenant("initech", weight=2.0, max_trials_per_task=8)
    assert (made.name, made.weight, made.max_trials_per_task) == ("initech", 2.0, 8)
    assert made.max_concurrent_trials > 0 and made.raw["object"] == "tenant"
    assert {t.name for t in lp.admin.list_tenants()} == {"acme", "initech"}
    page = lp.admin.list_tenants(limit=1)
    assert [t.name for t in page] == ["initech"] and page.has_more
    assert [t.name for t in lp.admin.list_tenants(after=page.next_after)] == ["acme"]
    assert lp.admin.get_tenant(made.id) == made
    assert lp.admin.update_tenant(made.id, weight=3.0).weight == 3.0
    with pytest.raises(APIError) as err:
        lp.admin.create_tenant("initech")
    assert (err.value.status_code, err.value.code, err.value.param) == (409, "tenant_exists", "name")
    with pytest.raises(APIError) as err:
        lp.admin.create_tenant("x", weight=-1)
    assert (err.value.status_code, err.value.param) == (422, "weight")

    key = lp.admin.create_api_key(made.id, name="ci")
    assert key.key and key.key.startswith(key.prefix) and key.tenant_id == made.id and key.revoked_at is None
    with Client(lp.base_url, key.key) as theirs:
        assert theirs.files.list().data == []
        listed = lp.admin.list_api_keys(made.id)
        assert [k.id for k in listed] == [key.id] and listed[0].key is None  # the secret is never listed
        revoked = lp.admin.revoke_api_key(key.id)
        assert revoked.revoked_at is not None
        with pytest.raises(APIError) as err:
            theirs.files.list()
        assert err.value.status_code == 401
    with pytest.raises(APIError) as err:
        lp.admin.revoke_api_key("key-missing")
    assert (err.value.status_code, err.value.code) == (404, "api_key_not_found")
    with pytest.raises(APIError) as err:
        lp.admin.get_tenant("tenant-missing")
    assert (err.value.status_code, err.value.code) == (404, "tenant_not_found")
    assert lp.admin.list_workers().data == []
    from common.db import session_scope
    from common.tables import Worker

    with session_scope() as session:
        session.add(Worker(id="gpu-0", queue="lp:gpu-0", device="cuda:0", memory_bytes=80 << 30, max_slots=8,
                           state="alive"))
    (worker,) = lp.admin.list_workers()
    assert (worker.id, worker.device, worker.memory_bytes, worker.state) == ("gpu-0", "cuda:0", 80 << 30, "alive")
    assert worker.last_heartbeat.tzinfo is not None and worker.current_pack_id is None


def test_admin_deletes_a_tenant_and_restores_a_model(lp: Client, tenant: TenantKey) -> None:
    made = lp.admin.create_tenant("initech")
    task = make_task(lp)
    assert made.deleted_at is None
    deleted = lp.admin.delete_tenant(tenant.id)
    assert deleted.id == tenant.id and deleted.deleted_at is not None and deleted.deleted_at.tzinfo is not None
    assert [t.id for t in lp.admin.list_tenants()] == [made.id]
    assert {t.id: t.deleted_at is not None for t in lp.admin.list_tenants(include_deleted=True)} == {
        made.id: False, tenant.id: True}
    with pytest.raises(APIError) as err:
        lp.tasks.get(task.id)  # its key
    assert (err.value.status_code, err.value.code) == (401, "invalid_api_key")
    with pytest.raises(APIError) as err:
        lp.admin.delete_tenant(tenant.id)
    assert (err.value.status_code, err.value.code) == (404, "tenant_not_found")

    lp.admin.delete_model("tiny-random-llama")
    restored = lp.admin.restore_model("tiny-random-llama")
    assert (restored.name, restored.deleted_at) == ("tiny-random-llama", None)
    assert lp.admin.get_model("tiny-random-llama") == restored
    for name, status, code in (("tiny-random-llama", 409, "model_exists"), ("nope", 404, "model_not_found")):
        with pytest.raises(APIError) as err:
            lp.admin.restore_model(name)
        assert (err.value.status_code, err.value.code) == (status, code)


def test_the_other_methods_raise_the_api_error_too(lp: Client) -> None:
    task = make_task(lp)
    calls: list[tuple[Callable[[], object], int, str]] = [
        (lambda: lp.files.list(after="file-missing"), 422, "invalid_cursor"),
        (lambda: lp.files.delete("file-missing"), 404, "file_not_found"),
        (lambda: lp.tasks.trial(task.id, "trial-missing"), 404, "trial_not_found"),
        (lambda: lp.tasks.curves("task-missing"), 404, "task_not_found"),
        (lambda: lp.tasks.events(task.id, limit=0), 422, "invalid_value"),
        (lambda: list(lp.tasks.stream_events("task-missing")), 404, "task_not_found"),
        (lambda: lp.tasks.wait("task-missing"), 404, "task_not_found"),
        (lambda: lp.admin.update_tenant("tenant-missing", weight=2.0), 404, "tenant_not_found"),
        (lambda: lp.admin.create_api_key("tenant-missing"), 404, "tenant_not_found"),
        (lambda: lp.admin.list_api_keys("tenant-missing"), 404, "tenant_not_found"),
    ]
    for call, status, code in calls:
        with pytest.raises(APIError) as err:
            call()
        assert (err.value.status_code, err.value.code) == (status, code), err.value


# ---- settings -------------------------------------------------------------------------------------------------


def test_settings_come_from_arguments_then_environment_then_the_config_file(
    isolated_settings: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve().base_url == "http://127.0.0.1:8000" and resolve().api_key is None
    path = write_config("http://file:1/", "lp_file")
    assert path == isolated_settings and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert (resolve().base_url, resolve().api_key) == ("http://file:1", "lp_file")
    monkeypatch.setenv("LORAPLANE_API_URL", "http://env:2")
    monkeypatch.setenv("LORAPLANE_API_KEY", "lp_env")
    assert (resolve().base_url, resolve().api_key) == ("http://env:2", "lp_env")
    assert (resolve("http://arg:3", "lp_arg").base_url, resolve("http://arg:3", "lp_arg").api_key) == (
        "http://arg:3", "lp_arg")
    assert resolve().admin_token == ADMIN_TOKEN and resolve(admin_token="t").admin_token == "t"
    client = Client()
    assert (client.base_url, client.api_key) == ("http://env:2", "lp_env")
    client.close()
