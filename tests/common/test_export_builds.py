"""When the API sends an export build again (common/export_builds.py): the rules alone, on plain values. Through the
API with a real database: tests/api/test_api_trials.py; a worker killed mid-build:
tests/e2e/test_export_worker_lost.py."""

from __future__ import annotations

from common.export_builds import (
    NEVER_CLAIMED,
    UNCLAIMED_RESEND_S,
    WORKER_RESTARTED,
    WORKER_SILENT,
    BuildClaim,
    BuildRequest,
    WorkerSeen,
    lost_reason,
    resend_reason,
)

NOW = 10_000.0
TIMEOUT = 30.0
CLAIM = BuildClaim(request_id="r1", worker_id="local", incarnation="inc-1", started_at=NOW - 500, at=NOW - 60)
BEATING = WorkerSeen(incarnation="inc-1", incarnation_started_at=NOW - 500, last_heartbeat=NOW - 2, alive=True)


def lost(worker: WorkerSeen | None, *, newest_beat: float | None = NOW - 1, claim: BuildClaim = CLAIM) -> str | None:
    return lost_reason(claim, worker, newest_beat=newest_beat, now=NOW, timeout_s=TIMEOUT)


def test_a_build_whose_worker_beats_goes_on() -> None:
    assert lost(BEATING) is None


def test_a_newer_process_under_the_claimants_id_means_it_died() -> None:
    restarted = WorkerSeen(incarnation="inc-2", incarnation_started_at=NOW - 5, last_heartbeat=NOW - 1, alive=True)
    assert lost(restarted) == WORKER_RESTARTED
    # Even when no beat is fresh (the new process beat once and the scheduler stopped since): it is known.
    assert lost(restarted, newest_beat=None) == WORKER_RESTARTED


def test_a_claimant_newer_than_the_process_the_scheduler_knows_is_not_lost_before_a_timeout() -> None:
    """A restarted worker takes the build before the scheduler read its first beat: the row still names the process
    it replaced, which is older than the claim's, and the claim is young."""
    older_known = WorkerSeen(incarnation="inc-0", incarnation_started_at=NOW - 900, last_heartbeat=NOW - 600,
                             alive=False)
    young = BuildClaim(request_id="r1", worker_id="local", incarnation="inc-1", started_at=NOW - 20, at=NOW - 3)
    assert lost(older_known, claim=young) is None
    old = BuildClaim(request_id="r1", worker_id="local", incarnation="inc-1", started_at=NOW - 90, at=NOW - 60)
    assert lost(older_known, claim=old) == WORKER_SILENT  # never heard of within a timeout, while others were


def test_a_silent_claimant_is_lost_only_while_other_beats_arrive() -> None:
    silent = WorkerSeen(incarnation="inc-1", incarnation_started_at=NOW - 500, last_heartbeat=NOW - 45, alive=True)
    assert lost(silent) == WORKER_SILENT
    assert lost(WorkerSeen("inc-1", NOW - 500, NOW - 5, alive=False)) == WORKER_SILENT  # the scheduler said lost
    assert lost(None) == WORKER_SILENT  # a claim by a worker id the scheduler never heard of
    # No beat of anyone arrives (the scheduler or the bus is down): silence proves nothing, nothing is sent again.
    assert lost(silent, newest_beat=NOW - 45) is None
    assert lost(silent, newest_beat=None) is None


def test_what_the_api_does_on_a_poll() -> None:
    request = BuildRequest(at=NOW - 60, request_id="r1")

    def reason(request: BuildRequest | None, claim: BuildClaim | None,
               worker: WorkerSeen | None = BEATING) -> str | None:
        return resend_reason(request, claim, worker, newest_beat=NOW - 1, now=NOW, timeout_s=TIMEOUT)

    assert reason(None, None) == ""  # asked for the first time
    assert reason(request, CLAIM) is None  # being built
    assert reason(request, None) is None  # waiting in the queue
    stale_claim = BuildClaim(request_id="r0", worker_id="gone", incarnation="x", started_at=0.0, at=0.0)
    assert reason(request, stale_claim, None) is None  # a claim of an earlier send says nothing of this one
    assert reason(BuildRequest(at=NOW - UNCLAIMED_RESEND_S - 1, request_id="r1"), None) == NEVER_CLAIMED
    dead = WorkerSeen(incarnation="inc-2", incarnation_started_at=NOW - 5, last_heartbeat=NOW - 1, alive=True)
    assert reason(request, CLAIM, dead) == WORKER_RESTARTED


def test_markers_round_trip_and_unreadable_ones_are_none() -> None:
    request = BuildRequest.new(NOW, resent=WORKER_SILENT, lost_worker="w1")
    assert BuildRequest.from_json(request.to_json()) == request
    assert BuildRequest.new(NOW).request_id != BuildRequest.new(NOW).request_id
    assert BuildClaim.from_json(CLAIM.to_json()) == CLAIM
    assert BuildRequest.from_json(b'{"at": 5.0}') == BuildRequest(at=5.0, request_id="")  # written before ids
    for raw in (b"", b"[]", b'{"at": "soon"}', b"not json"):
        assert BuildRequest.from_json(raw) is None and BuildClaim.from_json(raw) is None
