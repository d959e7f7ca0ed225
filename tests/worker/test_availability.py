"""Which registered models a worker can load (worker/availability.py), checked on real directories, files and an
installed package, and what its heartbeat says of them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from common.bus import REGISTRY_KEY, SCHEDULER_STREAM, FileBus
from tests.model_dirs import copy_without
from worker.availability import ModelAvailability, can_load
from worker.heartbeat import Heartbeat, Incarnation

ROOT = Path(__file__).resolve().parents[2]


def hf(path: Path | str) -> dict[str, Any]:
    return {"name": "m", "kind": "hf", "path": str(path), "package": None, "gguf_file": None}


def test_an_hf_model_loads_where_its_directory_has_a_readable_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert can_load(hf(tiny_model_dir))
    assert not can_load(hf(copy_without(tiny_model_dir, tmp_path / "no-config", "config.json")))
    broken = copy_without(tiny_model_dir, tmp_path / "broken", "config.json")
    (broken / "config.json").write_text("{not json")
    assert not can_load(hf(broken))
    (broken / "config.json").write_text("[1, 2]")  # JSON, but not a config
    assert not can_load(hf(broken))
    assert not can_load(hf(tmp_path / "nowhere"))
    assert not can_load(hf(tiny_model_dir / "config.json"))  # a file, not a directory
    assert not can_load({"name": "m", "kind": "hf", "path": None})


def test_a_gguf_model_loads_where_its_file_is(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    source = {"name": "m", "kind": "gguf", "path": str(tmp_path), "gguf_file": "m.gguf"}
    assert can_load(source)
    assert not can_load({**source, "gguf_file": "other.gguf"})
    assert not can_load({**source, "path": str(tmp_path / "nowhere")})
    assert not can_load({**source, "gguf_file": None})


@pytest.fixture
def package_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed package holding a GGUF file, whose import would fail (as model packages' may)."""
    folder = tmp_path / "site" / "lp_test_model_pkg"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('importing me needs an optional dependency')\n")
    (folder / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield folder
    sys.modules.pop("lp_test_model_pkg", None)


def test_a_packaged_gguf_model_is_found_without_importing_its_package(package_dir: Path) -> None:
    source = {"name": "m", "kind": "gguf-package", "package": "lp_test_model_pkg", "gguf_file": "model.gguf"}
    assert can_load(source)
    assert "lp_test_model_pkg" not in sys.modules
    assert not can_load({**source, "gguf_file": "other.gguf"})
    assert not can_load({**source, "package": "lp_no_such_package"})
    assert not can_load({**source, "package": "lp_no_such_package.sub"})


def test_the_synthetic_model_always_loads_and_an_unknown_kind_never() -> None:
    assert can_load({"name": "tiny-random-llama", "kind": "tiny-random-llama"})
    assert not can_load({"name": "m", "kind": "onnx", "path": "/"})


def test_the_check_imports_no_torch() -> None:
    code = "import sys, worker.availability; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_availability_reads_the_published_registry_and_keeps_each_check_a_while(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    bus, clock, checks = FileBus(tmp_path / "bus.db"), Clock(), list[str]()

    def check(fields: Mapping[str, Any]) -> bool:
        checks.append(str(fields["name"]))
        return can_load(fields)

    availability = ModelAvailability(bus, ttl_s=10, clock=clock, check=check)
    assert availability.models() is None  # nothing published yet: the heartbeat does not say

    mounted = tmp_path / "mounted"
    registry = {"tiny-random-llama": {"name": "tiny-random-llama", "kind": "tiny-random-llama"},
                "here": {**hf(tiny_model_dir), "name": "here"}, "later": {**hf(mounted), "name": "later"}}
    bus.put(REGISTRY_KEY, {"models": registry})
    assert availability.models() == ["here", "tiny-random-llama"]
    assert sorted(checks) == ["here", "later", "tiny-random-llama"]

    copy_without(tiny_model_dir, mounted)  # the operator mounts the directory: seen once the checks expire
    clock.now = 5
    assert availability.models() == ["here", "tiny-random-llama"] and len(checks) == 3
    clock.now = 10
    assert availability.models() == ["here", "later", "tiny-random-llama"] and len(checks) == 6

    # An entry whose source changed is checked at once; a model no longer published is gone.
    bus.put(REGISTRY_KEY, {"models": {"here": {**hf(tmp_path / "moved"), "name": "here"}}})
    assert availability.models() == [] and checks[-1] == "here" and len(checks) == 7


def test_the_heartbeat_names_the_models_this_worker_can_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    bus = FileBus(tmp_path / "bus.db")
    availability = ModelAvailability(bus)
    beat = Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q"}, Incarnation(), models=availability.models)
    beat.beat()  # no registry yet: the beat says nothing of models (taken as every model)
    bus.put(REGISTRY_KEY, {"models": {"here": hf(tiny_model_dir), "gone": hf(tmp_path / "gone")}})
    beat.beat()
    messages = [m for _, m in bus.consume(SCHEDULER_STREAM, "g", "c", count=10, block_s=0)]
    assert "models" not in messages[0]
    assert messages[1]["models"] == ["here"]


def test_a_failing_check_does_not_silence_the_heartbeat(tmp_path: Path) -> None:
    bus = FileBus(tmp_path / "bus.db")

    def broken() -> list[str] | None:
        raise RuntimeError("disk on fire")

    Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q"}, Incarnation(), models=broken).beat()
    [(_, message)] = bus.consume(SCHEDULER_STREAM, "g", "c", count=10, block_s=0)
    assert message["type"] == "heartbeat" and "models" not in message
