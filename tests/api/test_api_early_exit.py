"""The task API's early_exit: alto and asha are accepted, the stored spec is what the scheduler rebuilds its
config from, and the API and scheduler/early_exit/policy.py agree on every parameter's default and range."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import select

from api.schemas.tasks import EARLY_EXIT_MODELS, TaskCreate
from common.db import session_scope
from common.tables import Task
from scheduler.early_exit.config import PARAMETERS, EarlyExitConfig, EarlyExitSpecError, defaults, from_spec
from tests.factories import TenantKey, make_task, task_body


def stored_spec(task_id: str) -> dict[str, Any]:
    with session_scope() as session:
        return dict(session.scalars(select(Task.spec).where(Task.id == task_id)).one()["early_exit"])


@pytest.mark.parametrize("policy", ["alto", "asha", "none"])
def test_a_policy_is_stored_with_all_its_defaults(client: TestClient, tenant: TenantKey, policy: str) -> None:
    task = make_task(client, tenant, early_exit={"policy": policy})
    expected = {"policy": policy, **defaults(policy)}  # type: ignore[arg-type]
    assert task["early_exit"] == expected
    assert stored_spec(task["id"]) == expected
    assert from_spec(stored_spec(task["id"])) == EarlyExitConfig(policy=policy)  # type: ignore[arg-type]


def test_no_early_exit_given_is_none(client: TestClient, tenant: TenantKey) -> None:
    assert make_task(client, tenant)["early_exit"] == {"policy": "none"}


def test_overrides_are_stored_and_rebuild_the_config(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, early_exit={"policy": "alto", "warmup_ratio": 0.1, "keep_ratio": 1,
                                                 "window": 3})
    config = from_spec(stored_spec(task["id"]))
    assert (config.warmup_ratio, config.keep_ratio, config.window, config.tau_gap) == (0.1, 1.0, 3, 0.1)
    asha = make_task(client, tenant, early_exit={"policy": "asha", "reduction_factor": 3})
    assert from_spec(stored_spec(asha["id"])) == EarlyExitConfig(policy="asha", reduction_factor=3)


def test_a_parameter_of_another_policy_says_which_policy_takes_what(client: TestClient, tenant: TenantKey) -> None:
    from tests.factories import upload

    file = upload(client, tenant)
    body = task_body(file["id"], early_exit={"policy": "asha", "window": 3, "tau_gap": 0.2})
    error = client.post("/v1/tasks", headers=tenant.headers, json=body).json()["error"]
    assert error["message"] == ("early_exit.window: 'window' is not a parameter of the 'asha' policy (it takes "
                                "reduction_factor, num_rungs).")
    assert [e["param"] for e in error["errors"]] == ["early_exit.window", "early_exit.tau_gap"]


# ---- the API and the scheduler agree ------------------------------------------------------------------------


def test_api_defaults_are_the_schedulers() -> None:
    for policy, model in EARLY_EXIT_MODELS.items():
        fields = {name: f.default for name, f in model.model_fields.items() if name != "policy"}
        assert fields == defaults(policy)  # type: ignore[arg-type]
        assert set(fields) == set(PARAMETERS[policy])


def _probes(low: float, high: float, kind: type) -> list[Any]:
    step = 1 if kind is int else 1e-9
    return [low - step, low, low + step, high - step, high, high + step, (low + high) / 2, "1", True, None]


@pytest.mark.parametrize(("policy", "name"), [(p, n) for p, params in PARAMETERS.items() for n in params])
def test_api_and_scheduler_accept_the_same_values(policy: str, name: str) -> None:
    bounds = PARAMETERS[policy][name]
    for value in _probes(bounds.low, bounds.high, bounds.kind):
        spec = {"policy": policy, name: value}
        try:
            TaskCreate.model_validate({"base_model": "m", "training_file": "f", "search_space": {},
                                       "early_exit": spec})
            api_ok = True
        except ValidationError:
            api_ok = False
        try:
            from_spec(spec)
            scheduler_ok = True
        except EarlyExitSpecError:
            scheduler_ok = False
        assert api_ok == scheduler_ok, (spec, api_ok, scheduler_ok)
