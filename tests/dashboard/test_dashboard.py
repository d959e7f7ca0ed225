"""The dashboard's journeys in headless Chromium against `loraplane up`: sign in (keyboard only), submit a
task through the form with an uploaded file, watch it train to the end live, download its best adapter;
the operator's cluster and tenants pages. Any console error fails the test (conftest.py)."""

from __future__ import annotations

import os
import re
import tarfile
import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import ARTIFACTS, ROOT, WORKER_ID, Console, Service, missing_requirement
from tests.e2e.flow import arithmetic_rows

if (missing := missing_requirement()) is not None:
    pytest.skip(missing, allow_module_level=True)  # one line in the summary, naming what is missing

from playwright.sync_api import expect  # noqa: E402  (only once we know it is installed)

DOCS_SCREENSHOT = ROOT / "docs" / "dashboard.png"


def shot(page: Any, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def phase_text(seconds: float | None) -> str:
    """A phase's seconds as the cluster page writes them (cluster.js `seconds`). JavaScript's `toFixed` rounds the
    float's exact value half up, Python's format half to even: 0.125 is "0.13" on the page and would be "0.12" here
    (a run of 2026-11-27 failed on it), so the exact value is rounded as JavaScript does."""
    if seconds is None:
        return "—"
    places = Decimal("0.01") if seconds < 10 else Decimal("0.1")
    return f"{Decimal(seconds).quantize(places, rounding=ROUND_HALF_UP)} s"


def sign_in(page: Any, key: str) -> None:
    page.goto("/")
    page.get_by_label("API key").fill(key)
    page.get_by_label("API key").press("Enter")


def test_sign_in_with_the_keyboard_refuses_a_bad_key_then_lands_on_tasks(
    page: Any, service: Service, console: Console
) -> None:
    page.goto("/")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    key = page.get_by_label("API key")
    expect(key).to_be_focused()  # the page puts the keyboard in the field
    page.keyboard.press("Tab")  # the help text between them takes no focus
    expect(page.get_by_role("button", name="Sign in")).to_be_focused()
    page.keyboard.press("Shift+Tab")
    expect(key).to_be_focused()

    console.refusals_allowed = (401, 403)  # the API's answers to the bad key: the browser logs them itself
    page.keyboard.type("lp_not-a-real-key")
    page.keyboard.press("Enter")
    expect(page.get_by_role("alert")).to_contain_text("not accepted")
    expect(key).to_be_focused()
    shot(page, "01-sign-in-refused")
    console.refusals_allowed = ()

    page.keyboard.press("Control+A")
    page.keyboard.type(service.tenant_key)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()
    assert page.evaluate("() => Object.keys(localStorage).length") == 0  # the key is in the session only
    assert page.evaluate("() => sessionStorage.getItem('loraplane.session')").count(service.tenant_key) == 1

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert page.evaluate("() => sessionStorage.length") == 0


def test_submit_a_task_watch_it_train_live_and_download_the_best_adapter(
    page: Any, service: Service, console: Console
) -> None:
    sign_in(page, service.tenant_key)
    fill_in_a_task_of_four_trials(page, console)
    task_id = submit_and_watch_it_train_to_the_end(page)
    best_trial = check_the_curves_and_the_trials_table(page)
    sort_the_table_from_the_keyboard(page, best_trial)
    download_the_adapters(page, task_id, best_trial)
    try_the_playground(page, service, task_id, best_trial)
    leave_the_page(page, task_id)


def fill_in_a_task_of_four_trials(page: Any, console: Console) -> None:
    """The new-task form with an uploaded file; its preview of the grid as it is edited (a bad value, a grid over
    the tenant's quota) until the grid is 2 x 2."""
    page.get_by_role("navigation", name="Main").get_by_role("link", name="New task").click()
    expect(page.get_by_role("heading", name="New task")).to_be_visible()

    page.get_by_label("Training file (JSONL)").set_input_files(
        {"name": "train.jsonl", "mimeType": "application/jsonl", "buffer": arithmetic_rows()})
    page.get_by_label("Base model").select_option("tiny-random-llama")
    count = page.locator("#trial-count")
    expect(count).to_contain_text("expands to 1 trial ")  # every dimension at its default
    auto = page.get_by_label(re.compile("^Choose it for me"))
    auto.check()
    expect(count).to_contain_text("Six trials, chosen when the task is created")
    auto.uncheck()
    expect(count).to_contain_text("expands to 1 trial ")

    lr, rank = page.get_by_label("Learning rate values"), page.get_by_label("LoRA rank values")
    lr.fill("1e-3, nope")
    expect(page.get_by_text("Learning rate: 'nope' is not a number")).to_be_visible()
    console.refusals_allowed = (422,)  # the preview's refusal of the grid below
    lr.fill("1e-3, 3e-3, 5e-3")
    rank.fill("2, 4, 8")
    expect(count).to_contain_text("9 trials; this tenant allows at most 8 per task")  # the server's verdict
    lr.fill("1e-3, 5e-3")
    rank.fill("2, 4")
    expect(count).to_contain_text("expands to 4 trials")
    assert count.get_attribute("data-count") == "4"
    console.refusals_allowed = ()
    page.get_by_label("Max steps").fill("6")
    page.get_by_label("Max sequence length").fill("64")
    shot(page, "02-submit-form")


def submit_and_watch_it_train_to_the_end(page: Any) -> str:
    """Submits the form; the task's page follows it live until it succeeds. Returns the task's id."""
    page.get_by_role("button", name="Submit task").click()
    expect(page).to_have_url(re.compile(r"#/tasks/task-"), timeout=15_000)
    task_id: str = page.url.rsplit("/", 1)[1]
    expect(page.locator("#live-mode")).to_have_attribute("data-mode", re.compile("stream|ended"))

    # Live to the end: the page updates itself from the stream (no reload).
    summary = page.get_by_role("region", name="Summary")
    expect(summary.locator(".badge").first).to_have_text("succeeded", timeout=120_000)
    expect(page.locator("#live-mode")).to_have_attribute("data-mode", "ended")
    expect(page.locator(".log li[data-type='task.succeeded']")).to_have_count(1)
    expect(page.locator(".log li[data-type='trial.completed']")).to_have_count(4)
    return task_id


def check_the_curves_and_the_trials_table(page: Any) -> str | None:
    """Returns the best trial's id, as the table marks it."""
    # Every trial's curves are drawn: a train line and a validation line per trial, the best one marked.
    trials = page.locator("svg.chart g.trial")
    expect(trials).to_have_count(4)
    for i in range(4):
        for kind in ("train", "val"):
            d = trials.nth(i).locator(f"path.{kind}").get_attribute("d") or ""
            assert d.startswith("M") and d.count("L") >= 1, (i, kind, d)
    expect(page.locator("svg.chart g.trial.best")).to_have_count(1)
    expect(page.locator("#trials tbody tr")).to_have_count(4)
    expect(page.locator("#trials td.metric")).to_have_count(0)  # judged by loss: no metric column
    best_row = page.locator("#trials tbody tr.best")
    expect(best_row).to_have_count(1)
    best_trial: str | None = best_row.get_attribute("data-trial")
    assert page.locator("svg.chart g.trial.best").get_attribute("data-trial") == best_trial
    return best_trial


def sort_the_table_from_the_keyboard(page: Any, best_trial: str | None) -> None:
    # The table sorts from the keyboard: focus the "Best val" header button, Enter twice (descending).
    header = page.get_by_role("button", name=re.compile("^Best val"))
    header.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#trials th[aria-sort='descending']")).to_have_count(1)
    expect(page.get_by_role("button", name=re.compile("^Best val"))).to_be_focused()
    expect(page.locator("#trials tbody tr").last).to_have_attribute("data-trial", best_trial or "")
    page.keyboard.press("Enter")
    expect(page.locator("#trials tbody tr").first).to_have_attribute("data-trial", best_trial or "")
    page.locator("#trials tbody tr").first.scroll_into_view_if_needed()
    path = shot(page, "03-task-succeeded")
    if os.environ.get("LORAPLANE_UPDATE_DOCS_SCREENSHOT"):
        page.screenshot(path=str(DOCS_SCREENSHOT), full_page=False, clip={"x": 0, "y": 0, "width": 1360,
                                                                           "height": 1000})
    assert path.stat().st_size > 10_000


def download_the_adapters(page: Any, task_id: str, best_trial: str | None) -> None:
    """The best adapter (a PEFT adapter in a tar.gz named after the task and trial), then one trial's."""
    with page.expect_download() as download_info:
        page.get_by_role("button", name="Download best adapter").click()
    download = download_info.value
    assert download.suggested_filename == f"{task_id}-{best_trial}-adapter.tar.gz"
    archive = ARTIFACTS / download.suggested_filename
    download.save_as(str(archive))
    with tarfile.open(archive, "r:gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names, names

    with page.expect_download() as download_info:
        page.get_by_role("button", name="Download the adapter of trial 0").click()
    assert download_info.value.suggested_filename.endswith("-adapter.tar.gz")


def try_the_playground(page: Any, service: Service, task_id: str, best_trial: str | None) -> None:
    """One prompt to the best trial, another trial and (as a chat) the base model: three answers side by side, each
    sampled by the worker; the best trial's equals what the API answers for the same greedy request."""
    playground = page.get_by_role("region", name="Playground")
    playground.get_by_label("Prompt").fill("3 plus 4 is")
    playground.get_by_label("Max tokens").fill("6")
    playground.get_by_label("Temperature").fill("0")
    best_box = playground.locator(f"input[data-choice='{best_trial}']")
    expect(best_box).to_be_checked()  # the best trial is ticked at first
    other = playground.locator("input[data-choice^='trial-']:not(:checked)").first
    other_id = other.get_attribute("data-choice")
    other.check()
    expect(playground.locator("input[data-choice='base']")).to_be_disabled()  # the base answers chats only
    playground.get_by_role("button", name="Sample").click()
    cards = playground.locator("article.answer")
    expect(cards).to_have_count(2)
    for choice in (best_trial, other_id):
        expect(playground.locator(f"article.answer[data-choice='{choice}']")).to_have_attribute(
            "data-done", re.compile("^(stop|length)$"), timeout=120_000)
    api = httpx.post(f"{service.base_url}/v1/tasks/{task_id}/trials/{best_trial}/completions", timeout=120,
                     headers={"Authorization": f"Bearer {service.tenant_key}"},
                     json={"prompt": "3 plus 4 is", "max_tokens": 6, "temperature": 0})
    assert api.status_code == 200, api.text
    shown = playground.locator(f"article.answer[data-choice='{best_trial}'] .answer-text").text_content()
    assert shown == api.json()["choices"][0]["text"]
    playground.get_by_label("As a chat").check()
    playground.locator("input[data-choice='base']").check()
    playground.get_by_role("button", name="Sample").click()
    expect(cards).to_have_count(3)
    expect(playground.locator("article.answer[data-choice='base']")).to_have_attribute(
        "data-done", re.compile("^(stop|length)$"), timeout=120_000)
    shot(page, "03b-playground")


def leave_the_page(page: Any, task_id: str) -> None:
    # Leaving the page closes its stream and timers: nothing about this task is asked for afterwards.
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if task_id in r.url else None)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Tasks").click()
    expect(page.locator(f"tr[data-task='{task_id}']")).to_contain_text("succeeded")
    expect(page.locator(f"tr[data-task='{task_id}']")).to_contain_text("4 completed")
    time.sleep(4)
    assert asked == [], asked
    shot(page, "04-tasks")


def test_a_task_judged_by_its_own_metric_shows_each_trials_score(
    page: Any, service: Service, console: Console
) -> None:
    """Issue 17 end to end: a task submitted from the form with a metric; the worker scores each trial's best
    adapter on the validation rows when it ends (the tiny random model answers nonsense, so the scores are low but
    present) and the page shows them."""
    tenant = {"Authorization": f"Bearer {service.tenant_key}"}
    sign_in(page, service.tenant_key)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="New task").click()
    page.get_by_label("Training file (JSONL)").set_input_files(
        {"name": "metric.jsonl", "mimeType": "application/jsonl", "buffer": arithmetic_rows()})
    page.get_by_label("Base model").select_option("tiny-random-llama")
    page.get_by_label("LoRA rank values").fill("2, 4")
    page.get_by_label("Max steps").fill("4")
    page.get_by_label("Max sequence length").fill("64")
    expect(page.get_by_label("Pattern")).to_be_disabled()  # only the regex metric takes one
    page.get_by_label("Best trial by").select_option("exact_match")
    page.get_by_role("button", name="Submit task").click()
    expect(page).to_have_url(re.compile(r"#/tasks/task-"), timeout=15_000)
    task = httpx.get(f"{service.base_url}/v1/tasks/{page.url.rsplit('/', 1)[1]}", headers=tenant).json()
    assert task["evaluation"] == {"metric": "exact_match", "max_new_tokens": 32, "pattern": None}, task
    summary = page.get_by_role("region", name="Summary")
    expect(summary.locator(".badge").first).to_have_text("succeeded", timeout=120_000)
    expect(page.get_by_role("button", name=re.compile(r"^Metric \(exact_match\)"))).to_be_visible()
    cells = page.locator("#trials td.metric")
    expect(cells).to_have_count(2)
    for i in range(2):
        expect(cells.nth(i)).to_have_text(re.compile(r"^[01]\.\d{3}$"))
    expect(page.locator("#best-metric")).to_have_text(re.compile(r"^[01]\.\d{3}$"))
    trials = httpx.get(f"{service.base_url}/v1/tasks/{task['id']}/trials", headers=tenant).json()["data"]
    assert all(t["metric_score"] is not None and 0 <= t["metric_score"] <= 1 for t in trials), trials
    shot(page, "04b-task-metric")


def expect_tenant_row(page: Any, tenant_id: str) -> None:
    """The tenant's demand on the cluster page, with what preemption weighs: its weight, its GPU time over the
    fairness window."""
    expect(page.get_by_role("columnheader", name="GPU time, last window")).to_be_visible()
    row = page.locator(f"tr[data-tenant='{tenant_id}']")
    expect(row.locator("td").nth(4)).to_have_text("1")  # its weight
    expect(row.locator("td").nth(5)).to_contain_text(" s")  # its GPU seconds so far
    # Why its tasks wait, in the scheduler's words ("1 trial waiting behind pack …"), or "—" when none does (the
    # dashboard's tenant may have a task of an earlier test still queued).
    expect(page.get_by_role("columnheader", name="Why waiting")).to_be_visible()
    expect(row.locator("td.waiting")).to_have_text(re.compile(r"^—$|waiting"))


def expect_worker_packs(worker: Any, pack: dict[str, Any], used: int) -> None:
    """The worker's used slots, its live packs (it may run several, each of another model), each with the memory
    reserved for it, and what they left free."""
    expect(worker).to_contain_text(f"{used}/")
    cell = worker.locator(f"td.packs-cell li[data-pack='{pack['id']}']")
    expect(cell).to_contain_text(pack["base_model"])
    expect(cell).to_contain_text("reserved")
    expect(worker.locator("td.memory")).to_contain_text("free", timeout=15_000)  # from its next heartbeat


def test_the_operator_sees_the_worker_packs_and_tenants(page: Any, service: Service) -> None:
    # A long task keeps a pack of two trials training while the operator looks (cancelled at the end).
    tenant = {"Authorization": f"Bearer {service.tenant_key}"}
    file_id = httpx.post(f"{service.base_url}/v1/files", headers=tenant,
                         files={"file": ("long.jsonl", arithmetic_rows())}).json()["id"]
    task = httpx.post(f"{service.base_url}/v1/tasks", headers=tenant, json={
        "base_model": "tiny-random-llama", "training_file": file_id, "validation_split": 0.2,
        "search_space": {"lora_rank": [2, 4]}, "max_steps": 5000, "max_seq_len": 32}).json()
    try:
        sign_in(page, service.admin_token)
        expect(page.get_by_role("heading", name="Cluster")).to_be_visible()
        worker = page.locator(f"#workers tr[data-worker='{WORKER_ID}']")
        expect(worker).to_contain_text("alive", timeout=30_000)  # its first heartbeat, when the service is new
        expect(worker).to_contain_text("cpu")
        # The models it can load, from its heartbeats (the synthetic model always loads).
        expect(worker).to_contain_text("tiny-random-llama", timeout=20_000)
        pack = page.locator("article.pack")
        expect(pack).to_have_count(1, timeout=30_000)
        expect(pack.locator(".slot.used")).not_to_have_count(0)
        # The page shows what the API says: the pack's used and free slots as counts, the trials holding the used.
        # (Both are re-read until they agree: a back-fill may land between the page's refresh and ours.)
        admin = {"Authorization": f"Bearer {service.admin_token}"}
        for _ in range(6):
            [live] = httpx.get(f"{service.base_url}/v1/admin/packs", headers=admin).json()["data"]
            used = len(live["slots"])
            if pack.locator(".slot.used").count() == used:
                break
            time.sleep(1)
        expect(pack.locator(".slot-counts")).to_have_text(f"{used} used · {live['capacity'] - used} free")
        expect(pack.locator(".slot")).to_have_count(used)
        expect(pack.locator(".slot.used")).to_have_count(used)
        expect(pack).to_contain_text(task["id"][:13])
        expect_worker_packs(worker, live, used)
        # The model its pack runs on is warm on it now (its heartbeats' warm_models), with its size.
        expect(worker.locator("td.warm")).to_contain_text("tiny-random-llama", timeout=15_000)
        expect(worker.locator("td.warm")).to_contain_text("KiB")
        expect(page.get_by_text("slot utilisation")).to_be_visible()
        expect_tenant_row(page, task["tenant_id"])
        shot(page, "05-cluster")
        # The pack has trained before it is cancelled (on a loaded machine the worker may still be starting it):
        # its profile below then has steps and a first step to show.
        for _ in range(120):
            packs = httpx.get(f"{service.base_url}/v1/admin/packs", headers=admin).json()["data"]
            if any(slot["steps_done"] > 0 for each in packs for slot in each["slots"]):
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the pack trained no step in 120 s: {packs}")
    finally:
        httpx.post(f"{service.base_url}/v1/tasks/{task['id']}/cancel", headers=tenant)

    # Cancelled, the pack ends, and the page shows where its wall time went: its worker's profile, phase by phase.
    ended = page.locator(f"#finished-packs article[data-pack='{live['id']}']")
    expect(ended).to_be_visible(timeout=30_000)
    profile = httpx.get(f"{service.base_url}/v1/admin/packs/{live['id']}", headers=admin).json()["profile"]
    phases = profile["phases"]
    expect(ended).to_contain_text(f"first step after {phase_text(profile['first_step_s'])}")
    for name in ("load", "capture", "steps", "validation", "metric", "snapshot", "persist", "export", "idle",
                 "other"):
        expect(ended.locator(f"li[data-phase='{name}']")).to_contain_text(phase_text(phases[f"{name}_s"]))
    # In the bar, each training-thread phase takes its share of the wall time (steps trained: never empty).
    bar, steps = ended.locator(".phase-bar").bounding_box(), ended.locator(".phase-bar .phase-steps").bounding_box()
    assert phases["steps_s"] > 0 and bar and steps
    shown = sum(v or 0 for k, v in phases.items() if k not in ("wall_s", "persist_s", "outside_steps_frac"))
    assert abs(steps["width"] / bar["width"] - phases["steps_s"] / max(phases["wall_s"], shown)) < 0.02, (
        steps, bar, phases)
    shot(page, "05b-cluster-pack-phases")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Tenants").click()
    expect(page.get_by_role("heading", name="Tenants")).to_be_visible()
    row = page.locator("#tenants tbody tr", has_text=service.tenant_name)
    expect(row).to_contain_text(service.tenant_key[:12])  # the key's prefix, never the key
    # Its usage (issue 18) as the API reports it: the long task above trained on the GPU for a while.
    usage = httpx.get(f"{service.base_url}/v1/usage", headers=tenant).json()
    expect(row.locator("td.usage-gpu")).to_have_text(re.compile(r"^\d+\.\d$"))
    shown = float(row.locator("td.usage-gpu").inner_text())
    assert usage["gpu_seconds"] > 0 and 0 < shown <= usage["gpu_seconds"] + 0.05, (shown, usage)
    assert service.tenant_key not in page.content()
    expect(page.get_by_role("link", name="New task")).to_have_count(0)  # tenant pages are not an operator's
    shot(page, "06-tenants")

