"""The dashboard in a real browser: headless Chromium driven by Playwright against `loraplane up` (the
embedded service: its API, scheduler and a CPU worker training the tiny model).

Needs the `playwright` Python package (the `test` extra) and a Chromium binary (Debian's `chromium`
package; `LORAPLANE_CHROMIUM` points elsewhere). Without either, every test here is skipped with one line
that names what is missing. Screenshots and the downloaded adapter go to `.test-artifacts/dashboard/`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from common.db import make_engine
from tests.e2e.procs import ROOT, Cluster, cluster, free_port, wait_ready

ARTIFACTS = ROOT / ".test-artifacts" / "dashboard"
CHROMIUM = os.environ.get("LORAPLANE_CHROMIUM", "/usr/bin/chromium")
ADMIN_TOKEN = "dashboard-admin-token"
WORKER_ID = "dashboard-worker"
# `loraplane up` on its embedded default: none of the suite's servers.
EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE")


def missing_requirement() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "dashboard tests need the Python package 'playwright' (pip install -e '.[test]')"
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        return f"dashboard tests need Chromium at {CHROMIUM} (apt-get install chromium, or set LORAPLANE_CHROMIUM)"
    return None


@dataclass(frozen=True)
class Service:
    base_url: str
    admin_token: str
    tenant_name: str
    tenant_key: str
    cluster: Cluster


# The service and the browser live for tests/dashboard only (package scope), not the whole session: `up` with a 0.5 s
# tick and a 1 s heartbeat, and Chromium, took CPU from every later test of the suite (tests/e2e, tests/engine, ...)
# for nothing.
@pytest.fixture(scope="package")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    if (missing := missing_requirement()) is not None:
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("dashboard")
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp / "home"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
                "LORAPLANE_SCHEDULER_TICK_S": "0.5", "LORAPLANE_HEARTBEAT_S": "1",
                # A task's tracker on this host (down: tests/dashboard/test_dashboard_views.py) passes the egress check.
                "LORAPLANE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp) as c:
        up = c.start("up", "up", "--port", str(port), "--worker-id", WORKER_ID)
        wait_ready(base_url, [up])
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        # A quota of 8 trials per task, so the form's preview can be shown refusing a larger grid.
        tenant = httpx.post(f"{base_url}/v1/admin/tenants", headers=admin,
                            json={"name": "dashboard-team", "max_trials_per_task": 8}).json()
        key = httpx.post(f"{base_url}/v1/admin/tenants/{tenant['id']}/api-keys", headers=admin,
                         json={"name": "browser"}).json()["key"]
        yield Service(base_url, ADMIN_TOKEN, tenant["name"], key, c)


@pytest.fixture(scope="package")
def service_db(service: Service) -> Iterator[Engine]:
    """The service's SQLite database, with its own engine settings (WAL, a busy timeout). Kept open until the
    service stops (the end of tests/dashboard): closing this process's connection to the WAL database while the
    service runs upset the service's processes (seen as `disk I/O error` 503s, and as writes made afterwards that
    the service did not see)."""
    engine = make_engine(f"sqlite:///{service.cluster.env['LORAPLANE_HOME']}/loraplane.db")
    yield engine
    engine.dispose()


@dataclass
class Console:
    """Every console error and uncaught page error of the test. `refusals_allowed` lets through the browser's
    own "Failed to load resource" line for answers with those statuses, while a step provokes them on
    purpose (a bad key's 401, a refused search space's 422); nothing else is ever let through."""

    errors: list[str] = field(default_factory=list)
    refusals_allowed: tuple[int, ...] = ()

    def on_console(self, message: Any) -> None:
        if message.type != "error":
            return
        text = message.text
        status = re.search(r"^Failed to load resource: the server responded with a status of (\d+)", text)
        if status and int(status.group(1)) in self.refusals_allowed:
            return
        self.errors.append(f"console.error: {text}")

    def on_page_error(self, error: Any) -> None:
        self.errors.append(f"page error: {error}")


@pytest.fixture(scope="package")
def browser(service: Service) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def console() -> Console:
    return Console()


@pytest.fixture
def page(browser: Any, service: Service, console: Console) -> Iterator[Any]:
    """A fresh browser context (its own sessionStorage) per test; fails the test on any console error."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(accept_downloads=True, viewport={"width": 1360, "height": 1000},
                                  base_url=service.base_url)
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    pg.on("console", console.on_console)
    pg.on("pageerror", console.on_page_error)
    yield pg
    context.close()
    assert console.errors == [], "\n".join(console.errors)
