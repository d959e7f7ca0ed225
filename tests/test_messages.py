"""The messages between scheduler and worker (common/messages.py): each one read back as it was built, through JSON
as the bus and Celery carry it; one the reader cannot read (an unknown type or version, a field missing or of the
wrong type) is dropped with a reason, never raised; and on the worker's side a dropped command or pack is counted
and passed over while the next one is still read. The scheduler's side: tests/scheduler/test_dropped_reports.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.bus import FileBus, commands_stream
from common.messages import (
    COMMAND_TYPES,
    EXPORT_TYPES,
    MALFORMED,
    PACK_TYPES,
    REPORT_TYPES,
    SAMPLE_REPLY_TYPES,
    SAMPLE_TYPES,
    UNKNOWN_TYPE,
    UNKNOWN_VERSION,
    AbortPack,
    AdmitTrials,
    CheckpointSaved,
    ExportRequest,
    Message,
    ModelSourceFields,
    PackFailed,
    PackFinished,
    PackMessage,
    PackProfile,
    PackProgress,
    PackRefused,
    PackStarted,
    Point,
    Points,
    SampleReply,
    SampleRequest,
    StopTrials,
    TrialAdmitted,
    TrialCheckpoint,
    TrialCheckpointLost,
    TrialFinished,
    TrialPayload,
    TrialRejected,
    Wake,
    WorkerHeartbeat,
    parse_command,
    parse_export,
    parse_pack,
    parse_report,
    parse_sample_reply,
    parse_sample_request,
)
from common.telemetry import worker_metrics

TRIAL = TrialPayload(
    trial_id="trial-1", task_id="task-1", total_steps=20, max_seq_len=64, eval_interval=5,
    hyperparameters={"learning_rate": 1e-4, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "batch_size": 2,
                     "target_modules": "all-linear", "seed": 3},
    training_file_key="files/train.jsonl", validation_file_key="files/val.jsonl", validation_split=None, split_seed=7,
    training={"lr_schedule": "cosine"}, evaluation={"metric": "regex", "pattern": r"\d+", "max_new_tokens": 8},
    resume_key="checkpoints/t/4.tar", resume_step=4, extra_eval_steps=[2, 8], placed_at="2026-01-01T00:00:00+00:00",
)
PACK = {"pack_id": "pack-1", "worker_id": "w-1", "incarnation": "inc-1", "sent_at": 1_700_000_000.5}
POINTS = [Point("trial-1", 1, "train", 2.5), Point("trial-1", 2, "val", 2.25)]

EVERY_MESSAGE: list[Message] = [
    PackMessage(pack_id="pack-1", worker_id="w-1", trials=[TRIAL], capacity=4, max_rank=16, target_modules=["q_proj"],
                base_model=ModelSourceFields(name="m", kind="gguf", path="/models/m", gguf_file="m.gguf"),
                memory_bytes=3 << 30),
    AdmitTrials(pack_id="pack-1", trials=[TRIAL]),
    StopTrials(pack_id="pack-1", trial_ids=["trial-1", "trial-2"], mode="export"),
    AbortPack(pack_id="pack-1"),
    WorkerHeartbeat(worker_id="w-1", queue="q.w-1", device="cuda:0,cuda:1", memory_bytes=80 << 30, gpus=2,
                    max_slots=16, models=["m"], pack_id="pack-1", incarnation="inc-1", started_at=1.5, sent_at=2.5,
                    warm_models=[{"name": "m", "revision": "r", "bytes": 10, "last_used_at": 2.0}], max_packs=2,
                    packs=[{"pack_id": "pack-1", "progress": 3, "progressed_at": 2.0}], free_memory_bytes=70 << 30),
    Wake(reason="task.created", task_id="task-1"),
    PackStarted(**PACK),
    Points(**PACK, points=POINTS),
    TrialCheckpoint(**PACK, trial_id="trial-1", step=2, checkpoint_key="checkpoints/t/2.tar", points=POINTS),
    CheckpointSaved(**PACK, trial_id="trial-1", step=4, epoch=2.0, epoch_end=True, val_loss=1.25,
                    adapter_key="adapter-checkpoints/t/trial-1/step-000000004.tar", size_bytes=2048,
                    dropped_steps=[2]),
    TrialCheckpointLost(**PACK, trial_id="trial-1", checkpoint_key="checkpoints/t/2.tar"),
    TrialAdmitted(**PACK, trial_id="trial-1"),
    TrialRejected(**PACK, trial_id="trial-1", reason="its rank does not fit"),
    TrialFinished(**PACK, trial_id="trial-1", status="completed", steps_done=20, best_val_loss=1.5, best_step=10,
                  final_train_loss=1.25, adapter_key="adapters/t.tar.gz", pack_steps=20, pack_tokens=2560,
                  points=POINTS),
    PackProgress(**PACK, steps=20, step_s=0.125, tokens=512.0, slots=3.5),
    PackProfile(**PACK, profile={"device": "cpu", "steps": 20, "phases": {"wall_s": 3.0}}),
    PackFinished(**PACK),
    PackFailed(**PACK, error="OSError: the store is away"),
    PackRefused(**PACK, reason="its planned 3.00 GB do not fit"),
    ExportRequest(task_id="task-1", trial_id="trial-1", adapter_key="adapters/t.tar.gz",
                  base_model=ModelSourceFields(name="m", kind="hf", path="/models/m")),
    SampleRequest(request_id="cmpl-1", tenant_id="tenant-1", task_id="task-1", trial_id="trial-1",
                  adapter_key="adapters/t.tar.gz", base_model=ModelSourceFields(name="m", kind="hf", path="/models/m"),
                  messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0.7, top_p=0.9, seed=3,
                  stop=["\n"], stream=True, sent_at=1.5, deadline=301.5),
    SampleReply(request_id="cmpl-1", text="hello", done=True, finish_reason="stop", prompt_tokens=4,
                completion_tokens=2, queued_s=0.5, load_s=1.25, batch_requests=3),
    SampleReply(request_id="cmpl-2", done=True, status=422, error_code="context_length_exceeded",
                error_message="too long"),
]


def parse(raw: object, drops: list[str]) -> Message | None:
    """``raw`` read as the one reader of its kind reads it."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in PACK_TYPES:
        return parse_pack(raw, on_drop=drops.append)
    if kind in COMMAND_TYPES:
        return parse_command(raw, on_drop=drops.append)
    if kind in EXPORT_TYPES:
        return parse_export(raw, on_drop=drops.append)
    if kind in SAMPLE_TYPES:
        return parse_sample_request(raw, on_drop=drops.append)
    if kind in SAMPLE_REPLY_TYPES:
        return parse_sample_reply(raw, on_drop=drops.append)
    return parse_report(raw, on_drop=drops.append)


def over_the_wire(message: Message) -> dict[str, Any]:
    return dict(json.loads(json.dumps(message.to_dict())))


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: m.to_dict()["type"])
def test_every_message_reads_back_as_it_was_built(message: Message) -> None:
    drops: list[str] = []
    assert parse(over_the_wire(message), drops) == message and drops == []


def test_every_message_type_is_tested() -> None:
    tested = {m.to_dict()["type"] for m in EVERY_MESSAGE}
    assert tested == (set(PACK_TYPES) | set(COMMAND_TYPES) | set(REPORT_TYPES) | set(EXPORT_TYPES) | set(SAMPLE_TYPES)
                      | set(SAMPLE_REPLY_TYPES))


def test_the_wire_keeps_the_keys_sent_before_the_classes() -> None:
    """What a reader from before this module reads: the same keys, plus `version` (and `type` for a pack)."""
    beat = over_the_wire(WorkerHeartbeat(worker_id="w", queue="q", pack_id=None))
    assert "models" not in beat and "warm_models" not in beat and beat["pack_id"] is None  # "not said" vs "none"
    assert over_the_wire(AbortPack(pack_id="p")) == {"type": "abort_pack", "pack_id": "p", "version": 1}
    assert over_the_wire(Wake(reason="task.cancelled", task_id="t")) == {
        "type": "wake", "reason": "task.cancelled", "task_id": "t", "version": 1}
    pack = over_the_wire(EVERY_MESSAGE[0].model_copy(update={"memory_bytes": None}))
    assert set(pack) == {"type", "version", "pack_id", "worker_id", "base_model", "trials", "capacity", "max_rank",
                         "target_modules"}
    assert pack["trials"][0] == json.loads(json.dumps(TRIAL.model_dump()))
    assert over_the_wire(Points(**PACK, points=POINTS))["points"] == [["trial-1", 1, "train", 2.5],
                                                                      ["trial-1", 2, "val", 2.25]]


def test_a_message_from_before_the_version_field_is_of_version_1() -> None:
    drops: list[str] = []
    old_pack = {k: v for k, v in over_the_wire(EVERY_MESSAGE[0]).items() if k not in ("version", "type")}
    assert parse_pack(old_pack, on_drop=drops.append) == EVERY_MESSAGE[0]
    beat = parse_report({"type": "heartbeat", "worker_id": "w", "queue": "q"}, on_drop=drops.append)
    assert isinstance(beat, WorkerHeartbeat) and beat.version == 1 and not beat.names_pack and drops == []


def test_a_field_the_reader_does_not_know_is_left_out_and_one_the_builder_does_not_know_raises() -> None:
    drops: list[str] = []
    raw = {**AbortPack(pack_id="p").to_dict(), "reason": "a newer scheduler says why"}
    assert parse_command(raw, on_drop=drops.append) == AbortPack(pack_id="p") and drops == []
    with pytest.raises(ValueError, match="pack_idd"):
        AbortPack(pack_idd="p")  # type: ignore[call-arg]


@pytest.mark.parametrize(("raw", "reason"), [
    ({**AbortPack(pack_id="p").to_dict(), "version": 2}, UNKNOWN_VERSION),
    ({**AbortPack(pack_id="p").to_dict(), "version": "1"}, UNKNOWN_VERSION),
    ({**AbortPack(pack_id="p").to_dict(), "version": True}, UNKNOWN_VERSION),
    ({"type": "resize_pack", "pack_id": "p"}, UNKNOWN_TYPE),
    ({"pack_id": "p"}, UNKNOWN_TYPE),
    ({"type": "abort_pack"}, MALFORMED),  # a field missing
    ({"type": "abort_pack", "pack_id": 7}, MALFORMED),  # of the wrong type
    ({"type": "stop_trials", "pack_id": "p", "trial_ids": "t-1"}, MALFORMED),
    ({"type": "admit_trials", "pack_id": "p", "trials": [{"trial_id": "t"}]}, MALFORMED),  # a trial's fields missing
    (["abort_pack", "p"], MALFORMED),  # not an object
])
def test_a_command_that_cannot_be_read_is_dropped_with_its_reason(raw: object, reason: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    drops: list[str] = []
    assert parse_command(raw, on_drop=drops.append) is None
    assert drops == [reason] and "dropping a command" in caplog.text


@pytest.mark.parametrize(("raw", "reason"), [
    ({**PackFinished(**PACK).to_dict(), "version": 99}, UNKNOWN_VERSION),
    ({"type": "trial.finished", **PACK, "trial_id": "t"}, MALFORMED),  # no status
    ({"type": "points", **PACK, "points": [["t", "one", "train", 1.0]]}, MALFORMED),
    ({"type": "points", **PACK, "points": [["t", 1, "train"]]}, MALFORMED),
    ({"type": "pack.progress", **PACK, "step_s": 1.0, "tokens": 2.0}, MALFORMED),
    ({"type": "heartbeat", "worker_id": "w"}, MALFORMED),  # no queue: the scheduler could not send it a pack
    ({"type": "pack.finished", "worker_id": "w"}, MALFORMED),
])
def test_a_report_that_cannot_be_read_is_dropped_with_its_reason(raw: object, reason: str) -> None:
    drops: list[str] = []
    assert parse_report(raw, on_drop=drops.append) is None and drops == [reason]


def test_the_log_of_a_malformed_message_names_its_fields_not_their_values(caplog: pytest.LogCaptureFixture) -> None:
    raw = {"type": "points", **PACK, "points": [["secret-trial", "one", "train", 1.0]]}
    assert parse_report(raw, on_drop=lambda _: None) is None
    assert "points.0.1" in caplog.text and "secret-trial" not in caplog.text


def test_a_heartbeats_lenient_fields_do_not_drop_it() -> None:
    """gpus, models and warm_models are judged by ingest, which keeps the beat (it proves the worker alive)."""
    drops: list[str] = []
    raw = {"type": "heartbeat", "worker_id": "w", "queue": "q", "gpus": "two", "models": "m", "warm_models": 3}
    assert isinstance(parse_report(raw, on_drop=drops.append), WorkerHeartbeat) and drops == []


def dropped(reason: str) -> float:
    return float(worker_metrics().messages_dropped.labels(reason=reason)._value.get())


def test_the_worker_counts_a_command_it_cannot_read_and_reads_the_next(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from worker.bus_client import CommandInbox

    bus = FileBus(tmp_path / "bus.db")
    inbox = CommandInbox(bus, "w", poll_s=0)
    before = {reason: dropped(reason) for reason in (MALFORMED, UNKNOWN_VERSION)}
    stream = commands_stream("w")
    bus.publish(stream, {"type": "admit_trials", "pack_id": "p"})  # no trials
    bus.publish(stream, {**StopTrials(pack_id="p", trial_ids=["t-1"]).to_dict(), "version": 2})
    bus.publish(stream, AdmitTrials(pack_id="p", trials=[TRIAL]).to_dict())
    bus.publish(stream, AbortPack(pack_id="p").to_dict())
    assert inbox.aborted("p") and inbox.stopped_trials("p") == {}
    assert inbox.take_admissions("p", 5) == [TRIAL]
    assert dropped(MALFORMED) == before[MALFORMED] + 1 and dropped(UNKNOWN_VERSION) == before[UNKNOWN_VERSION] + 1
    assert "dropping a command" in caplog.text
    # Read once: the inbox has moved past them (a stream is read from where it was left), nothing is counted again.
    assert inbox.aborted("p") and dropped(MALFORMED) == before[MALFORMED] + 1


def test_the_worker_counts_a_pack_it_cannot_read_and_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.celery_app

    ran: list[PackMessage] = []

    class Runner:
        def run(self, pack: PackMessage) -> None:
            ran.append(pack)

    monkeypatch.setattr(worker.celery_app, "_runner", Runner())
    before = dropped(MALFORMED)
    good = EVERY_MESSAGE[0]
    assert isinstance(good, PackMessage)
    worker.celery_app.run_pack(pack={**good.to_dict(), "trials": "none"})
    assert ran == [] and dropped(MALFORMED) == before + 1
    worker.celery_app.run_pack(pack=good.to_dict())
    assert ran == [good]
