"""Schemathesis over the whole OpenAPI of the app, in process, with real ids: no input answers a 5xx, every
4xx is the one error shape, and a method a path does not take is a 405 with `Allow`.

Path parameters (and the task body's file and model) are mostly drawn from objects that exist (a tenant, a
key of its own, an uploaded file, a queued task and its trials; the event stream gets a cancelled task), so
requests reach the code behind the 404s; the rest are generated. Values that broke the API before (NUL and
other control characters, integers past a column's range) are mixed into the generated ones. Tenant routes
are called with the tenant's key, admin routes with the admin token. Seeded and deterministic: every run
sends the same requests.

Schemathesis's own runner (the engine behind its CLI) drives the phases: the schema's examples, the coverage
phase (boundary values, missing and wrong-typed fields, methods a path does not declare) and the fuzzing
phase (`MAX_EXAMPLES` per operation). Its pytest plugin is not used: it does not work with pytest 9.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from fastapi.testclient import TestClient
from schemathesis.engine import Status, events

from tests.factories import ADMIN, ADMIN_TOKEN, TenantKey, make_task, make_tenant, trial_ids, upload

MAX_EXAMPLES = 40  # per operation in the fuzzing phase; with the coverage phase about 3,000 requests in all
SEED = 14
# Values that broke the API before (issue 14), mixed into generated strings and integers: NUL (which Postgres
# cannot store), an ANSI escape, bell, a line break, C1's CSI, '²' (str.isdigit() takes it); integers past
# INTEGER and BIGINT columns, and negative ones.
HOSTILE_STRINGS = ["a\x00b", "\x1b[31mred", "ring\x07", "two\nlines", "csi\x9b", "²"]
HOSTILE_INTEGERS = [2**31, 2**63, 2**64, -1, -(2**63) - 1]


def _mostly(dictionary: str) -> dict[str, Any]:
    """A parameter bound to a dictionary of real values: drawn from it for half the cases, generated for the
    rest (Hypothesis's draws lean towards the dictionary: about 5 requests in 6 carry a real id)."""
    return {"dictionary": dictionary, "probability": 0.5}


def _sometimes(dictionary: str) -> dict[str, Any]:
    """A parameter that carries one of the dictionary's hostile values in about a third of the cases."""
    return {"dictionary": dictionary, "probability": 0.3}


def _config(tenant: TenantKey, *, file_id: str, queued: dict, cancelled: dict, key_id: str,
            webhook_id: str, doomed_id: str) -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        "seed": SEED,
        "workers": 1,
        # No `.schemathesis/` cache in the checkout (issue 32): each run is the same seeded one, nothing to replay.
        "cache": {"enabled": False},
        "generation": {
            "max-examples": MAX_EXAMPLES, "deterministic": True, "allow-x00": True,
            "dictionaries": {"string": {"dictionary": "hostile_strings", "probability": 0.2},
                             "integer": {"dictionary": "hostile_integers", "probability": 0.2}},
        },
        "phases": {"stateful": {"enabled": False}},
        "checks": {
            "enabled": False,
            # 5xx answers are checked in the test's own hook (`after_call`): a 503 that says the service cannot
            # serve now (no live worker to sample with: the answer a valid completion request gets here) is no
            # server error of the client's making.
            "unsupported_method": {"enabled": True},  # 405 with an `Allow` header for an undeclared method
            "allow_header_conformance": {"enabled": True},  # OPTIONS lists exactly the declared methods
        },
        "headers": {"Authorization": f"Bearer {tenant.key}"},
        "dictionaries": {
            "hostile_strings": {"values": HOSTILE_STRINGS},
            "hostile_integers": {"values": HOSTILE_INTEGERS},
            "tasks": {"values": [queued["id"]]},
            "trials": {"values": trial_ids(queued["id"])},
            "files": {"values": [file_id]},
            "tenants": {"values": [tenant.id]},
            "keys": {"values": [key_id]},
            "webhooks": {"values": [webhook_id]},
            "models": {"values": ["tiny-random-llama"]},
        },
        "parameters": {
            "path.task_id": _mostly("tasks"),
            "path.trial_id": _mostly("trials"),
            "path.file_id": _mostly("files"),
            "path.tenant_id": _mostly("tenants"),
            "path.key_id": _mostly("keys"),
            "path.webhook_id": _mostly("webhooks"),
            "path.name": _mostly("models"),
            "body.training_file": _mostly("files"),
            "body.base_model": _mostly("models"),
            # The type-wide dictionaries above reach only parameters a case already has, and no body field:
            # the names of tenants and keys, and the readers' steps and cursors, are bound to them by name.
            "body.name": _sometimes("hostile_strings"),
            "query.step_from": _sometimes("hostile_integers"),
            "query.step_to": _sometimes("hostile_integers"),
            "query.after_step": _sometimes("hostile_integers"),
            "query.after": _sometimes("hostile_integers"),
        },
        "operations": [
            {"include-path-regex": "^/v1/admin", "headers": {"Authorization": f"Bearer {ADMIN_TOKEN}"}},
            {
                # Deleting the tenant the calls use would turn every later tenant call into a 401: deletion gets
                # a tenant of its own, as a fixed value (as the key's revocation below).
                "include-path": "/v1/admin/tenants/{tenant_id}", "include-method": "DELETE",
                "parameters": {"path.tenant_id": doomed_id},
            },
            {
                # Revoking the key the calls use would turn every later tenant call into a 401: revocation gets a
                # key of its own, as a fixed value (Schemathesis reuses ids it read in answers: drawn from a
                # dictionary, it found the calls' own key in a key list and revoked it in some runs).
                "include-path": "/v1/admin/api-keys/{key_id}", "include-method": "DELETE",
                "parameters": {"path.key_id": key_id},
            },
            {
                # The event stream of a task that is not final never ends: it gets the cancelled task, whose
                # stream ends at once with `end`, and any stream is cut after 2 s.
                "include-path": "/v1/tasks/{task_id}/events/stream",
                "parameters": {"path.task_id": cancelled["id"]},
                "request-timeout": 2,
            },
        ],
    })


def _unavailable(response: schemathesis.Response) -> bool:
    """A 503 in the one error shape that says the service cannot serve the request now (no live worker to sample
    with, a sampling timeout): the request was valid; answering it needs a worker this test does not run."""
    try:
        error = response.json()["error"]
    except Exception:  # noqa: BLE001 - no error body: a server error
        return False
    return response.status_code == 503 and error.get("type") == "service_unavailable_error" and error.get("code") in (
        "no_worker", "sampling_timeout")


def test_no_input_answers_a_5xx_and_every_4xx_is_the_one_error_shape(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    queued = make_task(client, tenant, file_id)
    cancelled = make_task(client, tenant, file_id)
    # Registered before the cancel, so its delivery log has a delivery (no sender runs here). Host names resolve
    # from the client fixture's table, never through DNS (tests/egress.py): the fuzzer's URLs query nothing.
    webhook = client.post("/v1/webhooks", headers=tenant.headers, json={"url": "https://example.com/hook"})
    assert webhook.status_code == 201, webhook.text
    r = client.post(f"/v1/tasks/{cancelled['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200, r.text
    # A key of its own for DELETE /v1/admin/api-keys/{key_id}: revoking the key the calls use would turn
    # every later tenant call into a 401.
    r = client.post(f"/v1/admin/tenants/{tenant.id}/api-keys", json={"name": "revocable"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    doomed = make_tenant(client, "doomed")

    config = _config(tenant, file_id=file_id, queued=queued, cancelled=cancelled, key_id=r.json()["id"],
                     webhook_id=webhook.json()["id"], doomed_id=doomed.id)
    schema = schemathesis.openapi.from_asgi("/openapi.json", client.app, config=config)
    statuses: dict[int, int] = {}
    bad_errors: list[str] = []
    server_errors: list[str] = []
    deleted_tenants: set[str] = set()

    @schema.hook
    def after_call(_ctx: schemathesis.HookContext, case: schemathesis.Case, response: schemathesis.Response) -> None:
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500 and not _unavailable(response):
            server_errors.append(f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text}"
                                 f"\n{case.as_curl_command()}")
        tenant_path = case.formatted_path.removeprefix("/v1/admin/tenants/")
        if case.method == "DELETE" and tenant_path != case.formatted_path and response.status_code == 200:
            deleted_tenants.add(tenant_path)
        if 400 <= response.status_code < 500 and response.request.method != "HEAD":
            try:
                error = response.json()["error"]
                assert {"type", "code", "message", "param"} <= set(error)
            except Exception:  # noqa: BLE001 - any other body is the finding
                bad_errors.append(f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text}")

    problems: list[str] = []
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished) and event.status in (Status.FAILURE, Status.ERROR):
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.failure_info is not None:
                        case = event.recorder.cases[case_id].value
                        problems.append(f"{check.name}: {case.method} {case.formatted_path} "
                                        f"{check.failure_info.failure.title}\n{check.failure_info.code_sample}")
        elif isinstance(event, events.NonFatalError):
            problems.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            problems.append(f"fatal: {event.exception!r}")

    assert sum(statuses.values()) > 1000, statuses  # the run really exercised the API
    assert 200 in statuses and 404 in statuses and 422 in statuses, statuses
    assert not problems, "\n\n".join(problems[:20])
    assert not server_errors, "\n\n".join(server_errors[:20])
    assert not bad_errors, "\n".join(bad_errors[:20])
    assert deleted_tenants <= {doomed.id}, deleted_tenants
    # Every tenant call ran as the tenant (its key was never revoked, nor the tenant deleted); the other tenant was.
    r = client.get("/v1/files", headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert client.get(f"/v1/admin/tenants/{doomed.id}", headers=ADMIN).status_code == 404
