"""The message bus between processes: durable-until-acked streams, one-shot claims, and a few small values
(`put`/`get`: the model registry the scheduler publishes for workers).

Two implementations of one small interface:
- ``RedisBus``: Redis streams with consumer groups (distributed mode).
- ``FileBus``: the same semantics in a SQLite file (embedded mode: no server to run).

What flows over it (typed in common/messages.py, where both ends build and read it) is never the source of truth.
Reports from workers are acknowledged only after the scheduler committed them to the database, so a crash between
the two replays them (ingest is idempotent).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from common.messages import Wake
from common.private_files import private_sqlite_file
from common.settings import get_settings

log = logging.getLogger(__name__)

SCHEDULER_STREAM = "scheduler"  # worker reports and API wake-ups, consumed by the scheduler daemon
SCHEDULER_GROUP = "scheduler"
STREAM_MAXLEN = 200_000
# A stream read by a consumer group (the scheduler's reports) is trimmed by its reader, up to what every group has
# acked (`RedisBus.ack`): its writers' cap only bounds an outage of the reader. At 256 workers sending two reports a
# second that is over half an hour without a scheduler; past it the oldest unread reports would be lost.
GROUP_STREAM_MAXLEN = 4_000_000
GROUP_STREAMS = (SCHEDULER_STREAM,)
TRIM_EVERY_S = 1.0  # how often a reader trims what was acked
# The key under which the scheduler publishes the model registry (`put`): name -> what a worker needs to load
# the model (common/registry.py, `published_registry`). Workers read it to say which models they can load.
REGISTRY_KEY = "model-registry"


# What a worker says of a back-fill its pack ended before admitting: not the trial's fault, so the scheduler
# requeues it without counting the attempt.
BACKFILL_NOT_JOINED = "the pack ended before it could join"


def commands_stream(worker_id: str) -> str:
    return f"commands:{worker_id}"


SAMPLERS_GROUP = "samplers"  # the workers' samplers share each model's sampling stream (worker/sampler.py)


def sampling_stream(model_name: str) -> str:
    """Sampling requests for one base model: any worker that loads it takes each once."""
    return f"sampling:{model_name}"


def sampling_reply_stream(request_id: str) -> str:
    """One sampling request's answer, in pieces; the API discards it once read."""
    return f"sampling-reply:{request_id}"


Message = tuple[str, dict[str, Any]]


class Bus(Protocol):
    resets: int  # how often the bus found its streams gone (an emptied Redis): commands sent before may be lost

    def publish(self, stream: str, message: dict[str, Any]) -> str: ...

    def consume(self, stream: str, group: str, consumer: str, count: int, block_s: float) -> list[Message]:
        """Messages not yet acked by `group`: first this consumer's unacked ones (redelivery after a
        crash), then new ones."""
        ...

    def ack(self, stream: str, group: str, ids: list[str]) -> None: ...

    def tail_id(self, stream: str) -> str:
        """The id of the newest message, for `read_after` to start from 'now'."""
        ...

    def read_after(self, stream: str, after_id: str, count: int, block_s: float) -> list[Message]: ...

    def claim(self, key: str) -> bool:
        """True exactly once per key across all processes (used to make dispatch idempotent)."""
        ...

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Stores a small JSON value under `key`, replacing what was there (the newest write wins)."""
        ...

    def get(self, key: str) -> dict[str, Any] | None:
        """The value last `put` under `key`; None if none was (or an emptied Redis forgot it)."""
        ...

    def discard(self, stream: str) -> None:
        """Deletes ``stream`` and its messages (a sampling answer, once read)."""
        ...

    def ping(self) -> bool: ...


def _stream_id(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


class RedisBus:
    """Survives Redis restarts and outages: every call retries a lost connection with a short backoff (under a
    second in all, then raises, so a caller can do its other work and try again later), and a consumer
    group that vanished with an emptied Redis is created again instead of failing with NOGROUP forever.
    `resets` counts those re-creations: what was sent before one may be gone (the daemon re-sends commands)."""

    def __init__(self, url: str, namespace: str) -> None:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self._redis = redis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=2, socket_keepalive=True, health_check_interval=10,
            socket_timeout=10,  # above any blocking read's `block_s`: a silent peer raises instead of hanging
            # Capped exponential backoff, ~0.75 s in all: a blip is ridden out, and a longer outage is left to the
            # callers (the scheduler's next round, a worker's outbox) so their own work goes on meanwhile.
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=4),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        self._ns = namespace
        self._groups: set[tuple[str, str]] = set()
        self._trimmed_at: dict[str, float] = {}  # stream -> when its acked messages were last trimmed (monotonic)
        self.resets = 0

    def _key(self, name: str) -> str:
        return f"{self._ns}:{name}"

    def publish(self, stream: str, message: dict[str, Any]) -> str:
        maxlen = GROUP_STREAM_MAXLEN if stream in GROUP_STREAMS else STREAM_MAXLEN
        return str(self._redis.xadd(self._key(stream), {"json": json.dumps(message)}, maxlen=maxlen,
                                    approximate=True))

    def _ensure_group(self, stream: str, group: str) -> None:
        if (stream, group) in self._groups:
            return
        import redis

        try:
            self._redis.xgroup_create(self._key(stream), group, id="0", mkstream=True)
        except redis.ResponseError as exc:  # BUSYGROUP: it already exists
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add((stream, group))

    @staticmethod
    def _decode(entries: Any) -> list[Message]:
        out: list[Message] = []
        for _stream, items in entries or []:
            for msg_id, fields in items:
                if fields:  # a pending entry trimmed away comes back with no fields
                    out.append((msg_id, json.loads(fields["json"])))
        return out

    def consume(self, stream: str, group: str, consumer: str, count: int, block_s: float) -> list[Message]:
        import redis

        try:
            return self._consume(stream, group, consumer, count, block_s)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis came back empty (restarted without persistence): its streams and groups are gone.
            log.warning("the bus lost consumer group %s of %s (Redis restarted empty?); creating it again",
                        group, stream)
            self._groups.discard((stream, group))
            self.resets += 1
            return self._consume(stream, group, consumer, count, block_s)

    def _consume(self, stream: str, group: str, consumer: str, count: int, block_s: float) -> list[Message]:
        self._ensure_group(stream, group)
        key = self._key(stream)
        pending = self._decode(self._redis.xreadgroup(group, consumer, {key: "0"}, count=count))
        if pending:
            return pending
        block_ms = max(1, int(block_s * 1000))
        return self._decode(self._redis.xreadgroup(group, consumer, {key: ">"}, count=count, block=block_ms))

    def ack(self, stream: str, group: str, ids: list[str]) -> None:
        # XACK of a group that no longer exists (an emptied Redis) acks nothing and raises nothing that
        # matters: those messages are gone anyway, and their effects were committed before the ack.
        if ids:
            self._redis.xack(self._key(stream), group, *ids)
            if time.monotonic() - self._trimmed_at.get(stream, 0.0) >= TRIM_EVERY_S:
                self._trimmed_at[stream] = time.monotonic()
                self._trim_acked(stream)

    def _trim_acked(self, stream: str) -> None:
        """Drops the messages every consumer group of ``stream`` has read and acked: those older than each group's
        oldest unacked message, or than the last one it was given where none is unacked. Never an unread one."""
        key = self._key(stream)
        floors = []
        for info in self._redis.xinfo_groups(key):
            oldest = self._redis.xpending(key, info["name"])["min"] if info["pending"] else None
            floors.append(oldest or info["last-delivered-id"])
        if floors:
            self._redis.xtrim(key, minid=min(floors, key=_stream_id), approximate=True)

    def tail_id(self, stream: str) -> str:
        last = self._redis.xrevrange(self._key(stream), count=1)
        return str(last[0][0]) if last else "0-0"

    def read_after(self, stream: str, after_id: str, count: int, block_s: float) -> list[Message]:
        block_ms = max(1, int(block_s * 1000))
        return self._decode(self._redis.xread({self._key(stream): after_id}, count=count, block=block_ms))

    def claim(self, key: str) -> bool:
        return bool(self._redis.set(self._key(f"claim:{key}"), "1", nx=True, ex=30 * 24 * 3600))

    def put(self, key: str, value: dict[str, Any]) -> None:
        self._redis.set(self._key(f"kv:{key}"), json.dumps(value))

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self._redis.get(self._key(f"kv:{key}"))
        return None if raw is None else dict(json.loads(raw))

    def discard(self, stream: str) -> None:
        self._redis.delete(self._key(stream))

    def ping(self) -> bool:
        return bool(self._redis.ping())


class FileBus:
    """Streams in one SQLite file; safe across processes (SQLite locking) and threads (one lock)."""

    POLL_S = 0.05
    resets = 0  # a file does not forget its streams

    def __init__(self, path: Path) -> None:
        private_sqlite_file(path)  # reports and commands name tenants' tasks: the owner's alone
        self._conn = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.executescript(
                """
                CREATE TABLE IF NOT EXISTS messages (
                    id INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, body TEXT NOT NULL);
                CREATE INDEX IF NOT EXISTS ix_messages_stream_id ON messages (stream, id);
                CREATE TABLE IF NOT EXISTS groups (
                    stream TEXT, grp TEXT, last_id INTEGER NOT NULL, PRIMARY KEY (stream, grp));
                CREATE TABLE IF NOT EXISTS pending (
                    stream TEXT, grp TEXT, consumer TEXT, msg_id INTEGER, PRIMARY KEY (stream, grp, msg_id));
                CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY);
                CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                """
            )

    def publish(self, stream: str, message: dict[str, Any]) -> str:
        with self._lock:
            cur = self._conn.execute(
                "INSERT INTO messages (stream, body) VALUES (?, ?)", (stream, json.dumps(message))
            )
            return str(cur.lastrowid)

    def _consume_once(self, stream: str, group: str, consumer: str, count: int) -> list[Message]:
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                rows = c.execute(
                    "SELECT m.id, m.body FROM pending p JOIN messages m ON m.id = p.msg_id "
                    "WHERE p.stream=? AND p.grp=? AND p.consumer=? ORDER BY m.id LIMIT ?",
                    (stream, group, consumer, count),
                ).fetchall()
                if not rows:
                    c.execute(
                        "INSERT OR IGNORE INTO groups (stream, grp, last_id) VALUES (?, ?, 0)", (stream, group)
                    )
                    (last,) = c.execute(
                        "SELECT last_id FROM groups WHERE stream=? AND grp=?", (stream, group)
                    ).fetchone()
                    rows = c.execute(
                        "SELECT id, body FROM messages WHERE stream=? AND id>? ORDER BY id LIMIT ?",
                        (stream, last, count),
                    ).fetchall()
                    if rows:
                        c.executemany(
                            "INSERT OR IGNORE INTO pending (stream, grp, consumer, msg_id) VALUES (?,?,?,?)",
                            [(stream, group, consumer, r[0]) for r in rows],
                        )
                        c.execute(
                            "UPDATE groups SET last_id=? WHERE stream=? AND grp=?", (rows[-1][0], stream, group)
                        )
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return [(str(i), json.loads(b)) for i, b in rows]

    def consume(self, stream: str, group: str, consumer: str, count: int, block_s: float) -> list[Message]:
        deadline = time.monotonic() + block_s
        while True:
            got = self._consume_once(stream, group, consumer, count)
            if got or time.monotonic() >= deadline:
                return got
            time.sleep(self.POLL_S)

    def ack(self, stream: str, group: str, ids: list[str]) -> None:
        if not ids:
            return
        with self._lock:
            self._conn.executemany(
                "DELETE FROM pending WHERE stream=? AND grp=? AND msg_id=?",
                [(stream, group, int(i)) for i in ids],
            )

    def tail_id(self, stream: str) -> str:
        with self._lock:
            row = self._conn.execute("SELECT MAX(id) FROM messages WHERE stream=?", (stream,)).fetchone()
        return str(row[0] or 0)

    def read_after(self, stream: str, after_id: str, count: int, block_s: float) -> list[Message]:
        deadline = time.monotonic() + block_s
        while True:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT id, body FROM messages WHERE stream=? AND id>? ORDER BY id LIMIT ?",
                    (stream, int(after_id), count),
                ).fetchall()
            if rows or time.monotonic() >= deadline:
                return [(str(i), json.loads(b)) for i, b in rows]
            time.sleep(self.POLL_S)

    def claim(self, key: str) -> bool:
        with self._lock:
            cur = self._conn.execute("INSERT OR IGNORE INTO claims (key) VALUES (?)", (key,))
            return cur.rowcount == 1

    def put(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def discard(self, stream: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM messages WHERE stream=?", (stream,))

    def ping(self) -> bool:
        with self._lock:
            self._conn.execute("SELECT 1")
        return True


@lru_cache
def get_bus() -> Bus:
    settings = get_settings()
    if settings.redis_url:
        return RedisBus(settings.redis_url, settings.namespace)
    return FileBus(settings.bus_path)


def wake_scheduler(reason: str, *, task_id: str | None = None, tenant_id: str | None = None) -> None:
    """Best effort: the scheduler also polls the database, so a lost wake-up only delays it."""
    try:
        get_bus().publish(SCHEDULER_STREAM, Wake(reason=reason, task_id=task_id, tenant_id=tenant_id).to_dict())
    except Exception:  # noqa: BLE001 - never fail a committed request because the bus is down
        log.warning("could not wake the scheduler (%s)", reason, exc_info=True)
