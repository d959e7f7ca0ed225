"""Several packs on one worker (issue 34, worker/colocation.py, worker/pack_processes.py): the rule of which pack may
start beside the running ones and which idle warm models go to make room; real packs of two tiny models of two
architectures training at once in two pack processes on the CPU, each exactly as it trains alone; a pack process
killed mid-pack takes only its pack; a pack that does not fit beside a running one is refused, nothing of it run."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

import worker.pack_runner
from common.artifacts import LocalArtifactStore, adapter_key
from common.bus import SCHEDULER_STREAM, FileBus
from common.messages import ModelSourceFields, PackMessage, TrialPayload
from tests.model_dirs import tiny_model_dir
from worker.colocation import IdleModel, Reservation, RunningPacks, idle_models_to_drop, max_packs_for, refusal
from worker.engine import ModelSource
from worker.heartbeat import Heartbeat, Incarnation
from worker.main import pack_process_main
from worker.pack_processes import PackProcessConfig, PackProcesses
from worker.pack_runner import PackRunner

TINY = {"name": "tiny-random-llama", "kind": "tiny-random-llama", "path": None, "package": None, "gguf_file": None}
GB = 10**9


def test_a_pack_starts_beside_others_only_within_the_packs_the_models_and_the_memory() -> None:
    a = Reservation("a", "llama", 3 * GB)
    assert refusal(Reservation("big", "x", 99 * GB), [], max_packs=1, memory_bytes=GB) is None  # alone: always
    assert refusal(Reservation("b", "qwen", 5 * GB), [a], max_packs=2, memory_bytes=8 * GB) is None
    too_big = refusal(Reservation("b", "qwen", 6 * GB), [a], max_packs=2, memory_bytes=8 * GB)
    assert too_big is not None and "6.00 GB" in too_big and "3.00 GB reserved" in too_big
    same = refusal(Reservation("b", "llama", GB), [a], max_packs=2, memory_bytes=80 * GB)
    assert same is not None and "a pack of llama already runs" in same
    full = refusal(Reservation("c", "gemma", GB), [a, Reservation("b", "qwen", GB)], max_packs=2,
                   memory_bytes=80 * GB)
    assert full is not None and "its most" in full


def test_the_ledger_reserves_releases_and_remembers_which_packs_shared_the_device() -> None:
    packs = RunningPacks(max_packs=2, memory_bytes=10 * GB)
    assert packs.reserve(Reservation("a", "llama", 4 * GB)) is None
    assert packs.free_bytes() == 6 * GB and not packs.shared("a")
    assert packs.reserve(Reservation("b", "qwen", 7 * GB)) is not None  # nothing reserved for a refused pack
    assert packs.free_bytes() == 6 * GB and packs.count() == 1
    assert packs.reserve(Reservation("b", "qwen", 5 * GB)) is None
    assert packs.shared("a") and packs.shared("b") and packs.free_bytes() == GB
    assert packs.release("a") is True
    assert packs.reserve(Reservation("c", "gemma", 8 * GB)) is not None  # b still holds 5 of the 10
    assert packs.release("b") is True and packs.free_bytes() == 10 * GB
    assert packs.reserve(Reservation("d", "gemma", 8 * GB)) is None
    assert packs.release("d") is False  # it ran alone


@pytest.fixture
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


def make_runner(tmp_path: Path, *, max_packs: int, memory_bytes: int | None = None,
                in_processes: bool = False) -> PackRunner:
    """A worker's runner on the CPU; ``in_processes``: running each pack in one of ``max_packs`` pack processes, as
    `loraplane worker` does with LORAPLANE_WORKER_MAX_PACKS > 1 (the caller closes ``runner.processes``)."""
    from tests.conftest import MODEL_CACHE

    bus = FileBus(tmp_path / "bus.db")
    store = LocalArtifactStore(tmp_path / "artifacts")
    rows = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(16)]
    store.put_bytes("files/data.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    heartbeat = Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q"}, Incarnation())
    processes = None
    if in_processes:
        processes = PackProcesses(PackProcessConfig(
            worker_id="w", device="cpu", incarnation=heartbeat.incarnation,
            make_bus=functools.partial(FileBus, tmp_path / "bus.db"),
            make_store=functools.partial(LocalArtifactStore, tmp_path / "artifacts"), model_cache_dir=MODEL_CACHE,
            report_timeout_s=5.0, processes=max_packs, cpu_threads=1,
        ), heartbeat.state, memory_bytes or 100 * GB, entry=pack_process_main)
        processes.start()
    return PackRunner(worker_id="w", device=torch.device("cpu"), bus=bus, store=store, model_cache_dir=MODEL_CACHE,
                      heartbeat=heartbeat, report_timeout_s=5.0, max_packs=max_packs, memory_bytes=memory_bytes,
                      processes=processes)


def pack(pack_id: str, task_id: str, source: dict[str, Any], *, memory_bytes: int | None = None,
         steps: int = 12) -> PackMessage:
    trials = [TrialPayload(
        trial_id=f"trial-{i}", task_id=task_id, total_steps=steps, max_seq_len=32, eval_interval=4,
        hyperparameters={"learning_rate": lr, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                         "batch_size": 2, "target_modules": ["q_proj", "v_proj"], "seed": i},
        training_file_key="files/data.jsonl", validation_file_key=None, validation_split=0.25,
        split_seed=0, training={},
    ) for i, lr in enumerate((1e-3, 5e-3))]
    return PackMessage(pack_id=pack_id, worker_id="w", base_model=ModelSourceFields(**source), trials=trials,
                       memory_bytes=memory_bytes)


def reports(runner: PackRunner) -> list[dict[str, Any]]:
    """Every report sent so far (read again on each call)."""
    return [m for _, m in runner.bus.read_after(SCHEDULER_STREAM, "0", count=100_000, block_s=0)]


def adapters(runner: PackRunner, task_id: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each trial's stored adapter weights (the PEFT safetensors in its archive)."""
    out = {}
    for trial_id in ("trial-0", "trial-1"):
        with tarfile.open(fileobj=io.BytesIO(runner.store.get_bytes(adapter_key(task_id, trial_id)))) as tar:
            member = tar.extractfile("adapter_model.safetensors")
            assert member is not None
            out[trial_id] = load_safetensors(member.read())
    return out


def loading_gate(monkeypatch: pytest.MonkeyPatch, gate: Callable[[str], None]) -> None:
    """Calls ``gate(model name)`` after each real load of a base model (before its pack trains)."""
    real = worker.pack_runner.load_base_model

    def gated(source: ModelSource, **kwargs: Any) -> Any:
        loaded = real(source, **kwargs)
        gate(source.name)
        return loaded

    monkeypatch.setattr(worker.pack_runner, "load_base_model", gated)


def test_a_worker_runs_two_packs_on_one_gpu_by_default_and_one_on_the_cpu_or_over_several_gpus() -> None:
    assert max_packs_for(0, device_type="cuda", gpus=1) == 2
    assert max_packs_for(0, device_type="cpu", gpus=1) == 1
    assert max_packs_for(3, device_type="cpu", gpus=1) == 3  # an operator's number is kept
    assert max_packs_for(4, device_type="cuda", gpus=2) == 1


def test_idle_warm_models_go_least_recently_used_first_only_as_far_as_the_packs_need_their_room() -> None:
    a, b = IdleModel(0, "llama", 3 * GB, last_used_at=10.0), IdleModel(1, "qwen", 2 * GB, last_used_at=5.0)
    assert idle_models_to_drop(5 * GB, [a, b], memory_bytes=10 * GB) == []  # 5 + 3 + 2 fit in 10
    assert idle_models_to_drop(6 * GB, [a, b], memory_bytes=10 * GB) == [b]  # the older goes first, and enough
    assert idle_models_to_drop(9 * GB, [a, b], memory_bytes=10 * GB) == [b, a]
    assert idle_models_to_drop(11 * GB, [], memory_bytes=10 * GB) == []  # nothing to drop: the pack's own risk


def run_side_by_side(runner: PackRunner, packs: list[PackMessage]) -> None:
    threads = [threading.Thread(target=runner.run, args=(p,)) for p in packs]  # as Celery's threads pool does
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
        assert not thread.is_alive(), "a pack never ended"


def test_two_packs_of_two_models_train_at_once_in_two_processes_each_as_it_would_alone(
    tmp_path: Path, qwen_dir: Path
) -> None:
    qwen = {**TINY, "name": "tiny-qwen2", "kind": "hf", "path": str(qwen_dir)}
    alone = make_runner(tmp_path / "alone", max_packs=1)
    alone.run(pack("p-llama", "llama-alone", TINY))
    alone.run(pack("p-qwen", "qwen-alone", qwen))
    assert [m["type"] for m in reports(alone) if m["type"].startswith("pack.")].count("pack.finished") == 2

    together = make_runner(tmp_path / "together", max_packs=2, in_processes=True)
    assert together.processes is not None
    try:
        deadline = time.monotonic() + 300
        while not together.processes.ready():  # both processes up: neither pack can end before the other starts
            assert time.monotonic() < deadline, "the pack processes never started"
            time.sleep(0.1)
        run_side_by_side(together, [pack("p-llama", "llama-together", TINY), pack("p-qwen", "qwen-together", qwen)])
        sent = reports(together)
        kinds = [(m["pack_id"], m["type"]) for m in sent if m["type"].startswith("pack.")]
        assert {k for k in kinds if k[1] in ("pack.finished", "pack.failed")} == {
            ("p-llama", "pack.finished"), ("p-qwen", "pack.finished")}
        first_end = min(kinds.index(("p-llama", "pack.finished")), kinds.index(("p-qwen", "pack.finished")))
        assert {k for k in kinds[:first_end] if k[1] == "pack.started"} == {
            ("p-llama", "pack.started"), ("p-qwen", "pack.started")}, kinds  # they overlapped
        profiles = {m["pack_id"]: m["profile"] for m in sent if m["type"] == "pack.profile"}
        assert all(p.get("shared_device") is True for p in profiles.values()), profiles  # the cost fit leaves them out
        assert together.packs.count() == 0 and not together.heartbeat.state.read()[0]  # released, named no more
        warm = together.processes.warm()  # each process keeps its pack's model warm, and the beats name both
        assert sorted(w["name"] for w in warm) == ["tiny-qwen2", "tiny-random-llama"], warm
    finally:
        together.processes.close()
    for model in ("llama", "qwen"):
        got, want = adapters(together, f"{model}-together"), adapters(alone, f"{model}-alone")
        for trial_id, weights in want.items():
            assert weights.keys() == got[trial_id].keys()
            for name, tensor in weights.items():
                torch.testing.assert_close(got[trial_id][name], tensor, rtol=0, atol=1e-5)


def test_a_pack_that_does_not_fit_beside_a_running_one_is_refused_and_nothing_of_it_runs(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(tmp_path, max_packs=2, memory_bytes=10 * GB)
    refused = threading.Event()
    loading_gate(monkeypatch, lambda _name: refused.wait(timeout=120))  # the first pack holds until the refusal
    first = threading.Thread(target=runner.run, args=(pack("p-1", "t-1", TINY, memory_bytes=6 * GB),))
    first.start()
    qwen = {**TINY, "name": "tiny-qwen2", "kind": "hf", "path": str(qwen_dir)}
    deadline = time.monotonic() + 120
    while runner.packs.count() == 0:  # the first pack reserved its 6 GB
        assert first.is_alive() and time.monotonic() < deadline, "the first pack never started"
        time.sleep(0.01)
    runner.run(pack("p-2", "t-2", qwen, memory_bytes=5 * GB))
    refused.set()
    first.join(timeout=300)
    sent = reports(runner)
    second = [m for m in sent if m["pack_id"] == "p-2"]
    assert [m["type"] for m in second] == ["pack.refused"], second  # no start, no point, no trial report
    assert "5.00 GB do not fit beside the 6.00 GB reserved" in second[0]["reason"]
    assert ("p-1", "pack.finished") in {(m["pack_id"], m["type"]) for m in sent}
    assert runner.packs.free_bytes() == 10 * GB


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_pack_process_killed_mid_pack_takes_only_its_pack_and_another_takes_its_place(
    tmp_path: Path, qwen_dir: Path
) -> None:
    qwen = {**TINY, "name": "tiny-qwen2", "kind": "hf", "path": str(qwen_dir)}
    runner = make_runner(tmp_path, max_packs=2, in_processes=True)
    assert runner.processes is not None and runner.heartbeat is not None
    try:
        wait_until(runner.processes.ready, "the pack processes never started")
        doomed = threading.Thread(target=runner.run, args=(pack("p-doomed", "t-doomed", TINY, steps=100_000),))
        doomed.start()
        wait_until(lambda: any(m["type"] == "points" and m["pack_id"] == "p-doomed" for m in reports(runner)),
                   "the doomed pack never trained")
        run_side_by_side(runner, [pack("p-qwen", "t-qwen", qwen)])  # beside it, to its end
        os.kill(runner.processes.running()["p-doomed"], signal.SIGKILL)
        doomed.join(timeout=120)
        assert not doomed.is_alive(), "the worker process still waits for the killed pack process"
        assert runner.packs.count() == 0 and not runner.heartbeat.state.read()[0]  # the scheduler requeues it
        runner.run(pack("p-after", "t-after", TINY))  # its replacement (or the other process) serves on
        ends = {(m["pack_id"], m["type"]) for m in reports(runner) if m["type"] in ("pack.finished", "pack.failed")}
        assert ends == {("p-qwen", "pack.finished"), ("p-after", "pack.finished")}, ends
    finally:
        runner.processes.close()


def test_an_idle_process_drops_its_warm_model_when_a_starting_pack_needs_the_room(
    tmp_path: Path, qwen_dir: Path
) -> None:
    qwen = {**TINY, "name": "tiny-qwen2", "kind": "hf", "path": str(qwen_dir)}
    runner = make_runner(tmp_path, max_packs=2, memory_bytes=GB, in_processes=True)
    assert runner.processes is not None
    try:
        runner.run(pack("p-llama", "t-llama", TINY, memory_bytes=GB // 2))
        assert [w["name"] for w in runner.processes.warm()] == ["tiny-random-llama"]  # kept warm while it fits
        runner.run(pack("p-qwen", "t-qwen", qwen, memory_bytes=GB))  # all of the memory: llama's copy must go
        assert [w["name"] for w in runner.processes.warm()] == ["tiny-qwen2"]
        runner.run(pack("p-llama-2", "t-llama-2", TINY, memory_bytes=GB // 2))  # qwen's copy fits beside it
        assert sorted(w["name"] for w in runner.processes.warm()) == ["tiny-qwen2", "tiny-random-llama"]
    finally:
        runner.processes.close()
    ends = [(m["pack_id"], m["type"]) for m in reports(runner) if m["type"] in ("pack.finished", "pack.failed")]
    assert ends == [("p-llama", "pack.finished"), ("p-qwen", "pack.finished"), ("p-llama-2", "pack.finished")]
