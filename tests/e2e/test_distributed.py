"""The distributed mode end to end: `loraplane api`, `loraplane scheduler` and `loraplane worker` as
separate processes against the real PostgreSQL, Redis (bus and Celery broker) and artifact directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplane.client import Trial
from tests.conftest import ADMIN_TOKEN, MODEL_CACHE
from tests.e2e.flow import (
    arithmetic_rows,
    assert_adapter_changes_output,
    download_adapter,
    follow_events,
    grid_task,
    submit,
    tenant_client,
    upload,
    wait_for,
)
from tests.e2e.procs import Cluster, cluster, distributed_env, start_control_plane
from tests.engine.factories import assert_rel_close
from tests.services import MissingService, find_rabbitmq


@pytest.fixture
def env(clean_db: None, tmp_path: Path) -> dict[str, str]:
    return distributed_env(tmp_path)


@pytest.fixture(params=["redis"])
def services(request: pytest.FixtureRequest, env: dict[str, str], tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    if request.param == "rabbitmq":
        try:
            env["CELERY_BROKER_URL"] = find_rabbitmq()
        except MissingService as exc:
            pytest.skip(str(exc))
    with cluster(env, tmp_path) as c:
        yield c, start_control_plane(c)


@pytest.mark.parametrize("services", ["redis", "rabbitmq"], indirect=True)
def test_grid_task_end_to_end(services: tuple[Cluster, str], tmp_path: Path) -> None:
    c, base_url = services
    worker = c.start("worker-a", "worker", "--worker-id", "e2e-a")
    with tenant_client(base_url, ADMIN_TOKEN, "team-e2e") as lp:
        file_id = upload(lp, arithmetic_rows())
        task = submit(lp, grid_task(file_id))
        assert task.state == "queued"

        events, ended = follow_events(lp, task.id)  # returns only after the stream's `end`
        types = [e.type for e in events]
        assert types[0] == "task.created", types
        assert ended.state == "succeeded", ended
        assert types.count("trial.completed") == 4 and "task.succeeded" in types

        task = lp.tasks.get(task.id)
        assert task.state == "succeeded" and task.progress == 1.0
        assert task.trial_counts.completed == 4
        trials = lp.tasks.trials(task.id).data
        val_losses = {t.id: t.best_val_loss for t in trials}
        assert task.best_trial is not None
        assert task.best_trial.id == min(val_losses, key=lambda k: val_losses[k])
        for trial in trials:
            metrics = lp.tasks.metrics(task.id, trial.id)
            assert [p.step for p in metrics.train] == list(range(1, 7))
            assert [p.step for p in metrics.val] == [3, 6]

        adapter = download_adapter(lp, task.id, tmp_path / "adapter")
        config = json.loads((adapter / "adapter_config.json").read_text())
        best_hp = next(t.hyperparameters for t in trials if t.id == task.best_trial.id)
        assert config["r"] == best_hp["lora_rank"] and config["peft_type"] == "LORA"
    assert_adapter_changes_output(adapter, "tiny-random-llama", MODEL_CACHE)
    broker_scheme = c.env["CELERY_BROKER_URL"].split("://")[0]  # the pack really went through this broker
    assert f".> transport:   {broker_scheme}://" in worker.log_path.read_text()


def test_a_task_submitted_while_a_pack_trains_joins_its_free_slot(services: tuple[Cluster, str]) -> None:
    """One worker, busy with a long task of two trials in a pack with room for four: a short task that
    arrives meanwhile is back-filled into the running pack and finishes (reported at once) while the long
    one still trains."""
    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-backfill")
    with tenant_client(base_url, ADMIN_TOKEN, "team-backfill") as lp:
        file_id = upload(lp, arithmetic_rows())
        long_body = grid_task(file_id, max_steps=2000)
        long_body["search_space"]["lora_rank"] = [4]
        long_body["scheduling"] = {"max_trials_per_pack": 4}
        long_id = submit(lp, long_body).id

        def trials(task_id: str) -> list[Trial]:
            return lp.tasks.trials(task_id).data

        wait_for(lambda: all(t.steps_done >= 3 for t in trials(long_id)), 120, "the long task to train")
        short_body = grid_task(file_id, max_steps=6)
        short_body["search_space"] = {"learning_rate": [1e-3], "lora_rank": [2], "batch_size": [4],
                                      "target_modules": [["q_proj", "v_proj"]]}
        short_id = submit(lp, short_body).id
        events, ended = follow_events(lp, short_id)
        assert ended.state == "succeeded", ended
        (running,) = [e for e in events if e.type == "trial.running"]
        assert running.data["backfill"] is True, running
        long_events = lp.tasks.events(long_id).data
        long_packs = {e.data["pack_id"] for e in long_events if e.type == "trial.running"}
        assert long_packs == {running.data["pack_id"]}, (running, long_events)
        task = lp.tasks.get(long_id)
        assert task.state == "running" and task.trial_counts.running == 2, task  # still training
        assert lp.tasks.cancel(long_id).state == "cancelled"  # an error answer would raise APIError


@pytest.mark.parametrize("gpus", [None, "0,1"], ids=["one-device", "two-ranks"])
def test_alto_rotates_trials_through_their_warm_up_and_stops_the_weakest(services: tuple[Cluster, str],
                                                                         gpus: str | None) -> None:
    """Four trials, two slots: the first two pause at their warm-up boundary (checkpointed, slots freed) so
    the other two can warm up; the ranking then keeps two, which finish, and stops two as underperforming.
    (Divergence and overfitting are switched off here: their thresholds are unit-tested on exact curves.)
    Also on a worker over two ranks (`--gpus 0,1`, on the CPU: worker/rank_pool.py), one slot each: the pauses, the
    trials rejoining from their checkpoints (back-fills dealt to the rank with room) and the stops."""
    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-alto", *(["--gpus", gpus] if gpus else []))
    lp = tenant_client(base_url, ADMIN_TOKEN, "team-alto")
    file_id = upload(lp, arithmetic_rows())
    # Long enough that the scheduler (a round every 0.5 s) acts at the warm-up boundary (5%: step 50, or 25) well
    # before the first trials could finish: the tiny model trains hundreds of steps a second. Over two ranks (a
    # thread each, gloo collectives every step) it trains several times slower, so half the steps leave the scheduler
    # as long in seconds, and halve the kept trials' training, most of that case's time (200 s with 1000 steps).
    max_steps = 500 if gpus else 1000
    body = grid_task(file_id, max_steps=max_steps)
    body["eval_interval"] = 250
    body["scheduling"] = {"max_trials_per_pack": 2}
    body["early_exit"] = {"policy": "alto", "rungs": 1, "keep_ratio": 0.5, "tau_slope": 100.0, "tau_gap": 100.0}
    task_id = submit(lp, body).id
    events, ended = follow_events(lp, task_id)
    assert ended.state == "succeeded", ended
    kinds = [e.type for e in events]
    assert kinds.count("trial.waiting") >= 2, kinds  # the first two waited for the others' warm-up
    stopped = [e for e in events if e.type == "trial.stopped_early"]
    assert len(stopped) == 2 and all(e.data["reason"] == "underperforming" for e in stopped), stopped
    task = lp.tasks.get(task_id)
    assert task.trial_counts.completed == 2 and task.trial_counts.stopped_early == 2, task
    trials = lp.tasks.trials(task_id).data
    stopped_ids = {e.trial_id for e in stopped}
    assert task.best_trial is not None and task.best_trial.id not in stopped_ids
    assert all(t.steps_done < max_steps for t in trials if t.id in stopped_ids)
    lp.close()


def test_killed_worker_and_scheduler_lose_nothing(services: tuple[Cluster, str]) -> None:
    c, base_url = services
    worker_a = c.start("worker-a", "worker", "--worker-id", "e2e-kill-a")
    lp = tenant_client(base_url, ADMIN_TOKEN, "team-crash")
    file_id = upload(lp, arithmetic_rows())
    body = grid_task(file_id, max_steps=400)
    body["eval_interval"] = 20  # the worker checkpoints every 0.2 s (tests/e2e/procs.py distributed_env)
    task_id = submit(lp, body).id

    def checkpointed() -> bool:
        return all((t.checkpoint_step or 0) >= 20 for t in lp.tasks.trials(task_id))

    wait_for(checkpointed, 180, "a checkpoint of every trial", interval_s=0.2)
    scheduler = next(p for p in c.procs if p.name == "scheduler")
    worker_a.kill()
    scheduler.kill()
    c.start("scheduler-2", "scheduler")
    c.start("worker-b", "worker", "--worker-id", "e2e-kill-b")

    events, ended = follow_events(lp, task_id)
    assert ended.state == "succeeded", [e.type for e in events]
    requeued = [e for e in events if e.type == "trial.requeued"]
    assert len(requeued) == 4 and all("e2e-kill-a" in e.message for e in requeued)
    assert all(e.data["resume_step"] >= 20 for e in requeued)  # resumed, not restarted
    trials = lp.tasks.trials(task_id).data
    # The worker's loss spent no attempt of theirs (scheduler/service/faults.py).
    assert all(t.state == "completed" and t.steps_done == 400 and t.attempts == 1 for t in trials)
    for trial in trials:  # one point per step: nothing lost, nothing stored twice around the resume
        metrics = lp.tasks.metrics(task_id, trial.id)
        assert [p.step for p in metrics.train] == list(range(1, 401))
    workers = {w.id: w.state for w in lp.admin.list_workers()}
    assert workers["e2e-kill-a"] == "lost" and workers["e2e-kill-b"] == "alive"
    lp.close()


def test_trials_trained_alone_equal_trials_trained_packed(services: tuple[Cluster, str], tmp_path: Path) -> None:
    """`scheduling.max_trials_per_pack = 1` gives, trial by trial, the adapters of the packed run."""
    from safetensors.torch import load_file

    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-alone")
    lp = tenant_client(base_url, ADMIN_TOKEN, "team-alone")
    file_id = upload(lp, arithmetic_rows())
    body = grid_task(file_id)
    body["search_space"].update(lora_dropout=[0.1], batch_size=[2, 4], lora_rank=[2, 4])
    packed = submit(lp, body).id
    alone = submit(lp, {**body, "scheduling": {"max_trials_per_pack": 1}}).id
    for task_id in (packed, alone):
        assert follow_events(lp, task_id)[1].state == "succeeded"

    def adapters(task_id: str) -> list[dict[str, Any]]:
        out = []
        for t in lp.tasks.trials(task_id):
            d = download_adapter(lp, task_id, tmp_path / task_id / t.id, trial_id=t.id)
            out.append(load_file(str(d / "adapter_model.safetensors")))
        return out

    def packs(task_id: str) -> set[str]:
        return {e.data["pack_id"] for e in lp.tasks.events(task_id) if e.type == "trial.running"}

    n_trials = len(lp.tasks.trials(alone))
    # The planner may split the packed task over the cluster's workers (it halves each pack's step); some
    # pack still holds several trials, and alone means one pack per trial.
    assert n_trials == 8 and len(packs(packed)) < n_trials and len(packs(alone)) == n_trials
    for packed_tensors, alone_tensors in zip(adapters(packed), adapters(alone), strict=True):
        assert packed_tensors.keys() == alone_tensors.keys()
        for key, value in packed_tensors.items():
            assert_rel_close(value, alone_tensors[key])


@pytest.mark.slow
def test_smollm2_trains_on_a_small_chat_dataset(services: tuple[Cluster, str], tmp_path: Path) -> None:
    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-smol")
    lp = tenant_client(base_url, ADMIN_TOKEN, "team-smol")
    rows = [{"messages": [{"role": "system", "content": "You answer with one word."},
                          {"role": "user", "content": f"What colour is item {i}?"},
                          {"role": "assistant", "content": ["red", "green", "blue"][i % 3]}]}
            for i in range(12)]
    file_id = upload(lp, "\n".join(json.dumps(r) for r in rows).encode())
    task_id = submit(lp, {
        "base_model": "smollm2-135m-instruct", "training_file": file_id, "validation_split": 0.25,
        "search_space": {"learning_rate": [1e-4, 1e-3], "lora_rank": [4], "batch_size": [2]},
        "max_steps": 3, "max_seq_len": 64, "eval_interval": 3,
    }).id
    events, ended = follow_events(lp, task_id)
    assert ended.state == "succeeded", [e.type for e in events]
    adapter = download_adapter(lp, task_id, tmp_path / "adapter")
    lp.close()
    assert_adapter_changes_output(adapter, "smollm2-135m-instruct", MODEL_CACHE)


def test_registered_models_of_two_families_train_and_export_end_to_end(
    services: tuple[Cluster, str], tmp_path: Path
) -> None:
    """An operator registers a Qwen2 and a Phi-3 directory (fused qkv_proj / gate_up_proj); a tenant sees them
    with their target modules, tunes a 2x2 grid on each, and the best adapters download, name the model's
    directory and its target modules, and load in PEFT on the registered model, changing its logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplane.client import APIError, Client
    from tests.model_dirs import tiny_model_dir

    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-byo")
    dirs = {family: tiny_model_dir(family, tmp_path / "models" / family) for family in ("qwen2", "phi3")}
    with Client(base_url, admin_token=ADMIN_TOKEN, timeout=30) as operator:
        for family, path in dirs.items():
            assert operator.admin.register_model(f"tiny-{family}", str(path)).architecture == family
    targets = {"qwen2": [["q_proj", "v_proj"]], "phi3": ["all-linear"]}
    with tenant_client(base_url, ADMIN_TOKEN, "team-byo") as lp:
        listed = {m.id: m for m in lp.models.list().data}
        assert listed["tiny-phi3"].target_modules == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        file_id = upload(lp, arithmetic_rows())
        wrong = grid_task(file_id, base_model="tiny-phi3")  # q_proj / v_proj: Phi-3 has them fused
        with pytest.raises(APIError) as refused:
            submit(lp, wrong)
        assert (refused.value.status_code, refused.value.code) == (422, "unknown_target_module")
        tasks = {}
        for family in dirs:
            body = grid_task(file_id, base_model=f"tiny-{family}")
            body["search_space"]["target_modules"] = targets[family]
            tasks[family] = submit(lp, body).id
        for family, task_id in tasks.items():
            events, ended = follow_events(lp, task_id)
            assert ended.state == "succeeded", (family, [(e.type, e.message) for e in events])
            assert ended.trial_counts.completed == 4
            adapter = download_adapter(lp, task_id, tmp_path / f"adapter-{family}")
            config = json.loads((adapter / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == str(dirs[family])
            want = ["q_proj", "v_proj"] if family == "qwen2" else ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
            assert config["target_modules"] == want
            model = AutoModelForCausalLM.from_pretrained(dirs[family])
            inputs = AutoTokenizer.from_pretrained(dirs[family])("3 plus 4 is", return_tensors="pt")
            with torch.no_grad():
                base_logits = model(**inputs).logits.clone()
                tuned_logits = PeftModel.from_pretrained(model, str(adapter))(**inputs).logits
            assert (tuned_logits - base_logits).abs().max().item() > 1e-4, family


def test_a_base_registered_in_nf4_trains_in_4_bits_and_merges_into_its_dequantised_weights(
    services: tuple[Cluster, str], tmp_path: Path
) -> None:
    """An operator registers one directory twice, once with `quantization: nf4` (issue 36); the same trial on each
    trains through the service, the 4-bit one's losses a little off the full one's (its frozen weights rounded), and
    its merged export holds, where no adapter touched, the de-quantised 4-bit weight, not the checkpoint's own."""
    import torch
    from safetensors.torch import load_file

    from loraplane.client import Client
    from tests.model_dirs import tiny_model_dir
    from worker.engine.quantize import nf4_parameter

    c, base_url = services
    c.start("worker-q", "worker", "--worker-id", "e2e-nf4")
    directory = tiny_model_dir("llama", tmp_path / "models" / "llama")
    with Client(base_url, admin_token=ADMIN_TOKEN, timeout=30) as operator:
        assert operator.admin.register_model("tiny-nf4", str(directory), quantization="nf4").quantization == "nf4"
        assert operator.admin.register_model("tiny-full", str(directory)).quantization is None
    with tenant_client(base_url, ADMIN_TOKEN, "team-nf4") as lp:
        assert {m.id: m.quantization for m in lp.models.list().data}["tiny-nf4"] == "nf4"
        file_id = upload(lp, arithmetic_rows())
        space = {"learning_rate": [5e-3], "lora_rank": [4], "batch_size": [4], "target_modules": [["q_proj", "v_proj"]]}
        tasks = {name: submit(lp, {**grid_task(file_id, base_model=name), "search_space": space}).id
                 for name in ("tiny-nf4", "tiny-full")}
        losses = {}
        for name, task_id in tasks.items():
            events, ended = follow_events(lp, task_id)
            assert ended.state == "succeeded", (name, [(e.type, e.message) for e in events])
            (curve,) = lp.tasks.curves(task_id)
            losses[name] = torch.tensor([point[3] for point in curve["train"]])
        assert len(losses["tiny-nf4"]) == 6 and not torch.equal(losses["tiny-nf4"], losses["tiny-full"])
        assert_rel_close(losses["tiny-nf4"], losses["tiny-full"], 0.02)
        merged = lp.tasks.download_adapter(tasks["tiny-nf4"], tmp_path / "merged", merged=True, timeout=300)
    weights, original = load_file(merged / "model.safetensors"), load_file(directory / "model.safetensors")
    untouched = "model.layers.0.self_attn.o_proj.weight"  # the adapter is on q_proj and v_proj only
    want = nf4_parameter(original[untouched].float()).get_original_weight()
    assert torch.equal(weights[untouched].float(), want) and not torch.equal(want, original[untouched].float())
