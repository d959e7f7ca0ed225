"""A worker's warm base models (worker/model_cache.py): loaded once across packs, loaded again when the registry entry
or its files change, the least recently used evicted past the budget (and then garbage), named in the heartbeat.
Real packs of the tiny model train on the CPU through PackRunner; the bus is a file."""

from __future__ import annotations

import gc
import json
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch

from common.artifacts import LocalArtifactStore
from common.bus import SCHEDULER_STREAM, FileBus
from tests.worker.test_runner import TINY, pack
from worker.engine import ModelSource, load_base_model
from worker.engine.base_model import _save_dequantised, dequantised_dir, model_revision
from worker.heartbeat import Heartbeat, Incarnation
from worker.model_cache import Resident, evictions, model_source, resident_bytes
from worker.pack_runner import PackRunner

CPU = torch.device("cpu")


def make_runner(tmp_path: Path, model_cache_bytes: int | None = None) -> PackRunner:
    from tests.conftest import MODEL_CACHE

    bus = FileBus(tmp_path / "bus.db")
    store = LocalArtifactStore(tmp_path / "artifacts")
    rows = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(8)]
    store.put_bytes("files/data.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    heartbeat = Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q"}, Incarnation())
    return PackRunner(worker_id="w", device=CPU, bus=bus, store=store, model_cache_dir=MODEL_CACHE,
                      heartbeat=heartbeat, report_timeout_s=5.0, model_cache_bytes=model_cache_bytes)


def reports(runner: PackRunner) -> list[dict[str, Any]]:
    return [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]


def hf_copy(tiny_model_dir: Path, folder: Path, name: str) -> dict[str, Any]:
    """A registry entry of kind hf for a copy of the tiny model's directory at ``folder``."""
    shutil.copytree(tiny_model_dir, folder)
    return {"name": name, "kind": "hf", "path": str(folder), "package": None, "gguf_file": None}


def test_the_eviction_policy_frees_the_least_recently_used_first_and_never_the_one_kept() -> None:
    resident = [Resident("b", 10, 2.0), Resident("a", 10, 1.0), Resident("c", 10, 3.0)]
    assert evictions(resident, incoming_bytes=0, budget_bytes=30) == []
    assert evictions(resident, incoming_bytes=10, budget_bytes=30) == ["a"]
    assert evictions(resident, incoming_bytes=15, budget_bytes=30) == ["a", "b"]
    assert evictions(resident, incoming_bytes=0, budget_bytes=15, keep={"a"}) == ["b", "c"]
    # A model larger than the budget alone stays, the only one: the pack needs it.
    assert evictions([Resident("big", 100, 2.0), Resident("x", 1, 1.0)], incoming_bytes=0, budget_bytes=50,
                     keep={"big"}) == ["x"]
    assert evictions([], incoming_bytes=100, budget_bytes=50) == []


def test_two_packs_of_one_model_load_it_once_and_the_second_pays_no_load(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    runner.run(pack("pack-1"))
    runner.run(pack("pack-2"))
    messages = reports(runner)
    assert [m["pack_id"] for m in messages if m["type"] == "pack.finished"] == ["pack-1", "pack-2"]
    assert runner.models.loads == 1
    load_s = [m["profile"]["phases"]["load_s"] for m in messages if m["type"] == "pack.profile"]
    assert load_s[0] > 0 and load_s[1] == 0.0, load_s


def test_a_changed_registry_entry_or_rewritten_files_load_again(tmp_path: Path, tiny_model_dir: Path) -> None:
    runner = make_runner(tmp_path)
    source = hf_copy(tiny_model_dir, tmp_path / "m", "m")
    runner.run(pack("pack-1", source))
    first = weakref.ref(runner.model(model_source(source)).model)
    runner.run(pack("pack-2", source))
    assert runner.models.loads == 1
    revision = runner.models.warm()[0]["revision"]

    # Its weights rewritten in place (same path): another revision, loaded again, the old copy gone.
    weights = tmp_path / "m" / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    runner.run(pack("pack-3", source))
    assert runner.models.loads == 2
    gc.collect()
    assert first() is None
    [warm] = runner.models.warm()
    assert warm["name"] == "m" and warm["revision"] != revision

    # PATCHed to another directory: loaded again, still one copy under the name.
    moved = hf_copy(tiny_model_dir, tmp_path / "elsewhere", "m")
    assert not runner.model(model_source(moved)).warm
    assert runner.model(model_source(moved)).warm
    assert runner.models.loads == 3
    assert [w["name"] for w in runner.models.warm()] == ["m"]
    assert [m["pack_id"] for m in reports(runner) if m["type"] == "pack.finished"] == ["pack-1", "pack-2", "pack-3"]


def test_past_the_budget_the_least_recently_used_model_is_evicted_and_freed(tmp_path: Path,
                                                                             tiny_model_dir: Path) -> None:
    a, b, c = (hf_copy(tiny_model_dir, tmp_path / name, name) for name in "abc")
    size = resident_bytes(load_base_model(model_source(a), cache_dir=tmp_path / "cache", device=CPU)[0])
    runner = make_runner(tmp_path, model_cache_bytes=2 * size)  # room for two
    runner.run(pack("pack-a", a))
    runner.run(pack("pack-b", b))  # the pack's engine is kept around b's layers
    evicted = weakref.ref(runner.model(model_source(b)).model)
    assert runner.model(model_source(a)).warm  # a is now used more recently than b
    assert [w["name"] for w in runner.models.warm()] == ["a", "b"]
    runner.run(pack("pack-c", c))
    assert [w["name"] for w in runner.models.warm()] == ["c", "a"]
    assert evicted() is None  # no reference left anywhere: its memory is free
    assert sum(w["bytes"] for w in runner.models.warm()) == 2 * size
    assert runner.model(model_source(a)).warm and runner.models.loads == 3
    assert [m["pack_id"] for m in reports(runner) if m["type"] == "pack.finished"] == ["pack-a", "pack-b", "pack-c"]


def test_the_heartbeat_names_the_warm_models_most_recently_used_first(tmp_path: Path, tiny_model_dir: Path) -> None:
    runner = make_runner(tmp_path)
    heartbeat = runner.heartbeat
    assert heartbeat is not None
    heartbeat.warm_models = runner.models.warm
    heartbeat.beat()
    runner.model(model_source(hf_copy(tiny_model_dir, tmp_path / "m", "m")))
    runner.model(model_source(TINY))
    heartbeat.beat()
    beats = [m for m in reports(runner) if m["type"] == "heartbeat"]
    assert beats[0]["warm_models"] == []
    names = [(w["name"], w["revision"]) for w in beats[1]["warm_models"]]
    assert names == [("tiny-random-llama", "tiny-random-llama"), ("m", model_revision(model_source(
        {"name": "m", "kind": "hf", "path": str(tmp_path / "m")})))]
    assert all(w["bytes"] > 0 and isinstance(w["last_used_at"], float) for w in beats[1]["warm_models"])


def test_a_revision_is_the_files_that_make_the_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    source = model_source(hf_copy(tiny_model_dir, tmp_path / "m", "m"))
    revision = model_revision(source)
    (tmp_path / "m" / "README.md").write_text("notes")  # not a weight, config or tokenizer file
    assert model_revision(source) == revision
    (tmp_path / "m" / "config.json").write_text((tmp_path / "m" / "config.json").read_text() + " ")
    assert model_revision(source) != revision
    gguf = tmp_path / "g" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    by_path = ModelSource(name="g", kind="gguf", path=str(gguf.parent), gguf_file="m.gguf")
    before = model_revision(by_path)
    gguf.write_bytes(b"GGUF2")
    assert model_revision(by_path) != before
    assert model_revision(model_source(TINY)) == "tiny-random-llama"


def test_a_dequantised_copy_replaces_the_older_revisions_copies(tmp_path: Path) -> None:
    model, tokenizer = load_base_model(model_source(TINY), cache_dir=tmp_path / "cache", device=CPU)
    gguf = tmp_path / "g" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    source = ModelSource(name="org/m", kind="gguf", path=str(gguf.parent), gguf_file="m.gguf")
    old = dequantised_dir(source, tmp_path / "cache", torch.float32)
    other_type = dequantised_dir(source, tmp_path / "cache", torch.bfloat16)
    _save_dequantised(model, tokenizer, old)
    _save_dequantised(model, tokenizer, other_type)
    in_progress = old.parent / f".{old.name}.tmp-another-process"
    in_progress.mkdir()
    gguf.write_bytes(b"GGUF, another revision")
    new = dequantised_dir(source, tmp_path / "cache", torch.float32)
    _save_dequantised(model, tokenizer, new)
    assert old.parent.name == "org%2Fm" and new != old
    assert sorted(p.name for p in new.parent.iterdir()) == sorted([new.name, in_progress.name])
    loaded = load_base_model(model_source({**TINY, "name": "copy", "kind": "hf", "path": str(new)}),
                             cache_dir=tmp_path / "cache", device=CPU)[0]
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
