"""Together AI's official Python client against the live service: a user's existing fine-tuning code, pointed at
`loraplane up` with `Together(base_url=<server root>, api_key=<tenant key>)`, runs unchanged: fine-tune (SFT, and DPO
on a preference file), wait, list, events, checkpoints, chat with the fine-tuned model, cancel; errors raise the
client's own exceptions with our messages; another tenant's key sees none of it. Files are uploaded with our own
API (POST /v1/files): Together's upload is a presigned-URL flow loraplane does not serve. A search (a list where
Together takes a number) goes through the client's raw `post`: its request model refuses lists."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pydantic
import pytest
import together
from together.types import FinetuneResponse

from tests.e2e.flow import arithmetic_rows, tenant_client, upload
from tests.e2e.procs import embedded_service

CEILING_S = 600  # a fine-tune of the tiny model takes seconds; a loaded 2-core machine may take minutes


def preference_rows(n: int = 40) -> bytes:
    rows = [{"prompt": f"{a} plus 1 is", "chosen": f" {a + 1}", "rejected": f" {a + 2}"} for a in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait_final(client: together.Together, fine_tune_id: str) -> FinetuneResponse:
    deadline = time.monotonic() + CEILING_S
    while time.monotonic() < deadline:
        job = client.fine_tuning.retrieve(fine_tune_id)
        if job.status in ("completed", "error", "cancelled"):
            return job
        time.sleep(0.5)
    raise TimeoutError(f"fine-tune {fine_tune_id} not final after {CEILING_S} s")


def test_the_together_client_fine_tunes_and_chats_unchanged(tmp_path: Path) -> None:
    with embedded_service(tmp_path) as (base_url, token):
        with tenant_client(base_url, token, "team-together") as lp, tenant_client(base_url, token, "team-other") as o:
            client = together.Together(base_url=base_url, api_key=lp.api_key, max_retries=0)
            stranger = together.Together(base_url=base_url, api_key=o.api_key, max_retries=0)
            training, preferences = upload(lp, arithmetic_rows(40)), upload(lp, preference_rows(), "prefs.jsonl")
            check_journey(client, training, preferences)
            check_isolation(stranger, [j.id for j in client.fine_tuning.list().data], training)


def check_journey(client: together.Together, training: str, preferences: str) -> None:
    job = client.fine_tuning.create(training_file=training, model="tiny-random-llama", n_epochs=2, batch_size=4,
                                    learning_rate=1e-3, lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                    suffix="demo", random_seed=3, train_on_inputs="auto")
    assert job.status in ("pending", "queued", "running") and job.output_name == job.id
    assert (job.model, job.training_file, job.suffix, job.n_epochs, job.learning_rate) == (
        "tiny-random-llama", training, "demo", 2, 1e-3)
    assert isinstance(job.training_type, together.lib.types.fine_tuning.LoRATrainingType)
    assert job.training_type.lora_r == 4 and job.batch_size == 4
    dpo = client.fine_tuning.create(training_file=preferences, model="tiny-random-llama", training_method="dpo",
                                    dpo_beta=0.2, lora=True, learning_rate=1e-4)
    assert dpo.training_method is not None and dpo.training_method.method == "dpo"
    # Our extension: a list where Together takes a number is a search. The client's request model refuses a list,
    # so it goes through the client's raw post.
    with pytest.raises(pydantic.ValidationError):
        client.fine_tuning.create(training_file=training, model="tiny-random-llama",
                                  learning_rate=[1e-3, 2e-3])  # type: ignore[arg-type]
    search = client.post("/v1/fine-tunes", cast_to=FinetuneResponse, body={
        "model": "tiny-random-llama", "training_file": training, "learning_rate": [1e-3, 3e-3], "n_epochs": 1})
    assert search.learning_rate == [1e-3, 3e-3] and search.model_extra is not None
    assert search.model_extra["loraplane"]["trial_counts"]["pending"] == 2

    done = wait_final(client, job.id)
    assert done.status == "completed" and done.x_model_output_name == job.id and done.token_count
    assert done.events and done.events[-1].type == "job_complete"
    assert wait_final(client, dpo.id).status == "completed"
    searched = wait_final(client, search.id)
    assert searched.status == "completed" and searched.model_extra is not None
    assert searched.model_extra["loraplane"]["trial_counts"]["completed"] == 2

    assert [j.id for j in client.fine_tuning.list().data] == [search.id, dpo.id, job.id]  # newest first
    events = client.fine_tuning.list_events(job.id).data
    assert events[0].type == "job_pending" and events[-1].type == "job_complete"
    assert all(e.object == "fine-tune-event" for e in events) and "Task created" in events[0].message
    checkpoints = client.fine_tuning.list_checkpoints(job.id).data
    assert checkpoints and [c.step for c in checkpoints] == sorted((c.step for c in checkpoints), reverse=True)

    assert done.x_model_output_name is not None
    answer = client.chat.completions.create(model=done.x_model_output_name, max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "3 plus 4 is"}])
    assert answer.choices and answer.choices[0].message is not None and answer.choices[0].message.content is not None
    assert answer.model.startswith(f"{done.x_model_output_name}:")  # the task's best trial answered
    sampled = client.chat.completions.create(model=checkpoints[0].path, max_tokens=3, temperature=0,
                                             messages=[{"role": "user", "content": "3 plus 4 is"}])
    assert sampled.model == checkpoints[0].path

    long = client.fine_tuning.create(training_file=training, model="tiny-random-llama", n_epochs=100, lora=True)
    assert client.fine_tuning.cancel(long.id).status == "cancelled"
    with pytest.raises(together.ConflictError, match="already finished"):
        client.fine_tuning.cancel(job.id)
    check_errors(client, training)


def check_errors(client: together.Together, training: str) -> None:
    """Our errors, raised as the client's own exceptions with our messages."""
    with pytest.raises(together.NotFoundError, match="task-missing"):
        client.fine_tuning.retrieve("task-missing")
    with pytest.raises(together.UnprocessableEntityError, match="No base model named"):  # its model-limits call
        client.fine_tuning.create(training_file=training, model="gpt-4o-mini")
    with pytest.raises(together.UnprocessableEntityError, match="packing") as packing:
        client.fine_tuning.create(training_file=training, model="tiny-random-llama", packing=False)
    assert isinstance(packing.value.body, dict) and packing.value.body["error"]["param"] == "packing"
    with pytest.raises(ValueError, match="Full training is not supported"):  # the client's own check, from our limits
        client.fine_tuning.create(training_file=training, model="tiny-random-llama", lora=False)
    with pytest.raises(together.AuthenticationError):
        together.Together(base_url=str(client.base_url), api_key="lp_wrong", max_retries=0).fine_tuning.list()


def check_isolation(stranger: together.Together, fine_tune_ids: list[str], file_id: str) -> None:
    """Another tenant's key: none of the fine-tunes is listed, and each is a 404 to every call, as to a fine-tune
    that does not exist."""
    assert fine_tune_ids and stranger.fine_tuning.list().data == []
    for fine_tune_id in fine_tune_ids:
        for call in (stranger.fine_tuning.retrieve, stranger.fine_tuning.cancel, stranger.fine_tuning.list_events,
                     stranger.fine_tuning.list_checkpoints):
            with pytest.raises(together.NotFoundError):
                call(fine_tune_id)
        with pytest.raises(together.NotFoundError):
            stranger.chat.completions.create(model=fine_tune_id, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(together.UnprocessableEntityError, match=file_id):
        stranger.fine_tuning.create(training_file=file_id, model="tiny-random-llama")
