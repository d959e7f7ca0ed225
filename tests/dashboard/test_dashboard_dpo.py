"""A DPO task's page in headless Chromium against `loraplane up`: its objective in the settings, its trials' betas in
the trials table and the legend, its score column named reward accuracy, its loss chart named the DPO loss, and its
reward charts (validation reward accuracy, reward margin, chosen and rejected rewards) with a line and a dot per
validation of each trial; an SFT task's page has none of it.

No worker trains them: the service's worker is quarantined (as the scheduler quarantines one) before the tasks are
submitted through the API, so their trials stay pending; the DPO task's trials are then written into the service's
database as a worker's reports leave them (their metric points, the splits a DPO validation reports, and their
results), and the scheduler ends the task as it ends any. Any console error fails a test (conftest.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from common.artifacts import adapter_key
from common.tables import MetricPoint, Trial, Worker, utcnow
from tests.dashboard.conftest import WORKER_ID, Service, missing_requirement
from tests.dashboard.test_dashboard import shot
from tests.dashboard.test_dashboard_views import (
    NARROW,
    create_task,
    no_page_overflow,
    open_task,
    signed_in,
    tenant_headers,
    trial_rows,
)
from tests.e2e.flow import arithmetic_rows, wait_for

if (missing := missing_requirement()) is not None:
    pytest.skip(missing, allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402  (only once we know it is installed)

STEPS, EVAL_INTERVAL = 6, 3
VALIDATIONS = (3, 6)
# Per beta: each validation's (DPO loss, reward accuracy, margin, chosen reward, rejected reward). Beta 0.5's trial
# ends with every validation pair ranked right: the best by reward accuracy.
VALIDATED = {
    0.1: [(0.69, 0.5, 0.02, 0.01, -0.01), (0.66, 0.75, 0.11, 0.04, -0.07)],
    0.5: [(0.62, 0.625, 0.3, 0.1, -0.2), (0.41, 1.0, 0.9, 0.3, -0.6)],
}
REWARD_SPLITS = ("reward_acc", "margin", "chosen", "rejected")


def preference_rows(n: int = 32) -> bytes:
    rows = [{"prompt": f"{a} plus {a + 1} is", "chosen": f" {2 * a + 1}", "rejected": f" {2 * a + 2}"}
            for a in range(n)]
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def upload(service: Service, name: str, data: bytes) -> str:
    answer = httpx.post(f"{service.base_url}/v1/files", headers=tenant_headers(service), files={"file": (name, data)})
    assert answer.status_code == 201, answer.text
    file_id: str = answer.json()["id"]
    return file_id


def get_task(service: Service, task_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{service.base_url}/v1/tasks/{task_id}", headers=tenant_headers(service))
    assert answer.status_code == 200, answer.text
    task: dict[str, Any] = answer.json()
    return task


@pytest.fixture
def no_training(service: Service, service_db: Engine) -> Iterator[list[str]]:
    """The service's worker quarantined for the test, so that no pack trains the tasks it submits; yields the list the
    test adds its task ids to, cancelled (those not ended) before the quarantine is lifted."""
    def quarantined() -> bool:  # once the worker has registered (its first heartbeat, when the test runs first)
        with Session(service_db) as session, session.begin():
            worker = session.get(Worker, WORKER_ID)
            if worker is not None:
                worker.quarantined_until = utcnow() + timedelta(minutes=10)
            return worker is not None

    wait_for(quarantined, 60, f"worker {WORKER_ID} to register")
    task_ids: list[str] = []
    try:
        yield task_ids
    finally:
        headers = tenant_headers(service)
        for task_id in task_ids:
            httpx.post(f"{service.base_url}/v1/tasks/{task_id}/cancel", headers=headers)  # 409 once it ended
        admin = {"Authorization": f"Bearer {service.admin_token}"}
        assert httpx.delete(f"{service.base_url}/v1/admin/workers/{WORKER_ID}/quarantine",
                            headers=admin).status_code == 200


def pending_trials(engine: Engine, task_id: str, count: int) -> None:
    wait_for(lambda: trial_rows(engine, task_id) == count, 60, f"task {task_id}'s {count} trials")
    with Session(engine) as session:
        trials = session.scalars(select(Trial).where(Trial.task_id == task_id)).all()
        assert all(t.state == "pending" for t in trials), [t.state for t in trials]  # the quarantine held


def train_as_reported(engine: Engine, task_id: str) -> dict[float, str]:
    """Each DPO trial's points and results, as its worker's reports store them: a train loss per step, and at each
    validation its DPO loss, reward metrics and (reward accuracy being the task's metric) its score. Returns the
    trial ids by beta."""
    by_beta: dict[float, str] = {}
    now = utcnow()
    with Session(engine) as session, session.begin():
        for trial in session.scalars(select(Trial).where(Trial.task_id == task_id)).all():
            beta = trial.hyperparameters["beta"]
            by_beta[beta] = trial.id
            validated = VALIDATED[beta]
            points = [("train", step, 0.7 - 0.02 * step * (1 + beta)) for step in range(1, STEPS + 1)]
            for step, (loss, *rewards) in zip(VALIDATIONS, validated, strict=True):
                points += [("val", step, loss), ("metric", step, rewards[0])]
                points += [(split, step, value) for split, value in zip(REWARD_SPLITS, rewards, strict=True)]
            session.add_all(MetricPoint(trial_id=trial.id, split=split, step=step, loss=value)
                            for split, step, value in points)
            assert trial.total_steps == STEPS, trial.total_steps
            best = min(range(len(VALIDATIONS)), key=lambda i: validated[i][0])
            trial.state, trial.steps_done, trial.started_at, trial.finished_at = "completed", STEPS, now, now
            trial.best_val_loss, trial.best_step = validated[best][0], VALIDATIONS[best]
            trial.last_train_loss, trial.metric_score = points[STEPS - 1][2], validated[best][1]
            trial.adapter_key = adapter_key(task_id, trial.id)
    return by_beta


def test_a_dpo_tasks_page_shows_its_objective_betas_and_reward_curves_and_an_sft_tasks_none(
    page: Any, service: Service, service_db: Engine, no_training: list[str]
) -> None:
    dpo = create_task(service, {
        "base_model": "tiny-random-llama", "training_file": upload(service, "pairs.jsonl", preference_rows()),
        "validation_split": 0.25, "objective": {"type": "dpo"},
        "search_space": {"beta": [0.1, 0.5], "learning_rate": [1e-4]}, "evaluation": {"metric": "reward_accuracy"},
        "max_steps": STEPS, "eval_interval": EVAL_INTERVAL, "max_seq_len": 32, "seed": 7})
    no_training.append(dpo["id"])
    # A DPO task with one beta for every trial, judged by its DPO loss, label-smoothed.
    smoothed = create_task(service, {
        "base_model": "tiny-random-llama", "training_file": upload(service, "pairs-2.jsonl", preference_rows()),
        "validation_split": 0.25, "objective": {"type": "dpo", "beta": 0.2, "label_smoothing": 0.1},
        "search_space": {"learning_rate": [1e-4]}, "max_steps": STEPS, "eval_interval": EVAL_INTERVAL,
        "max_seq_len": 32})
    no_training.append(smoothed["id"])
    sft = create_task(service, {
        "base_model": "tiny-random-llama", "training_file": upload(service, "sft.jsonl", arithmetic_rows()),
        "validation_split": 0.25, "search_space": {"lora_rank": [2, 4]}, "max_steps": STEPS,
        "eval_interval": EVAL_INTERVAL, "max_seq_len": 32})
    no_training.append(sft["id"])
    for task, count in ((dpo, 2), (smoothed, 1), (sft, 2)):
        pending_trials(service_db, task["id"], count)

    assert get_task(service, dpo["id"])["objective"] == {"type": "dpo", "loss": "sigmoid", "label_smoothing": 0.0}
    by_beta = train_as_reported(service_db, dpo["id"])
    ended = wait_for(lambda: (t := get_task(service, dpo["id"]))["state"] == "succeeded" and t, 60,
                     "the scheduler to end the DPO task")
    assert ended["best_trial"]["id"] == by_beta[0.5], ended["best_trial"]

    signed_in(page, service.tenant_key)
    open_task(page, dpo["id"])
    dpo_settings_summary_and_table(page, by_beta)
    dpo_loss_and_reward_charts(page, by_beta)
    shot(page, "13-task-dpo")
    # The tasks list says which tasks are DPO (their best val loss is a DPO loss), and no more.
    page.goto("/#/tasks")
    expect(page.locator(f"#tasks tr[data-task='{dpo['id']}']")).to_contain_text("tiny-random-llama · DPO")
    expect(page.locator(f"#tasks tr[data-task='{sft['id']}']")).not_to_contain_text("DPO")
    open_task(page, dpo["id"])
    # On a phone the reward charts fold to one column: the page does not scroll sideways.
    page.set_viewport_size({"width": NARROW, "height": 900})
    expect(page.locator("#reward-accuracy-chart svg")).to_have_attribute("viewBox", re.compile(r"^0 0 (2\d\d|3\d\d) "))
    no_page_overflow(page, NARROW)
    shot(page, "14-task-dpo-400")

    open_task(page, smoothed["id"])
    settings = page.get_by_role("region", name="Settings and estimate")
    expect(page.locator("#task-objective")).to_have_text("DPO, sigmoid loss, label smoothing 0.1")
    expect(settings).to_contain_text("validation DPO loss")  # its best trial is by its DPO loss
    expect(page.locator("#trials tbody tr")).to_have_count(1)
    expect(page.locator("#trials td.beta")).to_have_text(["0.2"])
    expect(page.locator("#trials th", has_text="Reward accuracy")).to_have_count(0)  # judged by its loss: no score
    expect(page.locator("#rewards")).to_have_count(1)

    an_sft_tasks_page_is_as_before(page, sft["id"])


def dpo_settings_summary_and_table(page: Any, by_beta: dict[float, str]) -> None:
    settings = page.get_by_role("region", name="Settings and estimate")
    expect(settings.locator("dt", has_text="Objective")).to_have_count(1)
    expect(page.locator("#task-objective")).to_have_text("DPO, sigmoid loss")  # no label smoothing: not said
    expect(settings).to_contain_text("beta: 0.1, 0.5")
    expect(settings.locator("dt", has_text="Best trial by").locator("xpath=following-sibling::dd[1]")).to_have_text(
        "reward accuracy")
    summary = page.get_by_role("region", name="Summary")
    expect(summary.locator("dt", has_text="Best reward accuracy")).to_have_count(1)
    expect(page.locator("#best-metric")).to_have_text("1.000")
    expect(summary.locator("dt", has_text="Best val DPO loss")).to_have_count(1)

    table = page.locator("#trials")
    headers = table.locator("thead th").all_inner_texts()
    assert [re.sub(r"[ ▲▼]+$", "", text) for text in headers[:5]] == ["#", "State", "Steps", "LR", "Beta"], headers
    expect(table.locator("th", has_text="Reward accuracy")).to_have_count(1)
    expect(table.locator("th", has_text="Best val DPO loss")).to_have_count(1)
    for beta, trial_id in by_beta.items():
        row = table.locator(f"tr[data-trial='{trial_id}']")
        expect(row.locator("td.beta")).to_have_text(str(beta))
        score = VALIDATED[beta][min(range(len(VALIDATIONS)), key=lambda i: VALIDATED[beta][i][0])][1]
        expect(row.locator("td.metric")).to_have_text(f"{score:.3f}")
        # The legend tells the trials apart by beta: they share every other hyperparameter.
        expect(page.locator(f".legend button[data-trial='{trial_id}']")).to_contain_text(f"β={beta}")

    # The scatter opens on beta, the one hyperparameter that differs, against the score.
    expect(page.get_by_label("Hyperparameter", exact=True)).to_have_value("beta")
    scatter = page.locator("#hp-scatter svg.scatter")
    expect(scatter.locator("circle.pt")).to_have_count(2)
    expect(scatter.locator("text.label", has_text="reward accuracy score")).to_have_count(1)


def dpo_loss_and_reward_charts(page: Any, by_beta: dict[float, str]) -> None:
    expect(page.locator("#curves-title")).to_have_text("DPO loss curves")
    expect(page.locator("#curves-note")).to_contain_text("Dashed with dots: validation DPO loss.")
    loss = page.locator("#loss-chart svg.chart")
    expect(loss.locator("text.label", has_text=re.compile(r"^DPO loss$"))).to_have_count(1)
    expect(loss.locator("g.trial")).to_have_count(2)
    expect(loss.locator("g.trial circle")).to_have_count(2 * len(VALIDATIONS))  # the validation DPO loss's dots

    section = page.get_by_role("region", name="Reward curves")
    expect(section).to_be_visible()
    charts = {"#reward-accuracy-chart": 1, "#reward-margin-chart": 1, "#reward-values-chart": 2}  # lines per trial
    for chart, lines in charts.items():
        svg = section.locator(f"{chart} svg.chart.rewards")
        expect(svg.locator("g.trial")).to_have_count(2)
        for trial_id in by_beta.values():
            trial = svg.locator(f"g.trial[data-trial='{trial_id}']")
            expect(trial.locator("path.reward")).to_have_count(lines)
            expect(trial.locator("circle")).to_have_count(lines * len(VALIDATIONS))  # a dot per validation
    values = section.locator("#reward-values-chart")
    expect(values.locator("path.reward.dashed")).to_have_count(2)  # the rejected answers' rewards, one per trial
    expect(values.locator("line.zero")).to_have_count(1)  # rejected rewards below zero, chosen above
    expect(values.locator("svg")).to_have_attribute("aria-label", re.compile(r"chosen \(solid\) and rejected"))
    zero_tick = values.locator("g.y-ticks text").all_text_contents()
    assert "0" in zero_tick and not any("e-" in t for t in zero_tick), zero_tick  # its axis crosses 0: ticked "0"

    # Reward accuracy's axis is the whole [0, 1], and a higher accuracy is drawn higher: beta 0.5's last dot (1.0)
    # above beta 0.1's (0.75), each above its own first.
    accuracy = section.locator("#reward-accuracy-chart svg")
    ticks = accuracy.locator("g.y-ticks text").all_text_contents()
    assert "0" in ticks and "1" in ticks, ticks
    expect(accuracy.locator("line.zero")).to_have_count(0)  # 0 is no reference point for a share
    expect(accuracy.locator("text.label", has_text="reward accuracy")).to_have_count(1)
    heights = {beta: accuracy.locator(f"g.trial[data-trial='{trial_id}'] circle").evaluate_all(
        "cs => cs.map(c => Number(c.getAttribute('cy')))") for beta, trial_id in by_beta.items()}
    assert heights[0.5][1] < heights[0.1][1] < heights[0.1][0], heights
    assert heights[0.5][1] < heights[0.5][0], heights

    # A trial hidden from the loss chart (its legend entry) is hidden from the reward charts too.
    page.locator(f".legend button[data-trial='{by_beta[0.1]}']").click()
    expect(section.locator("svg.rewards g.trial")).to_have_count(3)
    expect(section.locator(f"svg.rewards g.trial[data-trial='{by_beta[0.1]}']")).to_have_count(0)
    page.get_by_role("button", name="Show all trials").click()
    expect(section.locator("svg.rewards g.trial")).to_have_count(6)


def an_sft_tasks_page_is_as_before(page: Any, task_id: str) -> None:
    open_task(page, task_id)
    expect(page.locator("#trials tbody tr")).to_have_count(2)  # rendered: the page knows it is an SFT task
    expect(page.locator("#curves-title")).to_have_text("Loss curves")
    expect(page.locator("#curves-note")).to_contain_text("Solid: train loss. Dashed with dots: validation loss.")
    expect(page.get_by_role("region", name="Settings and estimate")).to_contain_text("validation loss")
    expect(page.locator("#task-objective")).to_have_count(0)
    expect(page.locator("#trials th", has_text="Beta")).to_have_count(0)
    expect(page.locator(".legend button", has_text="β=")).to_have_count(0)
    expect(page.get_by_label("Hyperparameter", exact=True).locator("option[value='beta']")).to_have_count(0)
    expect(page.locator("#rewards")).to_have_count(0)
    expect(page.locator("svg.rewards")).to_have_count(0)
    expect(page.get_by_role("heading", name="Reward curves")).to_have_count(0)
