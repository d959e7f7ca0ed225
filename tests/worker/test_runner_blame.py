"""What a worker reports when something goes wrong decides who pays for it (scheduler/service/faults.py): a trial's
own data failing is that trial's failure, and the pack trains on without it; a checkpoint that cannot be unpacked
is a lost checkpoint (that trial starts again), not a failed pack; a store that cannot be read fails the pack (no
trial's doing: the scheduler charges the worker). Real packs of the tiny model on the CPU; the bus is a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.bus import SCHEDULER_STREAM
from common.messages import PackMessage
from tests.worker.test_runner import model_cache, pack, runner  # noqa: F401 - the fixtures
from worker.pack_runner import PackRunner


def reports(runner: PackRunner) -> list[dict[str, Any]]:  # noqa: F811 - the fixture's name
    return [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]


def two_trials(pack_id: str) -> PackMessage:
    body = pack(pack_id)
    first = body.trials[0]
    body.trials = [first, first.model_copy(update={"trial_id": f"{pack_id}-t1"})]
    return body


def outcome(messages: list[dict[str, Any]], trial_id: str) -> dict[str, Any]:
    (finished,) = [m for m in messages if m["type"] == "trial.finished" and m["trial_id"] == trial_id]
    return finished


def test_a_trial_whose_data_does_not_parse_fails_alone_and_the_pack_trains_on(runner: PackRunner) -> None:  # noqa: F811
    runner.store.put_bytes("files/broken.jsonl", b"{not json\n")
    body = two_trials("p-data")
    body.trials[1].training_file_key = "files/broken.jsonl"
    runner.run(body)
    messages = reports(runner)
    assert [m["type"] for m in messages if m["type"].startswith("pack.") and m["type"] != "pack.progress"][-1] \
        == "pack.finished"
    broken = outcome(messages, "p-data-t1")
    assert broken["status"] == "failed" and broken["steps_done"] == 0 and broken["error"], broken
    assert outcome(messages, "p-data-t0")["status"] == "completed"


def test_a_checkpoint_that_cannot_be_unpacked_is_a_lost_one(runner: PackRunner) -> None:  # noqa: F811
    runner.store.put_bytes("checkpoints/torn.tar", b"this is no tar archive")
    body = two_trials("p-ckpt")
    body.trials[1].resume_key = "checkpoints/torn.tar"
    runner.run(body)
    messages = reports(runner)
    lost = [m for m in messages if m["type"] == "trial.checkpoint_lost"]
    assert [(m["trial_id"], m["checkpoint_key"]) for m in lost] == [("p-ckpt-t1", "checkpoints/torn.tar")]
    assert outcome(messages, "p-ckpt-t1")["status"] == "completed"  # from step 0
    assert outcome(messages, "p-ckpt-t0")["status"] == "completed"
    assert messages[-1]["type"] == "pack.finished"


def test_a_store_that_cannot_be_read_fails_the_pack(runner: PackRunner, tmp_path: Path) -> None:  # noqa: F811
    body = two_trials("p-store")
    body.trials[1].training_file_key = "files/gone.jsonl"  # not in the store: an OSError
    runner.run(body)
    messages = reports(runner)
    assert not [m for m in messages if m["type"] == "trial.finished"]
    (failed,) = [m for m in messages if m["type"] == "pack.failed"]
    assert "FileNotFoundError" in failed["error"]
