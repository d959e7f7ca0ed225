"""A worker's warm base models through the client and the CLI: `admin.list_workers()` gives its `warm_models` and
`loraplane admin workers` names them. Against the real app served in this process (conftest.py)."""

from __future__ import annotations

from common.db import session_scope
from common.tables import Worker, utcnow
from loraplane.client import Client
from tests.client.test_cli import Cli, cli, env  # noqa: F401 - the fixtures
from tests.factories import TenantKey


def test_an_operator_sees_each_workers_warm_models(cli: Cli, env: TenantKey, api_url: str) -> None:  # noqa: F811
    now = utcnow()
    warm = [{"name": "smollm2-135m-instruct", "revision": "2af2ce4a606345ac", "bytes": 538_062_336,
             "last_used_at": now.timestamp()},
            {"name": "tiny-random-llama", "revision": "tiny-random-llama", "bytes": 428_800,
             "last_used_at": now.timestamp() - 60}]
    with session_scope() as session:
        session.add(Worker(id="gpu-0", queue="q", device="cuda:0", max_slots=8, state="alive", last_heartbeat=now,
                           registered_at=now, warm_models=warm))
        session.add(Worker(id="gpu-1", queue="q1", device="cuda:1", max_slots=8, state="alive", last_heartbeat=now,
                           registered_at=now))
    with Client(api_url, env.key) as lp:
        workers = {w.id: w for w in lp.admin.list_workers()}
    assert workers["gpu-1"].warm_models is None
    shown = workers["gpu-0"].warm_models
    assert shown is not None and [(m["name"], m["bytes"]) for m in shown] == [
        ("smollm2-135m-instruct", 538_062_336), ("tiny-random-llama", 428_800)]
    table = cli("admin", "workers")
    assert table.code == 0, table.out
    header, *rows = table.out.splitlines()
    assert "WARM" in header.split()
    by_id = {row.split()[0]: row.split() for row in rows}
    assert "smollm2-135m-instruct,tiny-random-llama" in by_id["gpu-0"]
    assert "smollm2-135m-instruct,tiny-random-llama" not in by_id["gpu-1"]
