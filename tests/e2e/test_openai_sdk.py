"""OpenAI's official Python client against the live service (issue 38): a user's existing fine-tuning code, pointed at
`loraplane up` with `OpenAI(base_url=.../v1, api_key=<tenant key>)`, runs unchanged: upload, fine-tune (one
configuration, and a search where a hyperparameter is a list), wait, list, events, checkpoints, chat with the
fine-tuned model, cancel; errors raise the client's own exceptions with our messages; another tenant's key sees none
of it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.flow import arithmetic_rows, tenant_client
from tests.e2e.procs import embedded_service

CEILING_S = 600  # a job of the tiny model takes seconds; a loaded 2-core machine may take minutes


def wait_final(client: openai.OpenAI, job_id: str) -> openai.types.fine_tuning.FineTuningJob:
    deadline = time.monotonic() + CEILING_S
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not final after {CEILING_S} s")


def test_the_openai_client_fine_tunes_and_chats_unchanged(tmp_path: Path) -> None:
    with embedded_service(tmp_path) as (base_url, token):
        with tenant_client(base_url, token, "team-openai") as lp, tenant_client(base_url, token, "team-other") as other:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=lp.api_key, max_retries=0)
            stranger = openai.OpenAI(base_url=f"{base_url}/v1", api_key=other.api_key, max_retries=0)
            check_journey(client, stranger)


def check_journey(client: openai.OpenAI, stranger: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("train.jsonl", arithmetic_rows(40)), purpose="fine-tune")
    assert (uploaded.filename, uploaded.purpose, uploaded.status) == ("train.jsonl", "fine-tune", "processed")
    assert uploaded.bytes == len(arithmetic_rows(40))

    job = client.fine_tuning.jobs.create(model="tiny-random-llama", training_file=uploaded.id, seed=3, suffix="demo",
                                         metadata={"team": "a"}, hyperparameters={"n_epochs": 2, "batch_size": 4})
    assert job.object == "fine_tuning.job" and job.status in ("validating_files", "queued", "running")
    assert (job.model, job.training_file, job.seed, job.user_provided_suffix) == (
        "tiny-random-llama", uploaded.id, 3, "demo")
    assert job.metadata == {"team": "a"} and job.hyperparameters.n_epochs == 2
    # Our extension: a list where OpenAI takes a number is a search, here over three learning rates.
    search = client.fine_tuning.jobs.create(
        model="tiny-random-llama", training_file=uploaded.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "learning_rate_multiplier": [0.5, 1, 2], "n_epochs": 1}}})  # type: ignore[typeddict-item]
    assert search.hyperparameters.learning_rate_multiplier == [0.5, 1.0, 2.0]
    assert search.model_extra is not None and search.model_extra["loraplane"]["trial_counts"]["pending"] == 3

    done = wait_final(client, job.id)
    assert done.status == "succeeded" and done.fine_tuned_model == job.id and done.finished_at is not None
    assert done.trained_tokens and done.trained_tokens > 0 and done.error is None
    searched = wait_final(client, search.id)
    assert searched.status == "succeeded" and searched.model_extra is not None
    assert searched.model_extra["loraplane"]["trial_counts"]["completed"] == 3

    listed = client.fine_tuning.jobs.list(limit=1)  # newest first, a page at a time
    assert [j.id for j in listed.data] == [search.id] and listed.has_more
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1, after=search.id).data] == [job.id]
    assert [j.id for j in client.fine_tuning.jobs.list()] == [search.id, job.id]

    events = list(client.fine_tuning.jobs.list_events(job.id, limit=2))  # the client follows the pages
    assert events and all(e.object == "fine_tuning.job.event" for e in events)
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    assert "Task created" in events[-1].message and "trial" in events[0].message.lower()
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints and all(c.fine_tuning_job_id == job.id for c in checkpoints)
    assert [c.step_number for c in checkpoints] == sorted((c.step_number for c in checkpoints), reverse=True)

    assert done.fine_tuned_model is not None
    answer = client.chat.completions.create(model=done.fine_tuned_model, max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "3 plus 4 is"}])
    assert answer.choices[0].message.content is not None
    assert answer.model.startswith(f"{done.fine_tuned_model}:")  # the task's best trial answered
    sampled = client.chat.completions.create(model=checkpoints[0].fine_tuned_model_checkpoint, max_tokens=3,
                                             temperature=0, messages=[{"role": "user", "content": "3 plus 4 is"}])
    assert sampled.model == checkpoints[0].fine_tuned_model_checkpoint

    long = client.fine_tuning.jobs.create(model="tiny-random-llama", training_file=uploaded.id,
                                          hyperparameters={"n_epochs": 100})
    assert client.fine_tuning.jobs.cancel(long.id).status == "cancelled"
    with pytest.raises(openai.ConflictError, match="already finished"):
        client.fine_tuning.jobs.cancel(job.id)
    check_errors(client)
    check_isolation(stranger, [job.id, search.id, long.id], uploaded.id)


def check_errors(client: openai.OpenAI) -> None:
    """Our errors, raised as the client's own exceptions with our messages and codes."""
    with pytest.raises(openai.NotFoundError, match="task-missing") as missing:
        client.fine_tuning.jobs.retrieve("task-missing")
    assert missing.value.code is not None
    with pytest.raises(openai.UnprocessableEntityError, match="No base model named") as unknown:
        client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file="file-x")
    assert unknown.value.code == "unknown_model" and unknown.value.param == "base_model"
    with pytest.raises(openai.UnprocessableEntityError, match="beta") as beta:
        files = client.files.list().data
        client.fine_tuning.jobs.create(model="tiny-random-llama", training_file=files[0].id,
                                       hyperparameters={"beta": 0.1})  # type: ignore[typeddict-unknown-key]
    assert beta.value.code == "unknown_field"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="lp_wrong", max_retries=0).fine_tuning.jobs.list()


def check_isolation(stranger: openai.OpenAI, job_ids: list[str], file_id: str) -> None:
    """Another tenant's key: none of the jobs is listed, and each is a 404 to every call, as to a job that does not
    exist."""
    assert list(stranger.fine_tuning.jobs.list()) == []
    for job_id in job_ids:
        for call in (stranger.fine_tuning.jobs.retrieve, stranger.fine_tuning.jobs.cancel,
                     stranger.fine_tuning.jobs.list_events, stranger.fine_tuning.jobs.checkpoints.list):
            with pytest.raises(openai.NotFoundError):
                call(job_id)
        with pytest.raises(openai.NotFoundError):
            stranger.chat.completions.create(model=job_id, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.UnprocessableEntityError, match=file_id):
        stranger.fine_tuning.jobs.create(model="tiny-random-llama", training_file=file_id)
    assert json.loads(json.dumps([f.id for f in stranger.files.list().data])) == []
