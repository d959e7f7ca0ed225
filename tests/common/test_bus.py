"""Both bus implementations keep the same promises: at-least-once delivery until acked, ordered
read_after, a claim that succeeds exactly once, and put/get of small values (the newest wins)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.bus import Bus, FileBus, RedisBus
from tests.conftest import REDIS_URL


@pytest.fixture(params=["redis", "file"])
def bus(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bus]:
    if request.param == "redis":
        yield RedisBus(REDIS_URL, f"lp-bus-test-{uuid.uuid4().hex[:8]}")
    else:
        yield FileBus(tmp_path / "bus.db")


def test_consume_delivers_in_order_and_ack_removes(bus: Bus) -> None:
    for i in range(3):
        bus.publish("s", {"i": i})
    got = bus.consume("s", "g", "c1", count=10, block_s=0.1)
    assert [m["i"] for _, m in got] == [0, 1, 2]
    bus.ack("s", "g", [msg_id for msg_id, _ in got])
    assert bus.consume("s", "g", "c1", count=10, block_s=0.1) == []


def test_unacked_messages_are_redelivered_to_the_same_consumer(bus: Bus) -> None:
    bus.publish("s", {"i": 1})
    first = bus.consume("s", "g", "c1", count=10, block_s=0.1)
    # The consumer "crashed" before acking: on its next read it gets the same message again.
    again = bus.consume("s", "g", "c1", count=10, block_s=0.1)
    assert [m for _, m in again] == [m for _, m in first] == [{"i": 1}]
    bus.ack("s", "g", [again[0][0]])
    bus.publish("s", {"i": 2})
    assert [m for _, m in bus.consume("s", "g", "c1", count=10, block_s=0.1)] == [{"i": 2}]


def test_groups_are_independent(bus: Bus) -> None:
    bus.publish("s", {"i": 1})
    assert len(bus.consume("s", "g1", "c", count=10, block_s=0.1)) == 1
    assert len(bus.consume("s", "g2", "c", count=10, block_s=0.1)) == 1


def test_read_after_starts_from_tail(bus: Bus) -> None:
    bus.publish("cmd", {"old": True})
    tail = bus.tail_id("cmd")
    assert bus.read_after("cmd", tail, count=10, block_s=0) == []
    bus.publish("cmd", {"new": 1})
    bus.publish("cmd", {"new": 2})
    got = bus.read_after("cmd", tail, count=10, block_s=0.1)
    assert [m for _, m in got] == [{"new": 1}, {"new": 2}]
    assert bus.read_after("cmd", got[-1][0], count=10, block_s=0) == []


def test_claim_succeeds_once(bus: Bus) -> None:
    assert bus.claim("pack:1") is True
    assert bus.claim("pack:1") is False
    assert bus.claim("pack:2") is True


def test_file_bus_is_shared_between_instances(tmp_path: Path) -> None:
    # Two processes open the same file: one instance per process is the embedded mode's normal case.
    a, b = FileBus(tmp_path / "bus.db"), FileBus(tmp_path / "bus.db")
    a.publish("s", {"from": "a"})
    assert [m for _, m in b.consume("s", "g", "c", count=10, block_s=0.1)] == [{"from": "a"}]
    assert b.claim("k") and not a.claim("k")


def test_put_get_keeps_the_newest_value_of_each_key(bus: Bus) -> None:
    assert bus.get("registry") is None
    bus.put("registry", {"models": {"a": {"kind": "hf", "path": "/m/a"}}})
    bus.put("other", {"x": 1})
    bus.put("registry", {"models": {}})  # replaced, not merged
    assert bus.get("registry") == {"models": {}}
    assert bus.get("other") == {"x": 1}


def test_file_bus_values_are_shared_between_instances(tmp_path: Path) -> None:
    a, b = FileBus(tmp_path / "bus.db"), FileBus(tmp_path / "bus.db")
    a.put("k", {"v": [1, 2]})
    assert b.get("k") == {"v": [1, 2]}


def test_redis_streams_read_by_groups_are_trimmed_to_what_every_group_acked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's stream is trimmed by its reader, never past a message some group has not acked (the writers'
    cap alone trimmed unread reports once the scheduler fell behind: issue 53)."""
    import redis

    import common.bus

    monkeypatch.setattr(common.bus, "TRIM_EVERY_S", 0.0)
    namespace = f"lp-bus-test-{uuid.uuid4().hex[:8]}"
    bus, raw = RedisBus(REDIS_URL, namespace), redis.Redis.from_url(REDIS_URL)
    try:
        for i in range(3000):
            bus.publish("s", {"i": i})
        first = bus.consume("s", "slow", "c", count=1, block_s=0.1)  # a group that read one and acked none
        fast = bus.consume("s", "fast", "c", count=3000, block_s=0.1)
        bus.ack("s", "fast", [msg_id for msg_id, _ in fast])
        assert raw.xlen(f"{namespace}:s") == 3000  # "slow" acked nothing: all kept
        slow = first + bus.consume("s", "slow", "c", count=3000, block_s=0.1)  # its unacked one again
        assert [m["i"] for _, m in slow] == [0, 0]
        bus.ack("s", "slow", [first[0][0]])
        slow = first + bus.consume("s", "slow", "c", count=3000, block_s=0.1)
        assert [m["i"] for _, m in slow] == list(range(3000))
        bus.ack("s", "slow", [msg_id for msg_id, _ in slow[:2000]])  # acks the first 2000, holds the last 1000
        assert 1000 <= raw.xlen(f"{namespace}:s") < 3000
        again = bus.consume("s", "slow", "c", count=3000, block_s=0.1)  # what it holds comes back whole
        assert [m["i"] for _, m in again] == list(range(2000, 3000))
        bus.ack("s", "slow", [msg_id for msg_id, _ in again])
        assert raw.xlen(f"{namespace}:s") < 1000
    finally:
        raw.delete(*raw.keys(f"{namespace}:*"))
