"""Checkpoints that never stall training (issue 30), on the CPU with the real tiny model: a snapshot holds the slot as
it was when taken and restores bit-identically; a store that blocks costs checkpoints, not steps (newer snapshots
supersede the waiting ones); a worker killed between a snapshot and its write resumes from the last persisted
checkpoint and continues exactly. Every wait is on an Event or on progress, never a sleep."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.conftest import MODEL_CACHE
from tests.engine.factories import TINY, Persisted, make_spec, pack_arguments
from worker.engine import PackEngine, TrialOutcome, TrialSpec, load_base_model, restore_base_model, train_pack
from worker.engine import checkpoint as checkpoints
from worker.engine.store import ModuleTensors
from worker.engine.trainer import PackTimings, StopMode
from worker.engine.validation import evaluate

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]
Point = tuple[str, int, str, float]


@pytest.fixture(scope="module")
def _tiny_module() -> Tiny:
    return load_base_model(TINY, cache_dir=MODEL_CACHE, device=torch.device("cpu"))


@pytest.fixture
def tiny(_tiny_module: Tiny) -> Iterator[Tiny]:
    yield _tiny_module
    restore_base_model(_tiny_module[0])


def _matrices(engine: PackEngine, slot: int) -> dict[str, ModuleTensors]:
    store, optimizer = engine.store, engine.optimizer
    return {"adapter": store.read(store.weights, slot), "exp_avg": store.read(optimizer.exp_avg, slot),
            "exp_avg_sq": store.read(optimizer.exp_avg_sq, slot)}


def _assert_equal(got: dict[str, ModuleTensors], want: dict[str, ModuleTensors]) -> None:
    assert got.keys() == want.keys()
    for kind in want:
        assert got[kind].keys() == want[kind].keys(), kind
        for path, (a, b) in want[kind].items():
            assert torch.equal(got[kind][path][0], a) and torch.equal(got[kind][path][1], b), (kind, path)


def test_a_snapshot_holds_the_slot_as_taken_and_restores_bit_identically(tiny: Tiny, tmp_path: Path) -> None:
    spec = make_spec("s", target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.1, max_steps=20)
    with PackEngine(*tiny, capacity=2, max_rank=8, target_modules=["all-linear", "lm_head"]) as engine:
        slot = engine.admit(spec)
        for _ in range(3):
            engine.step()
        evaluate(engine, slot)  # a best adapter to carry
        engine.step()
        state = engine.state(slot)
        want = _matrices(engine, slot) | {"best": state.best}
        want_cursor, want_steps = state.sampler.state(), engine.optimizer.steps[slot]
        snapshot = checkpoints.snapshot_slot(slot=slot, state=state, store=engine.store, optimizer=engine.optimizer)
        for _ in range(3):  # training goes on before the writer gets to it: the snapshot does not move
            engine.step()
        moved = engine.store.read(engine.store.weights, slot)
        assert any(not torch.equal(moved[path][0], a) for path, (a, _) in want["adapter"].items())
        directory = snapshot.write(tmp_path / "s")
    assert (snapshot.trial_id, snapshot.step) == ("s", 4)
    with PackEngine(*tiny, capacity=2, max_rank=8, target_modules=["all-linear", "lm_head"]) as engine:
        engine.admit(make_spec("other", seed=5))  # the resumed trial lands in another slot: layout-independent
        slot = engine.admit(spec, resume=directory)
        state = engine.state(slot)
        assert slot == 1 and state.steps_done == 4 and engine.optimizer.steps[slot] == want_steps
        _assert_equal(_matrices(engine, slot) | {"best": state.best}, want)
        cursor = state.sampler.state()
        assert torch.equal(cursor[0], want_cursor[0]) and cursor[1] == want_cursor[1]


def _run(tiny: Tiny, out: Path, **kwargs: Any) -> tuple[TrialOutcome, list[Point]]:
    points: list[Point] = []
    on_point = kwargs.pop("on_point", None)

    def record(*point: Any) -> None:
        points.append(point)
        if on_point is not None:
            on_point(*point)

    config, callbacks, rest = pack_arguments(base_model_name="tiny", export_dir=out, on_point=record, **kwargs)
    (outcome,) = train_pack(*tiny, [make_spec("k", max_steps=12, lora_dropout=0.1)], config, callbacks, **rest)
    return outcome, points


def test_a_blocked_store_costs_checkpoints_not_steps_and_a_kill_resumes_from_the_last_persisted(
        tiny: Tiny, tmp_path: Path) -> None:
    """The store's first write blocks (on an Event) while the trial trains on, snapshotting at every step: steps go on,
    the waiting snapshots supersede one another, and the newest ones die unwritten with the "killed" pack (its trial
    dropped at step 9). A new pack resumes from the one checkpoint persisted and ends exactly as uninterrupted."""
    straight, straight_points = _run(tiny, tmp_path / "straight")
    persisted, writing, release = Persisted(tmp_path / "kept"), threading.Event(), threading.Event()
    steps_while_blocked: list[int] = []

    def slow_store(trial_id: str, step: int, path: Path) -> None:
        persisted(trial_id, step, path)
        writing.set()
        assert release.wait(60)  # the artifact store hangs

    def on_point(trial_id: str, step: int, split: str, value: float) -> None:
        if split != "train":
            return
        if step == 4:
            assert writing.wait(60)  # one of steps 1-3 is being written from here on
        if step >= 4 and not release.is_set():
            steps_while_blocked.append(step)

    def kill() -> dict[str, StopMode]:
        return {"k": "drop"} if steps_while_blocked[-1:] == [9] else {}

    def after_the_kill(free: int) -> list[tuple[TrialSpec, Path | None]]:
        release.set()  # asked once the trial left its slot: what was not written by then never is
        return []

    timings = PackTimings()
    killed, _ = _run(tiny, tmp_path / "killed", on_point=on_point, should_stop=kill, admissions=after_the_kill,
                     timings=timings, checkpoint_dir=tmp_path / "ckpt", checkpoint_interval_s=0,
                     on_checkpoint=slow_store)
    assert (killed.status, killed.steps_done) == ("stopped", 9)
    assert steps_while_blocked == [4, 5, 6, 7, 8, 9]  # the steps went on while the store was blocked
    (first,) = persisted.steps["k"]  # newer snapshots (up to step 9) were taken but never written
    assert 1 <= first <= 3
    counts = timings.snapshots
    assert (counts.offered, counts.done, counts.dropped) == (9, 1, 8)

    resumed, resumed_points = _run(tiny, tmp_path / "resumed", resume={"k": tmp_path / "kept" / "k" / str(first)})
    assert resumed_points == [p for p in straight_points if p[1] > first]  # exactly the uninterrupted losses
    assert (resumed.steps_done, resumed.best_val_loss, resumed.best_step, resumed.final_train_loss) == (
        straight.steps_done, straight.best_val_loss, straight.best_step, straight.final_train_loss)
    assert resumed.adapter_dir is not None and straight.adapter_dir is not None
    weights = load_file(str(straight.adapter_dir / "adapter_model.safetensors"))
    again = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)


def test_a_pause_is_persisted_before_its_outcome_and_no_step_waits_for_a_round(tiny: Tiny, tmp_path: Path) -> None:
    """With no periodic snapshots (interval None) only the pause is checkpointed, at the step it left, and its
    outcome is reported after the write; a long interval takes no snapshot in a short pack."""
    events: list[tuple[str, int | str]] = []

    def pause_at_5() -> dict[str, StopMode]:
        return {"k": "pause"} if any(e == ("train", 5) for e in events) else {}

    outcome, _ = _run(tiny, tmp_path / "paused", checkpoint_dir=tmp_path / "ckpt", should_stop=pause_at_5,
                      on_point=lambda t, step, split, v: events.append((split, step)),
                      on_checkpoint=lambda t, step, path: events.append(("checkpoint", step)),
                      on_outcome=lambda o: events.append(("outcome", o.status)))
    assert (outcome.status, outcome.steps_done) == ("paused", 5)
    assert [e for e in events if e[0] in ("checkpoint", "outcome")] == [("checkpoint", 5), ("outcome", "paused")]

    timings, checkpointed = PackTimings(), []
    _run(tiny, tmp_path / "long", checkpoint_dir=tmp_path / "ckpt2", checkpoint_interval_s=3600.0, timings=timings,
         on_checkpoint=lambda t, step, path: checkpointed.append(step))
    assert checkpointed == [] and timings.snapshots.offered == 0 and timings.snapshot_s == 0.0
