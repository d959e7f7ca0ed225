"""A quarantined worker through the client and the CLI (issue 29): `admin.list_workers()` gives its
`quarantined_until` and recent lost packs, `loraplane admin workers` says until when, `admin.lift_quarantine` ends
it. Against the real app served in this process (conftest.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from common.db import session_scope
from common.tables import Worker, utcnow
from loraplane.client import Client
from tests.client.test_cli import Cli, cli, env  # noqa: F401 - the fixtures
from tests.factories import TenantKey


def test_an_operator_sees_and_lifts_a_quarantine(cli: Cli, env: TenantKey, api_url: str,  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    now = utcnow()
    with session_scope() as session:
        session.add(Worker(id="gpu-0", queue="q", device="cuda:0", max_slots=8, state="alive", last_heartbeat=now,
                           registered_at=now, quarantined_until=now + timedelta(minutes=5),
                           lost_packs=[now.timestamp() - 3, now.timestamp() - 2, now.timestamp() - 1], quarantines=1))
    with Client(api_url, env.key) as lp:
        (worker,) = lp.admin.list_workers()
        assert worker.quarantined_until is not None and worker.quarantined_until > now
        assert worker.recent_lost_packs == 3
        table = cli("admin", "workers")
        assert table.code == 0 and "quarantined until" in table.out.splitlines()[1], table.out
        lifted = lp.admin.lift_quarantine("gpu-0")
        assert (lifted.id, lifted.quarantined_until, lifted.recent_lost_packs) == ("gpu-0", None, 0)
    table = cli("admin", "workers")
    assert "quarantined" not in table.out and table.out.splitlines()[1].split()[1] == "alive"
