"""The step capture's settings (worker/engine/capture.py), read from the environment: no GPU needed."""

from __future__ import annotations

import pytest

from worker.engine.capture import MAX_GRAPHS, capture_mode, max_graphs


def test_the_graphs_kept_default_and_can_be_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLANE_STEP_GRAPHS", raising=False)
    assert max_graphs() == MAX_GRAPHS == 16
    monkeypatch.setenv("LORAPLANE_STEP_GRAPHS", " 64 ")
    assert max_graphs() == 64


@pytest.mark.parametrize("value", ["0", "-3", "1025", "many", "1.5"])
def test_a_graph_count_out_of_range_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("LORAPLANE_STEP_GRAPHS", value)
    with pytest.raises(ValueError, match="LORAPLANE_STEP_GRAPHS"):
        max_graphs()


def test_capture_mode_is_auto_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLANE_STEP_CAPTURE", raising=False)
    assert capture_mode() == "auto"
    monkeypatch.setenv("LORAPLANE_STEP_CAPTURE", "sometimes")
    with pytest.raises(ValueError, match="LORAPLANE_STEP_CAPTURE"):
        capture_mode()
