"""The dashboard's views of a task and of the cluster (issue 32, point 7) in headless Chromium against `loraplane up`:
progress coloured by the task's state (a failed task's bar stops where its trials did, and its chart says why there
are no curves), the task's settings and estimate, the loss chart's log scale and its trials hidden or isolated, the
scatter of a hyperparameter against each trial's result, a trial's checkpoints (downloaded as the API serves them) and
the task's tracker that is down, a pack's slots as counts (not a box per free slot), the
submit form's "Choose it for me", and the task and cluster pages at 1400 and 400 px wide (no sideways scrolling of
the page at 400 px: wide tables scroll inside their own box). Any console error fails a test (conftest.py)."""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from common.tables import Trial, utcnow
from loraplane.client import Client
from tests.dashboard.conftest import Service, missing_requirement
from tests.dashboard.test_dashboard import shot, sign_in
from tests.e2e.flow import arithmetic_rows, grid_task, task_progress, wait_for, wait_progressing
from tests.e2e.procs import free_port

if (missing := missing_requirement()) is not None:
    pytest.skip(missing, allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402  (only once we know it is installed)

WIDE, NARROW = 1400, 400


def tenant_headers(service: Service) -> dict[str, str]:
    return {"Authorization": f"Bearer {service.tenant_key}"}


def upload(service: Service, name: str) -> str:
    answer = httpx.post(f"{service.base_url}/v1/files", headers=tenant_headers(service),
                        files={"file": (name, arithmetic_rows())})
    assert answer.status_code == 201, answer.text
    file_id: str = answer.json()["id"]
    return file_id


def create_task(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{service.base_url}/v1/tasks", headers=tenant_headers(service), json=body)
    assert answer.status_code in (200, 201), answer.text
    task: dict[str, Any] = answer.json()
    return task


@pytest.fixture(scope="module")
def finished_task(service: Service) -> dict[str, Any]:
    """A 4-trial grid (2 learning rates x 2 ranks) trained to the end by the service's worker, keeping its
    checkpoints (the default) and logging to an MLflow server that is down the whole time."""
    task = create_task(service, {**grid_task(upload(service, "views.jsonl"), max_steps=6),
                                 "integrations": [{"type": "mlflow", "tracking_uri": f"http://127.0.0.1:{free_port()}",
                                                   "experiment": "views"}]})
    with Client(service.base_url, service.tenant_key, timeout=30) as lp:
        wait_progressing(lambda: lp.tasks.get(task["id"]).done, lambda: task_progress(lp, task["id"]),
                         f"task {task['id']} to end")
        ended = lp.tasks.get(task["id"])
    assert ended.state == "succeeded", ended
    got: dict[str, Any] = httpx.get(f"{service.base_url}/v1/tasks/{task['id']}", headers=tenant_headers(service)).json()
    return got


@pytest.fixture
def long_task(service: Service) -> Iterator[dict[str, Any]]:
    """A task that keeps a pack of two trials training (cancelled at the end)."""
    task = create_task(service, {
        "base_model": "tiny-random-llama", "training_file": upload(service, "long.jsonl"), "validation_split": 0.2,
        "search_space": {"lora_rank": [2, 4]}, "max_steps": 5000, "max_seq_len": 32})
    try:
        yield task
    finally:
        httpx.post(f"{service.base_url}/v1/tasks/{task['id']}/cancel", headers=tenant_headers(service))


def signed_in(page: Any, key: str, home: str = "Tasks") -> None:
    """Signed in and landed on the home page (so a navigation after it is not overtaken by the sign-in's own)."""
    sign_in(page, key)
    expect(page.get_by_role("heading", name=home, exact=True)).to_be_visible()


def trial_rows(engine: Any, task_id: str) -> int:
    with Session(engine) as session:
        return len(session.scalars(select(Trial.id).where(Trial.task_id == task_id)).all())


def open_task(page: Any, task_id: str, width: int = WIDE) -> None:
    page.set_viewport_size({"width": width, "height": 1000})
    page.goto(f"/#/tasks/{task_id}")
    expect(page.get_by_role("heading", name=re.compile(f"Task {task_id}"))).to_be_visible()


def no_page_overflow(page: Any, width: int) -> None:
    """Nothing makes the page itself scroll sideways: wide content scrolls inside its own box."""
    scroll = page.evaluate("() => document.documentElement.scrollWidth")
    # The culprits, for the failure's message: the deepest elements that reach past the window's right edge.
    wide = page.evaluate("""w => {
        const past = (e) => e.getBoundingClientRect().right > w;
        return [...document.querySelectorAll('body *')].filter(e => past(e) && ![...e.children].some(past))
            .slice(0, 8).map(e => `${e.tagName.toLowerCase()}.${e.className} ${e.getBoundingClientRect().right}`);
    }""", width)
    assert scroll <= width, f"the page is {scroll} px wide in a {width} px window: {wide}"


def drawn_trials(page: Any) -> list[str]:
    ids: list[str] = page.locator("svg.chart:not(.scatter) g.trial").evaluate_all(
        "gs => gs.map(g => g.dataset.trial)")
    return sorted(ids)


def y_tick_labels(page: Any) -> list[str]:
    labels: list[str] = page.locator("#loss-chart g.y-ticks text").all_inner_texts()
    return labels


def test_a_finished_tasks_page_settings_estimate_chart_controls_and_scatter(
    page: Any, service: Service, finished_task: dict[str, Any]
) -> None:
    task_id = finished_task["id"]
    signed_in(page, service.tenant_key)
    open_task(page, task_id)
    expect(page.locator("#task-progress .bar.progress-succeeded")).to_have_count(1)
    expect(page.locator("#task-progress")).to_contain_text("100%")

    # Its settings and its estimate, from the task object.
    settings = page.get_by_role("region", name="Settings and estimate")
    for text in ("tiny-random-llama", finished_task["training_file"], "64 tokens", "6 steps per trial", "none",
                 "learning rate: 0.001, 0.005", "rank: 2, 4", "grid"):
        expect(settings).to_contain_text(text)
    estimate = finished_task["estimate"]
    assert estimate is not None and estimate["actual"] is not None, estimate
    expect(page.locator("#task-estimate")).to_contain_text(f"{estimate['tokens']} tokens")
    expect(page.locator("#task-estimate")).to_contain_text(f"{estimate['gpu_seconds']:.1f} device seconds")
    expect(page.locator("#task-actual")).to_contain_text(f"{estimate['actual']['tokens']} tokens")

    trials = httpx.get(f"{service.base_url}/v1/tasks/{task_id}/trials", headers=tenant_headers(service)).json()["data"]
    ids = sorted(t["id"] for t in trials)
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(4)
    hide_and_isolate_trials(page, ids, trials)
    log_scale_changes_the_axis(page)
    scatter_has_a_point_per_trial(page, trials)
    shot(page, "07-task-views-1400")

    page.set_viewport_size({"width": NARROW, "height": 900})
    expect(page.locator("svg.chart:not(.scatter)")).to_have_attribute("viewBox", re.compile(r"^0 0 (2\d\d|3\d\d) "))
    no_page_overflow(page, NARROW)
    shot(page, "08-task-views-400")


def test_a_finished_tasks_checkpoints_download_and_its_tracker_that_is_down(
    page: Any, service: Service, finished_task: dict[str, Any]
) -> None:
    """The task page lists the best trial's checkpoints as the API does (then another trial's, picked), downloads one
    as the API serves it, and says its MLflow server is behind and why."""
    task_id = finished_task["id"]
    signed_in(page, service.tenant_key)
    open_task(page, task_id)
    section = page.get_by_role("region", name="Checkpoints")
    best = finished_task["best_trial"]["id"]
    expect(section.get_by_label("Trial")).to_have_value(best)

    def listed(trial_id: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{service.base_url}/v1/tasks/{task_id}/trials/{trial_id}/checkpoints",
                           headers=tenant_headers(service))
        assert answer.status_code == 200, answer.text
        rows: list[dict[str, Any]] = answer.json()["data"]
        assert rows, trial_id  # 6 steps over 2 epochs: at least the epochs' ends and the last step
        return rows

    def shows(rows: list[dict[str, Any]]) -> None:
        expect(section.locator("#checkpoints tbody tr")).to_have_count(len(rows))
        for row in rows:
            line = section.locator(f"#checkpoints tr[data-step='{row['step']}']")
            for kind in row["kinds"]:
                expect(line.locator(".tag", has_text=kind)).to_have_count(1)

    rows = listed(best)
    shows(rows)
    last = next(row for row in rows if "last" in row["kinds"])
    with page.expect_download() as download_info:
        section.get_by_role("button", name=f"Download the checkpoint at step {last['step']}").click()
    download = download_info.value
    assert download.suggested_filename.endswith(f"-step-{last['step']}.tar"), download.suggested_filename
    served = httpx.get(f"{service.base_url}/v1/tasks/{task_id}/trials/{best}/checkpoints/{last['step']}/adapter",
                       headers=tenant_headers(service))
    assert Path(download.path()).read_bytes() == served.content
    with tarfile.open(download.path()) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]

    other = next(t["id"] for t in httpx.get(f"{service.base_url}/v1/tasks/{task_id}/trials",
                                            headers=tenant_headers(service)).json()["data"] if t["id"] != best)
    section.get_by_label("Trial").select_option(other)
    shows(listed(other))

    trackers = page.get_by_role("region", name="Experiment trackers")
    tracker = trackers.locator("article.tracker[data-type='mlflow']")
    expect(tracker).to_contain_text("views at http://127.0.0.1:")
    expect(tracker).to_have_attribute("data-done", "false")
    # The page reads it again until it is done: the runs fall behind as the sync thread fails to reach it.
    expect(tracker.locator(".tracker-state")).to_contain_text("0 of 4 runs finished, ", timeout=60_000)
    expect(tracker.locator("li[data-trial]").first).to_contain_text("failed attempt")
    shot(page, "07b-task-checkpoints-trackers")


def hide_and_isolate_trials(page: Any, ids: list[str], trials: list[dict[str, Any]]) -> None:
    first, second = ids[0], ids[1]
    # A click on a legend entry hides its trial; another shows it again.
    page.locator(f".legend button[data-trial='{first}']").click()
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(3)
    assert first not in drawn_trials(page)
    expect(page.locator(f".legend button[data-trial='{first}']")).to_have_attribute("aria-pressed", "false")
    expect(page.locator(f"#trials tr[data-trial='{first}']")).to_have_class(re.compile(r"\boff\b"))
    page.locator(f".legend button[data-trial='{first}']").click()
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(4)
    # Shift-click isolates: only that trial is drawn (the axes fit it); Shift-click again shows every trial.
    page.locator(f".legend button[data-trial='{second}']").click(modifiers=["Shift"])
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(1)
    assert drawn_trials(page) == [second]
    page.locator(f".legend button[data-trial='{second}']").click(modifiers=["Shift"])
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(4)
    # A row of the trials table toggles its trial too; Alt-click on a row isolates; "Show all trials" undoes it.
    page.locator(f"#trials tr[data-trial='{first}'] td").nth(2).click()
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(3)
    page.locator(f"#trials tr[data-trial='{second}'] td").nth(2).click(modifiers=["Alt"])
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(1)
    assert drawn_trials(page) == [second]
    page.get_by_role("button", name="Show all trials").click()
    expect(page.locator("svg.chart:not(.scatter) g.trial")).to_have_count(4)
    assert drawn_trials(page) == ids


def log_scale_changes_the_axis(page: Any) -> None:
    chart = page.locator("#loss-chart svg.chart")
    expect(chart).to_have_attribute("data-y-scale", "linear")
    linear = y_tick_labels(page)
    lines = chart.locator("g.trial path.train").evaluate_all("ps => ps.map(p => p.getAttribute('d'))")
    page.get_by_label("Log scale (loss)").check()
    expect(chart).to_have_attribute("data-y-scale", "log")
    expect(chart.locator("text.label", has_text="loss (log)")).to_have_count(1)
    # The same points land elsewhere on a log axis (its ticks may be the same round numbers, spaced unevenly).
    assert chart.locator("g.trial path.train").evaluate_all("ps => ps.map(p => p.getAttribute('d'))") != lines
    spacing = page.locator("#loss-chart g.y-ticks line").evaluate_all("ls => ls.map(l => Number(l.getAttribute('y1')))")
    gaps = [round(a - b, 1) for a, b in zip(spacing, spacing[1:], strict=False)]
    assert len(set(gaps)) > 1 or y_tick_labels(page) != linear, (gaps, linear)
    page.get_by_label("Log scale (loss)").uncheck()
    expect(chart).to_have_attribute("data-y-scale", "linear")


def scatter_has_a_point_per_trial(page: Any, trials: list[dict[str, Any]]) -> None:
    scatter = page.locator("#hp-scatter svg.scatter")
    # It opens on the first hyperparameter that differs between trials: the learning rate, on a log axis.
    expect(page.get_by_label("Hyperparameter", exact=True)).to_have_value("learning_rate")
    expect(scatter).to_have_attribute("data-x-scale", "log")
    expect(scatter.locator("circle.pt")).to_have_count(len(trials))
    for t in trials:
        expect(scatter.locator(f"circle.pt[data-trial='{t['id']}']")).to_have_class(re.compile(f"state-{t['state']}"))
    page.get_by_label("Hyperparameter", exact=True).select_option("lora_rank")
    expect(scatter).to_have_attribute("data-x-scale", "linear")
    expect(scatter.locator("circle.pt")).to_have_count(len(trials))
    expect(scatter.locator("text.x-tick", has_text=re.compile(r"^2$"))).not_to_have_count(0)
    # Two ranks: the two trials of each rank share an x.
    xs = scatter.locator("circle.pt").evaluate_all("cs => cs.map(c => c.getAttribute('cx'))")
    assert len(set(xs)) == 2, xs


def test_a_failed_task_shows_how_far_it_got_and_why_it_has_no_curves(
    page: Any, service: Service, long_task: dict[str, Any], service_db: Engine
) -> None:
    """While the worker trains the long task's pack, a task on another base model waits for it; its trials are
    failed in the service's database (as the scheduler fails a trial) after 3 of their 8 steps, before any loss
    point was written, and the scheduler fails the task for it."""
    with Client(service.base_url, service.tenant_key, timeout=30) as lp:
        wait_progressing(lambda: any(t.state == "running" for t in lp.tasks.trials(long_task["id"]).data),
                         lambda: task_progress(lp, long_task["id"]), "the long task's pack to start")
    task = create_task(service, {"base_model": "smollm2-135m-instruct", "training_file": upload(service, "f.jsonl"),
                                 "validation_split": 0.2, "search_space": {"lora_rank": [2, 4]}, "max_steps": 8,
                                 "max_seq_len": 64})
    wait_for(lambda: trial_rows(service_db, task["id"]), 60, f"task {task['id']}'s trials")
    # Before it fails, it says why it waits: behind the long task's pack, as the API says.
    waiting = wait_for(lambda: httpx.get(f"{service.base_url}/v1/tasks/{task['id']}",
                                         headers=tenant_headers(service)).json()["waiting"], 60, "a waiting reason")
    assert waiting["reason"] == "behind_pack", waiting
    signed_in(page, service.tenant_key)
    open_task(page, task["id"])
    expect(page.locator("#waiting-reason")).to_contain_text("behind pack")
    with Session(service_db) as session, session.begin():
        trials = session.scalars(select(Trial).where(Trial.task_id == task["id"])).all()
        assert all(t.state == "pending" for t in trials), [t.state for t in trials]
        for t in trials:
            t.state, t.steps_done, t.total_steps = "failed", 3, 8
            t.error, t.finished_at = "out of memory on the device", utcnow()
    open_task(page, task["id"])
    summary = page.get_by_role("region", name="Summary")
    expect(summary.locator(".badge").first).to_have_text("failed", timeout=30_000)  # the scheduler's verdict
    expect(page.locator("#task-progress .bar.progress-failed")).to_have_count(1)
    expect(page.locator("#task-progress")).to_contain_text("failed at 38%")  # 3 of 8 steps, not a full bar
    expect(page.locator("#task-progress [role=progressbar]")).to_have_attribute("aria-valuenow", "38")
    no_curves = page.locator("#loss-chart .no-curves")
    expect(no_curves).to_contain_text("No curves: the task failed (no trial completed: out of memory on the device)")
    expect(page.locator("#loss-chart svg")).to_have_count(0)
    shot(page, "09-task-failed")

    # The running task's bar is the running colour; cancelled, the cancelled one.
    open_task(page, long_task["id"])
    expect(summary.locator(".badge").first).to_have_text("running", timeout=60_000)
    expect(page.locator("#task-progress .bar.progress-running")).to_have_count(1)
    httpx.post(f"{service.base_url}/v1/tasks/{long_task['id']}/cancel", headers=tenant_headers(service))
    expect(page.locator("#task-progress .bar.progress-cancelled")).to_have_count(1, timeout=30_000)
    expect(page.locator("#task-progress")).to_contain_text("cancelled at")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Tasks").click()
    expect(page.locator(f"tr[data-task='{task['id']}'] .bar.progress-failed")).to_have_count(1)


def test_the_cluster_page_counts_free_slots_and_fits_a_phone(
    page: Any, service: Service, long_task: dict[str, Any]
) -> None:
    admin = {"Authorization": f"Bearer {service.admin_token}"}
    signed_in(page, service.admin_token, "Cluster")
    page.set_viewport_size({"width": WIDE, "height": 1000})
    pack = page.locator("article.pack")
    expect(pack).to_have_count(1, timeout=60_000)
    # The slots as counts over one bar, and only the used ones listed, each with its trial (re-read until the page
    # and the API agree: a back-fill may land between the page's refresh and ours).
    counts = pack.locator(".slot-counts")
    for _ in range(20):
        [live] = httpx.get(f"{service.base_url}/v1/admin/packs", headers=admin).json()["data"]
        used, free = len(live["slots"]), live["capacity"] - len(live["slots"])
        if counts.get_attribute("data-used") == str(used):
            break
        page.wait_for_timeout(500)
    expect(counts).to_have_text(f"{used} used · {free} free")
    expect(pack.locator(".slot")).to_have_count(used)
    expect(pack.locator(".slot.free")).to_have_count(0)
    expect(pack).to_contain_text(long_task["id"][:13])
    shot(page, "10-cluster-1400")

    page.set_viewport_size({"width": NARROW, "height": 900})
    expect(page.locator("#workers")).to_be_visible()
    no_page_overflow(page, NARROW)
    shot(page, "11-cluster-400")

    # The worker is a CPU worker: usage is in CPU seconds, not GPU seconds.
    page.set_viewport_size({"width": WIDE, "height": 1000})
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Tenants").click()
    expect(page.locator("#tenants th", has_text="CPU seconds")).to_have_count(1)
    expect(page.locator("#tenants th", has_text="GPU seconds")).to_have_count(0)


def test_choose_it_for_me_disables_and_clears_the_manual_search_space(page: Any, service: Service) -> None:
    signed_in(page, service.tenant_key)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="New task").click()
    lr, rank = page.get_by_label("Learning rate values"), page.get_by_label("LoRA rank values")
    lr.fill("1e-3, 3e-3")
    rank.fill("2, 4")
    page.get_by_label("Max trials").fill("3")
    page.get_by_label("q_proj").check()
    auto = page.get_by_label(re.compile("^Choose it for me"))
    auto.check()
    manual = (lr, rank, page.get_by_label("Max trials"), page.get_by_label("Strategy"), page.get_by_label("q_proj"))
    for field in manual:
        expect(field).to_be_disabled()
    expect(lr).to_have_value("")
    expect(rank).to_have_value("")
    expect(page.get_by_label("Max trials")).to_have_value("")
    expect(page.get_by_label("q_proj")).not_to_be_checked()
    expect(page.get_by_label("all-linear")).to_be_checked()
    expect(page.locator("#trial-count")).to_contain_text("Six trials")
    shot(page, "12-submit-auto")
    auto.uncheck()
    expect(lr).to_be_enabled()
    expect(page.locator("#trial-count")).to_contain_text("expands to 1 trial ")
    page.set_viewport_size({"width": NARROW, "height": 900})
    no_page_overflow(page, NARROW)
