"""What every benchmark result records beside its numbers (benchmarks/common.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import common


def test_a_result_records_the_settings_the_environment_changed_and_no_credential(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("LORAPLANE_LORA_BACKEND", "triton")
    monkeypatch.setenv("LORAPLANE_DATABASE_URL", "postgresql://user:secret@db/x")
    monkeypatch.setenv("LORAPLANE_API_TOKEN", "secret")
    monkeypatch.setenv("LORAPLANE_COMMIT", "abc1234")
    path = common.write_result("example", ["a"], [[1]], {"note": 2})
    record = json.loads(path.read_text())
    assert record["environment"]["LORAPLANE_LORA_BACKEND"] == "triton"
    assert not {"LORAPLANE_DATABASE_URL", "LORAPLANE_API_TOKEN", "LORAPLANE_COMMIT"} & set(record["environment"])
    assert record["commit"] == "abc1234"
    assert record["rows"] == [[1]] and record["note"] == 2
    assert "secret" not in path.read_text()
