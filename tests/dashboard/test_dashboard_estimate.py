"""The submit form shows the task's estimate before submission (issue 32, point 3): its wall time with the band the
actual is expected in and what it rests on (the priors of the workers' device kind, or a fit from the model's packs
on it), the same as the task's dry run answers. In headless Chromium against `loraplane up`; any console error fails
the test (conftest.py)."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import Service, missing_requirement
from tests.dashboard.test_dashboard import shot, sign_in
from tests.e2e.flow import arithmetic_rows, wait_for

if (missing := missing_requirement()) is not None:
    pytest.skip(missing, allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402  (only once we know it is installed)


def duration(seconds: float) -> str:
    """A duration as the submit form writes it (submit.js `wallText`: tenths under 10 s, else dom.js's)."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = max(0, math.floor(seconds + 0.5))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    return f"{s // 3600}h {(s % 3600) // 60}m"


def test_the_submit_form_shows_the_estimate_with_its_band_and_basis(page: Any, service: Service) -> None:
    headers = {"Authorization": f"Bearer {service.tenant_key}"}
    answer = httpx.post(f"{service.base_url}/v1/files", headers=headers,
                        files={"file": ("est.jsonl", arithmetic_rows())})
    assert answer.status_code == 201, answer.text
    file_id = answer.json()["id"]
    # The body the form sends for its defaults with this file, 6 steps and 64 tokens (submit.js `taskBody`).
    body = {"search_space": {"target_modules": "all-linear"}, "strategy": "grid", "seed": 0,
            "base_model": "tiny-random-llama", "training_file": file_id, "max_seq_len": 64,
            "early_exit": {"policy": "none"}, "validation_split": 0.2, "max_steps": 6}

    def dry_run() -> dict[str, Any] | None:
        r = httpx.post(f"{service.base_url}/v1/tasks?dry_run=true", headers=headers, json=body)
        assert r.status_code == 200, r.text
        estimate: dict[str, Any] = r.json()["estimate"]
        return estimate if estimate["wall_seconds"] is not None else None

    wait_for(dry_run, 120, "the service's worker to be alive (an estimate with a wall time)")

    sign_in(page, service.tenant_key)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="New task").click()
    expect(page.get_by_role("heading", name="New task")).to_be_visible()
    shown = page.locator("#task-estimate")
    expect(shown).to_contain_text("Pick an uploaded file to see the task's estimate")
    page.get_by_label("Base model").select_option("tiny-random-llama")
    page.get_by_label("Max steps").fill("6")
    page.get_by_label("Max sequence length").fill("64")
    page.get_by_label("or a file already uploaded").select_option(file_id)
    expect(shown).to_contain_text("Estimated wall time")

    estimate = dry_run()
    assert estimate is not None
    basis = estimate["basis"]
    assert estimate["wall_seconds_low"] < estimate["wall_seconds"] < estimate["wall_seconds_high"]
    kind = "CPU" if basis["device_kind"] == "cpu" else "GPU"
    expect(shown).to_contain_text(f"Estimated wall time {duration(estimate['wall_seconds'])} (likely "
                                  f"{duration(estimate['wall_seconds_low'])} to "
                                  f"{duration(estimate['wall_seconds_high'])})")
    if basis["source"] == "prior":
        expect(shown).to_contain_text(f"From the {kind} priors: no pack of this model has run on a {kind} worker yet")
    else:
        expect(shown).to_contain_text(f"Fitted from {basis['packs']} pack")
        expect(shown).to_contain_text(f"of this model on {kind} workers")
    assert shown.get_attribute("data-source") == basis["source"]
    shot(page, "estimate-submit-form")
