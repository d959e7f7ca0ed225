"""Whether an export build that was asked for is still under way (pure; the API asks, worker/exports.py builds).

A build travels as a Celery message that is acknowledged on receipt (common/celery.py): a worker killed while it
builds takes the build with it, and no broker gives it back. Late acknowledgement would not help within a minute
or so: the Redis transport redelivers an unacknowledged message only after its visibility timeout (an hour by
default, and lowering it re-sends every build that merely runs long), and the embedded mode's filesystem transport
never redelivers. So the build is tracked the way packs are, by the worker process that runs it:

- the API records each request it sends (`BuildRequest`, the export's `requested` marker: a new `request_id` per
  send, and why it was sent again, if it was);
- the worker that takes it records itself (`BuildClaim`, the `claimed` marker: the request's id, its worker id and
  the incarnation of its process, the one its heartbeats carry) before it starts;
- each poll of the export compares the claim with what the scheduler last heard of that worker (`WorkerSeen`, its
  `workers` row) and sends the build again once its process is gone (`lost_reason`): another process beats under
  its id (it was restarted), or its beats stopped while other workers' still arrive.

A build no worker has claimed yet waits in the queue (behind a long pack, or for a worker to start) and is sent again
only after `UNCLAIMED_RESEND_S`: a message lost before any worker recorded it (a worker killed between taking it and
its claim, a broker emptied) is rare, and sending every waiting build again would stack duplicate merges.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass

# A build asked for this long ago that no worker has claimed (nor stored, nor failed) is asked for again.
UNCLAIMED_RESEND_S = 900.0

# Why a build was sent again (`BuildRequest.resent`), as the 202 names it.
WORKER_RESTARTED = "worker_restarted"
WORKER_SILENT = "worker_silent"
NEVER_CLAIMED = "never_claimed"


@dataclass(frozen=True)
class BuildRequest:
    """The API's `requested` marker: when it last sent the build, under which id, and, when that send was a re-send,
    why (one of the reasons above) and the worker it was lost with."""

    at: float
    request_id: str
    resent: str | None = None
    lost_worker: str | None = None

    @staticmethod
    def new(now: float, *, resent: str | None = None, lost_worker: str | None = None) -> BuildRequest:
        return BuildRequest(at=now, request_id=uuid.uuid4().hex, resent=resent, lost_worker=lost_worker)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_json(raw: bytes) -> BuildRequest | None:
        """The marker; None for one that cannot be read (then it is sent again). A marker written before request ids
        has only ``at``: its request id is empty, which no claim names."""
        try:
            data = json.loads(raw)
            return BuildRequest(at=float(data["at"]), request_id=str(data.get("request_id") or ""),
                                resent=_optional_str(data.get("resent")),
                                lost_worker=_optional_str(data.get("lost_worker")))
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class BuildClaim:
    """The worker's `claimed` marker, written before it builds: the request it took, its worker id and process
    (incarnation id and start, Unix seconds), and when it took it."""

    request_id: str
    worker_id: str
    incarnation: str
    started_at: float
    at: float

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_json(raw: bytes) -> BuildClaim | None:
        try:
            data = json.loads(raw)
            return BuildClaim(request_id=str(data["request_id"]), worker_id=str(data["worker_id"]),
                              incarnation=str(data["incarnation"]), started_at=float(data["started_at"]),
                              at=float(data["at"]))
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class WorkerSeen:
    """What the scheduler last heard of a worker id (its `workers` row): the process beating under it and when that
    started, its newest beat's time (Unix seconds) and whether it counts it alive."""

    incarnation: str | None
    incarnation_started_at: float | None
    last_heartbeat: float
    alive: bool


def lost_reason(claim: BuildClaim, worker: WorkerSeen | None, *, newest_beat: float | None, now: float,
                timeout_s: float) -> str | None:
    """Why the process that claimed the build can no longer finish it (`WORKER_RESTARTED`, `WORKER_SILENT`), or None
    while it may. ``newest_beat``: the newest beat of any live worker (None: none); ``timeout_s``: the worker timeout,
    after which the scheduler too counts a silent worker lost."""
    if (worker is not None and worker.incarnation is not None and worker.incarnation != claim.incarnation
            and worker.incarnation_started_at is not None and worker.incarnation_started_at > claim.started_at):
        return WORKER_RESTARTED  # a newer process beats under its id: the one that claimed it is gone
    if newest_beat is None or now - newest_beat > timeout_s:
        # No worker's beat arrives (the scheduler is down, or every worker is): silence proves nothing, and a build
        # sent again would have no one to take it.
        return None
    if now - claim.at <= timeout_s:
        return None  # a process that has just started may not have been heard yet
    if worker is None or worker.incarnation != claim.incarnation:
        return WORKER_SILENT  # never heard from within a worker timeout of its claim, while others were
    if not worker.alive or now - worker.last_heartbeat > timeout_s:
        return WORKER_SILENT
    return None


def resend_reason(request: BuildRequest | None, claim: BuildClaim | None, worker: WorkerSeen | None, *,
                  newest_beat: float | None, now: float, timeout_s: float) -> str | None:
    """Whether to send the build (again) now, and why: "" for a first send (nothing asked yet, or a marker that cannot
    be read), a reason for a re-send, None to wait. A claim of an earlier request (one sent again since) is not this
    request's and says nothing."""
    if request is None:
        return ""
    if claim is not None and claim.request_id == request.request_id:
        return lost_reason(claim, worker, newest_beat=newest_beat, now=now, timeout_s=timeout_s)
    return NEVER_CLAIMED if now - request.at > UNCLAIMED_RESEND_S else None


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)
