"""Hollow workers (worker/hollow/, issue 53): the hollow engine against `train_pack`'s contract (stops, back-fills,
checkpoints and resume, validation and adapter-checkpoint steps the same as the real slots'), the replayed curves, the
step time from the planner's cost model under a time scale, and a hollow worker's real `PackRunner` end to end on a
file bus. No server, no model, no device."""

from __future__ import annotations

import json
import math
import statistics
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from common.artifacts import LocalArtifactStore
from common.bus import SCHEDULER_STREAM, FileBus
from common.messages import ModelSourceFields, PackMessage, TrialPayload
from scheduler.planning.cost import PRIOR_COST
from worker.drain import DrainFlag
from worker.engine import PackCallbacks, PackConfig, StepStats, TrialOutcome, TrialSpec
from worker.engine.export import read_peft_adapter
from worker.engine.slots import SlotState
from worker.engine.spec import AdapterCheckpoint
from worker.engine.trainer import StopMode
from worker.heartbeat import Heartbeat, Incarnation
from worker.hollow.curves import Curve, Library, load_library, pick_curve, train_loss, val_loss
from worker.hollow.engine import CHECKPOINT_FILE, HOLLOW_MARKER, HollowBase, HollowEngine, HollowSlot
from worker.hollow.runner import HollowModels, hollow_runner
from worker.hollow.timing import TimingModel

ROWS = [{"prompt": f"{i} plus {i} is", "completion": f" {2 * i}"} for i in range(10)]


def spec(trial_id: str, *, steps: int = 12, lr: float = 1e-3, rank: int = 4, batch: int = 4, eval_interval: int = 4,
         **extra: Any) -> TrialSpec:
    return TrialSpec(trial_id=trial_id, learning_rate=lr, lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0,
                     batch_size=batch, target_modules=["q_proj"], seed=7, max_steps=steps, max_seq_len=64,
                     eval_interval=eval_interval, train_rows=ROWS, val_rows=ROWS[:3], **extra)


class Recorder:
    """Every callback of a pack, in order, and the stops / back-fills a test hands it."""

    def __init__(self, stops: Mapping[int, dict[str, StopMode]] | None = None,
                 backfills: Mapping[int, list[tuple[TrialSpec, Path | None]]] | None = None) -> None:
        self.stops = dict(stops or {})
        self.backfills = dict(backfills or {})
        self.points: list[tuple[str, int, str, float]] = []
        self.events: list[tuple[str, str, int | None]] = []  # (kind, trial, step)
        self.steps: list[StepStats] = []
        self.checkpoints: dict[str, Path] = {}
        self.admitted: list[tuple[str, str | None]] = []
        self.saved: list[AdapterCheckpoint] = []

    def callbacks(self) -> PackCallbacks:
        return PackCallbacks(
            on_point=lambda t, s, split, v: self.points.append((t, s, split, v)),
            should_stop=lambda: self.stops.pop(len(self.steps), {}), on_step=self.steps.append,
            on_checkpoint=self.checkpoint, admissions=self.admissions,
            on_admitted=lambda t, r: self.admitted.append((t, r)), on_outcome=self.outcome,
            on_adapter_checkpoint=self.saved.append)

    def checkpoint(self, trial_id: str, step: int, path: Path) -> None:
        self.events.append(("checkpoint", trial_id, step))
        self.checkpoints[trial_id] = path

    def outcome(self, outcome: TrialOutcome) -> None:
        self.events.append((outcome.status, outcome.trial_id, outcome.steps_done))

    def admissions(self, free: int) -> list[tuple[TrialSpec, Path | None]]:
        return self.backfills.pop(len(self.steps), [])[:free]

    def steps_of(self, trial_id: str, split: str) -> list[int]:
        return [s for t, s, sp, _ in self.points if t == trial_id and sp == split]


@pytest.fixture(scope="module")
def library() -> Library:
    return load_library()


def engine(library: Library, time_scale: float = 1e6, noise: float = 0.0,
           sleeps: list[float] | None = None) -> HollowEngine:
    return HollowEngine(library, TimingModel(time_scale, noise),
                        sleep=(sleeps.append if sleeps is not None else lambda s: None))


def config(tmp_path: Path, **extra: Any) -> PackConfig:
    return PackConfig(base_model_name="smollm2-135m-instruct", export_dir=tmp_path / "adapters",
                      checkpoint_dir=tmp_path / "checkpoints", **extra)


def run(library: Library, tmp_path: Path, trials: list[TrialSpec], recorder: Recorder,
        resume: dict[str, Path] | None = None, **extra: Any) -> list[TrialOutcome]:
    return engine(library).train_pack(HollowBase("smollm2-135m-instruct"), None, trials, config(tmp_path, **extra),
                                      recorder.callbacks(), resume=resume)


def test_every_step_reports_once_and_validations_fall_where_the_real_slots_put_them(library: Library,
                                                                                  tmp_path: Path) -> None:
    trials = [spec("a", steps=12, extra_eval_steps=(1,)), spec("b", steps=9, eval_interval=5, batch=2)]
    r = Recorder()
    outcomes = run(library, tmp_path, trials, r)
    assert [(o.trial_id, o.status, o.steps_done) for o in outcomes] == [("a", "completed", 12), ("b", "completed", 9)]
    for t in trials:
        assert r.steps_of(t.trial_id, "train") == list(range(1, t.max_steps + 1))
        real = real_slot(t)
        expected = []
        for step in range(1, t.max_steps + 1):
            real.steps_done = step
            expected += [step] if real.eval_due else []
        assert r.steps_of(t.trial_id, "val") == expected
    a = outcomes[0]
    vals = {s: v for t, s, sp, v in r.points if t == "a" and sp == "val"}
    assert a.best_val_loss == min(vals.values()) and vals[a.best_step or 0] == a.best_val_loss
    assert a.pack_steps == 12 and a.pack_tokens == 12 * 4 * 64
    assert len(r.steps) == 12 and [s.active_slots for s in r.steps] == [2] * 9 + [1] * 3


def real_slot(t: TrialSpec) -> SlotState:
    """The real engine's slot state of ``t`` with placeholder rows: what its eval and checkpoint rules read."""
    return SlotState(spec=t, paths=[], train=cast(list[Any], list(t.train_rows)), val=cast(list[Any], t.val_rows),
                     sampler=cast(Any, None), dropout_seed=0)


@pytest.mark.parametrize(("steps", "batch"), [(12, 4), (60, 1), (7, 16)])
def test_adapter_checkpoints_fall_where_the_real_slots_put_them(steps: int, batch: int, library: Library,
                                                                tmp_path: Path) -> None:
    t = spec("a", steps=steps, batch=batch, adapter_checkpoints=True)
    hollow = HollowSlot(t, cast(Curve, None), 0)
    real = real_slot(t)
    for step in range(1, steps + 1):
        hollow.steps_done = real.steps_done = step
        assert (hollow.adapter_checkpoint_due, hollow.eval_due, hollow.steps_per_epoch) == (
            real.adapter_checkpoint_due, real.eval_due, real.steps_per_epoch), step
    r = Recorder()
    run(library, tmp_path, [t], r)
    assert r.saved and r.saved[-1].step == steps and all(HOLLOW_MARKER in json.loads(
        bytes(s.files.files["adapter_config.json"][0])) for s in r.saved)


def test_a_hollow_adapter_is_marked_and_never_loads_as_a_trained_one(library: Library, tmp_path: Path) -> None:
    r = Recorder()
    outcome, = run(library, tmp_path, [spec("a", steps=4)], r)
    assert outcome.adapter_dir is not None
    assert sorted(p.name for p in outcome.adapter_dir.iterdir()) == ["HOLLOW.md", "adapter_config.json"]
    config_json = json.loads((outcome.adapter_dir / "adapter_config.json").read_text())
    assert config_json[HOLLOW_MARKER] is True and "peft_type" not in config_json
    assert config_json["replayed_curve"].startswith(("arithmetic-", "trivia-"))
    with pytest.raises(Exception):  # noqa: B017,PT011 - whatever PEFT's reader raises: there are no weights
        read_peft_adapter(outcome.adapter_dir)


def test_stops_pause_export_and_drop_as_the_real_engine_does(library: Library, tmp_path: Path) -> None:
    r = Recorder(stops={3: {"a": "pause", "b": "export", "c": "drop"}})
    outcomes = run(library, tmp_path, [spec("a"), spec("b"), spec("c"), spec("d", steps=5)], r,
                   checkpoint_interval_s=None)
    ends = {o.trial_id: (o.status, o.steps_done, o.adapter_dir is not None) for o in outcomes}
    assert ends == {"a": ("paused", 3, False), "b": ("stopped", 3, True), "c": ("stopped", 3, False),
                    "d": ("completed", 5, True)}
    # The pause's checkpoint is persisted and handed over before the paused outcome; none periodic (interval None).
    assert [e for e in r.events if e[1] == "a"] == [("checkpoint", "a", 3), ("paused", "a", 3)]
    assert r.steps_of("a", "train") == [1, 2, 3]


def test_a_paused_trial_resumes_from_its_checkpoint_with_the_losses_of_an_uninterrupted_run(
    library: Library, tmp_path: Path
) -> None:
    whole = Recorder()
    run(library, tmp_path / "whole", [spec("a")], whole)
    first = Recorder(stops={5: {"a": "pause"}})
    run(library, tmp_path / "first", [spec("a")], first)
    state = json.loads((first.checkpoints["a"] / CHECKPOINT_FILE).read_text())
    assert state[HOLLOW_MARKER] is True and state["step"] == 5
    second = Recorder()
    outcome, = run(library, tmp_path / "second", [spec("a")], second, resume={"a": first.checkpoints["a"]})
    assert (outcome.status, outcome.steps_done, outcome.pack_steps) == ("completed", 12, 7)
    assert first.points + second.points == whole.points  # every point once, the same values
    assert outcome.best_val_loss == min(v for _, _, sp, v in whole.points if sp == "val")


def test_a_real_workers_checkpoint_fails_the_trial_alone(library: Library, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "adapter_model.safetensors").write_bytes(b"...")
    r = Recorder()
    outcomes = run(library, tmp_path, [spec("a"), spec("b", steps=2)], r, resume={"a": real})
    assert [(o.trial_id, o.status) for o in outcomes] == [("a", "failed"), ("b", "completed")]
    assert "not a hollow worker's checkpoint" in (outcomes[0].error or "")


def test_back_fills_join_free_slots_and_are_refused_as_the_real_engine_refuses_them(library: Library,
                                                                                    tmp_path: Path) -> None:
    late, twin, wide = spec("late", steps=4), spec("a"), spec("wide", rank=64)
    r = Recorder(backfills={2: [(late, None)], 3: [(twin, None), (wide, None)]})
    outcomes = run(library, tmp_path, [spec("a", steps=6)], r, capacity=4)
    assert r.admitted == [("late", None), ("a", "ValueError: trial a is already in this pack"),
                          ("wide", "ValueError: rank 64 is above the pack's 4")]
    assert [(o.trial_id, o.status, o.steps_done) for o in outcomes] == [("a", "completed", 6), ("late", "completed", 4)]
    assert r.steps_of("late", "train") == [1, 2, 3, 4] and r.steps[2].active_slots == 2


def test_a_full_pack_is_asked_for_no_back_fill(library: Library, tmp_path: Path) -> None:
    asked: list[int] = []

    def admissions(free: int) -> list[tuple[TrialSpec, Path | None]]:
        asked.append(free)
        return []

    calls = PackCallbacks(on_point=lambda *a: None, admissions=admissions)
    engine(library).train_pack(HollowBase("m"), None, [spec("a", steps=3)], config(tmp_path, capacity=2), calls)
    assert asked == [1, 1, 1, 2]  # before each step, and once the trial ended; never with no free slot
    asked.clear()
    engine(library).train_pack(HollowBase("m"), None, [spec("a", steps=3)], config(tmp_path), calls)
    assert asked == [1]  # capacity 1: full until the trial ended


def test_steps_take_the_planners_cost_model_time_compressed_by_the_time_scale(library: Library,
                                                                                tmp_path: Path) -> None:
    sleeps: list[float] = []
    r = Recorder()
    hollow = engine(library, time_scale=10.0, sleeps=sleeps)
    trials = [spec("a", steps=3, batch=4), spec("b", steps=3, batch=2)]
    hollow.train_pack(HollowBase("smollm2-135m-instruct"), None, trials, config(tmp_path), r.callbacks())
    predicted = PRIOR_COST.step.predict(4 * 64 + 2 * 64, 2)  # the planner's prior: tokens = batch x max_seq_len
    assert [s.seconds for s in r.steps] == pytest.approx([predicted] * 3)
    assert [s.tokens for s in r.steps] == [6 * 64] * 3
    assert len(sleeps) == 3 and all(predicted / 10 - 0.01 <= s <= predicted / 10 for s in sleeps)


def test_noise_spreads_step_times_around_the_prediction(library: Library, tmp_path: Path) -> None:
    r = Recorder()
    engine(library, noise=0.1).train_pack(HollowBase("m"), None, [spec("a", steps=400)], config(tmp_path),
                                          r.callbacks())
    predicted = PRIOR_COST.step.predict(4 * 64, 1)
    ratios = [s.seconds / predicted for s in r.steps]
    assert 0.97 < statistics.mean(ratios) < 1.03 and 0.07 < statistics.stdev(ratios) < 0.13


def test_a_trial_replays_its_nearest_recorded_configuration_stretched_to_its_steps(library: Library) -> None:
    curve = pick_curve(library, data=0, seed=0, learning_rate=1.1e-3, lora_rank=16, batch_size=8)
    assert (curve.learning_rate, curve.lora_rank, curve.batch_size) == (1e-3, 16, 8)
    assert curve.source.startswith(sorted(library.groups)[0])
    total = 50
    assert train_loss(curve, total, total) == curve.train[-1]
    assert train_loss(curve, total // 2, total) == curve.train[curve.total_steps // 2 - 1]
    (s0, v0), (s1, v1) = curve.val[-2], curve.val[-1]
    assert val_loss(curve, 1, 10_000) == curve.val[0][1] and val_loss(curve, total, total) == v1
    # Twice the curve's steps: the trial's step s0 + s1 falls halfway between the two recorded validations.
    assert val_loss(curve, s0 + s1, 2 * curve.total_steps) == pytest.approx((v0 + v1) / 2)
    # A task's trials replay one dataset's sweep (their rows), their seeds pick its repeats.
    picks = {pick_curve(library, data=1, seed=s, learning_rate=1e-3, lora_rank=4, batch_size=4).source.split("-full")[0]
             for s in range(8)}
    assert len(picks) == 1
    assert all(math.isfinite(v) for v in curve.train)


def test_a_hollow_runner_runs_a_pack_message_through_the_real_shell(library: Library, tmp_path: Path) -> None:
    bus = FileBus(tmp_path / "bus.db")
    store = LocalArtifactStore(tmp_path / "artifacts")
    store.put_bytes("files/data.jsonl", "\n".join(json.dumps(r) for r in ROWS).encode())
    heartbeat = Heartbeat(bus, 1.0, {"worker_id": "h-0", "queue": "q"}, Incarnation())
    runner = hollow_runner(worker_id="h-0", bus=bus, store=store, heartbeat=heartbeat, engine=engine(library),
                           memory_bytes=141 * 10**9, max_packs=2, drain=DrainFlag(), report_timeout_s=5.0,
                           model_cache_dir=tmp_path / "models", device="hollow:H200")
    trial = TrialPayload(trial_id="t0", task_id="task", total_steps=6, max_seq_len=64, eval_interval=3,
                         hyperparameters={"learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                          "batch_size": 2, "target_modules": ["q_proj"], "seed": 0},
                         training_file_key="files/data.jsonl", validation_split=0.2, split_seed=0, training={})
    # A GGUF model this machine does not have: a hollow worker reads no model file.
    source = ModelSourceFields(name="absent", kind="gguf", path="/nowhere", gguf_file="x.gguf")
    runner.run(PackMessage(pack_id="p1", worker_id="h-0", base_model=source, trials=[trial]))
    messages = [m for _, m in bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "pack.started" and kinds[-1] == "pack.finished", kinds
    finished = next(m for m in messages if m["type"] == "trial.finished")
    assert finished["status"] == "completed" and finished["steps_done"] == 6
    profile = next(m for m in messages if m["type"] == "pack.profile")["profile"]
    assert profile["device"] == "hollow:H200" and profile[HOLLOW_MARKER]["departures"]
    with store.open(finished["adapter_key"]) as f, tarfile.open(fileobj=f, mode="r:*") as tar:
        assert sorted(tar.getnames()) == ["HOLLOW.md", "adapter_config.json"]
    assert runner.models.warm()[0]["name"] == "absent"


def test_hollow_models_load_nothing_and_keep_the_last_two_warm() -> None:
    from worker.model_cache import model_source

    models = HollowModels()
    for name in ("a", "b", "a", "c"):
        loaded = models.get(model_source({"name": name, "kind": "hf", "path": "/nowhere"}))
        assert isinstance(loaded.model, HollowBase) and loaded.load_s == 0.0
    assert [w["name"] for w in models.warm()] == ["c", "a"]
