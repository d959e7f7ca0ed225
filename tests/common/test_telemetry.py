"""common/telemetry.py: prometheus_client's multiprocess mode as the API's server processes use it (real
processes writing to one directory, summed by the collector), and `serve` for the scheduler and the worker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx

from common import telemetry
from tests.e2e.procs import ROOT, free_port
from tests.prom import samples, value

# One API server process: counts `n` requests of one route and exits, as a `loraplane api --workers N` process
# would, through the same metric objects.
CHILD = textwrap.dedent("""
    import sys
    from common.telemetry import api_metrics

    n, route = int(sys.argv[1]), sys.argv[2]
    metrics = api_metrics()
    for _ in range(n):
        metrics.requests.labels(route=route, method="GET", status="200").inc()
        metrics.latency.labels(route=route, method="GET").observe(0.02)
    metrics.requests.labels(route="/healthz", method="GET", status="200").inc()
    print("counted")
""")


def _run_child(shared: Path, n: int, route: str = "/v1/tasks/{task_id}") -> int:
    env = {**os.environ, telemetry.MULTIPROC_ENV: str(shared)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(n), route], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "counted" in out, err
    return proc.pid


def test_multiprocess_collector_sums_every_process(tmp_path: Path) -> None:
    shared = telemetry.create_multiprocess_dir()
    try:
        pids = [_run_child(shared, 3), _run_child(shared, 4)]
        assert len({f.name for f in shared.iterdir()}) >= 4  # counter_<pid>.db and histogram_<pid>.db each
        for pid in pids:  # both exited: what `loraplane api` does when a server process dies
            telemetry.mark_process_dead(pid, shared)
        parsed = samples(telemetry.render_api_metrics(shared).decode())
    finally:
        telemetry.remove_multiprocess_dir(shared)
    assert not shared.exists()
    route = {"route": "/v1/tasks/{task_id}", "method": "GET"}
    assert value(parsed, "loraplane_api_requests_total", **route, status="200") == 7
    assert value(parsed, "loraplane_api_requests_total", route="/healthz", method="GET", status="200") == 2
    assert value(parsed, "loraplane_api_request_duration_seconds_count", **route) == 7
    assert value(parsed, "loraplane_api_request_duration_seconds_bucket", **route, le="0.025") == 7
    assert value(parsed, "loraplane_api_request_duration_seconds_bucket", **route, le="0.01") == 0
    assert abs(value(parsed, "loraplane_api_request_duration_seconds_sum", **route) - 7 * 0.02) < 1e-9


def test_without_a_shared_directory_only_this_process_counts(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    _run_child(shared, 5, "/only/in/the/child")  # in a directory this process is not told about
    assert telemetry.multiprocess_dir() is None  # the test process runs in single-process mode
    mine = samples(telemetry.render_api_metrics().decode())
    theirs = samples(telemetry.render_api_metrics(shared).decode())
    assert value(theirs, "loraplane_api_requests_total", route="/only/in/the/child", method="GET", status="200") == 5
    assert not [k for k in mine if ("route", "/only/in/the/child") in k[1]]


def test_serve_port_zero_is_off_and_a_port_serves_its_registry() -> None:
    assert telemetry.serve(telemetry.worker_metrics().registry, 0, "127.0.0.1", "worker") is None
    port = free_port()
    server = telemetry.serve(telemetry.scheduler_metrics().registry, port, "127.0.0.1", "scheduler")
    assert server is not None and server.port == port
    try:
        telemetry.scheduler_metrics().packs_running.set(3)
        parsed = samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
    finally:
        server.close()
    assert value(parsed, "loraplane_scheduler_packs_running") == 3
    # Only the scheduler's registry: no API or worker metric on the scheduler's port.
    assert not [k for k in parsed if not k[0].startswith("loraplane_scheduler_") and k[0].startswith("loraplane_")]


def test_grafana_dashboard_uses_the_defined_metric_names() -> None:
    """deploy/grafana/loraplane.json: valid JSON, every PromQL expression names only metrics defined here, and
    every metric defined here has a panel."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "loraplane.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and all(p["datasource"]["type"] == "prometheus" for p in dashboard["panels"] if "targets" in p)
    used = {re.sub(r"_(total|bucket|count|sum)$", "", name) for e in exprs for name in re.findall(r"loraplane_\w+", e)}
    registries = [telemetry.api_metrics().registry, telemetry.scheduler_metrics().registry,
                  telemetry.worker_metrics().registry]
    defined = {family.name for registry in registries for family in registry.collect()}
    assert used == defined
