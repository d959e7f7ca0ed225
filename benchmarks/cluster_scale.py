"""The real control plane against hollow workers (issue 53), the way kubemark tests Kubernetes: PostgreSQL, Redis,
`loraplane api --workers 2`, the scheduler daemon and N hollow workers (`loraplane worker --hollow`: the worker's
real shell, a timing model instead of the GPU; docs/operator-guide.md says what they do not do), driven by a trace
from scheduler/sim/traces.py scaled to N, with tenants polling status and holding event streams open meanwhile.

    python -m benchmarks.cluster_scale --workers 8 32 64 256

Per N it measures and writes (benchmarks/results/cluster_scale-*.json, one file a run, a row per N):
- tasks succeeded / failed, trials lost, train points lost or duplicated (each completed trial's steps against its
  stored points; the unique constraint makes a stored duplicate impossible, so "duplicated" counts what the
  constraint turned away: points the workers sent more than once);
- ingest: points/s sustained over the busy part of the run, and the scheduler's send-to-ingest lag p50/p99 (its
  Prometheus histogram: a point is visible in the API once ingested);
- scheduler: replan p50/p95 (its histogram), its CPU share, messages dropped;
- API: a status read's and a submission's p50/p99 under the pollers and the open streams;
- database: rows and bytes per million points; the dashboard's tasks list and cluster page p99 with 10,000 tasks
  stored (finished tasks copied in by SQL before they are timed: the run alone stores far fewer);
- mean and p95 JCT and makespan against `loraplane simulate` on the same trace and N (model seconds: the run's wall
  seconds times the time scale);
- churn: a tenth of the hollow workers (one of their processes) killed -9 mid-run and started again.

Everything runs on this machine: on the 2-core dev machine the load generator, the hollow workers and the control
plane share two cores, and each result names the process that ran out of CPU first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text

from benchmarks.common import write_result
from common.settings import DEFAULT_MAX_TRIALS_PER_PACK
from scheduler.planning.cost import GPU_DEVICE_KIND, prior_cost
from scheduler.service.daemon import LEADER_LOCK_ID
from scheduler.sim.simulate import SimResult, percentile, simulate
from scheduler.sim.traces import Trace, TraceTask, make_trace

ROOT = Path(__file__).resolve().parents[1]
SERVER_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN_TOKEN = "lpadmin_cluster_scale"
MODEL = "tiny-random-llama"  # every trace model maps onto it: the hollow worker prices its steps by the GPU prior
MODEL_PARAMETERS = 107_200
MAX_SEQ_LEN = 512  # the traces' tokens per sample: a trial's tokens per step are batch x 512 in both
GPU_MEMORY_GB = 141.0
WEIGHTS = (1, 1, 2, 4)  # tenant i's weight: WEIGHTS[i % 4]
DASHBOARD_TASKS = 10_000
POLLERS = 12  # status-polling threads: enough that ~100 reads a second hold under a slow API
CHURN_AT = 0.4  # the churn's kill comes once this share of the trace's train points is stored
FAILOVER_AT = 0.6  # the active scheduler's kill: at this share of the points, or of the ceiling, whichever is first
ROWS = [{"prompt": f"{a} plus {a + 1} is", "completion": f" {2 * a + 1}"} for a in range(64)]


@dataclass(frozen=True)
class RunConfig:
    workers: int
    slots: int = 32
    processes: int = 10  # hollow processes (the churn kills one: a tenth of the workers)
    trace: str = "tenant-stream"
    tenants: int = 50
    tasks: int | None = None  # default: enough arrivals to keep every slot busy for a while
    load: float = 1.5
    time_scale: float = 200.0
    steps_scale: float = 1.0  # every trial's steps times this (the trace's 100-5,000 steps are long at time scale 1)
    planner: str = "cpsat"  # the daemon's (LORAPLANE_PLANNER) and the simulator's policy
    trials_per_task: int = 1  # each trace task a search of this many trials (its first trial's shape, a grid of rates)
    seed: int = 1
    pollers_rps: float = 100.0
    streams: int = 50
    churn: bool = True
    failover: bool = True
    simulator: str = "after"  # when the simulator runs the same trace: "after" the run, "alongside" it, or "none"
    ceiling_s: float = 900.0


# ----------------------------------------------------------------------------------------------------- the trace


def service_cost() -> Any:
    """The cost model the hollow workers sleep by and the planner plans with before a profile: the GPU prior."""
    return prior_cost(MODEL_PARAMETERS, GPU_DEVICE_KIND)


def scaled_trace(config: RunConfig) -> Trace:
    """`config.trace` from scheduler/sim/traces.py drawn for `config.workers` GPUs, with every task's model the
    service's `MODEL` (priced by `service_cost`), `config.tenants` tenants weighted by `WEIGHTS`, packs of up to
    the service's default trials, and arrivals re-timed so that they offer `config.load` of the cluster's
    GPU-seconds when every trial runs alone (as the trace itself does, on its own cost model)."""
    tasks = config.tasks or max(40, 2 * config.workers * config.slots // config.trials_per_task)
    drawn = make_trace(config.trace, config.seed, config.workers, tasks, config.load)
    cost = service_cost()
    rng = random.Random(config.seed)
    retimed: list[TraceTask] = []
    solo = [config.trials_per_task * max(1, round(task.trials[0].steps * config.steps_scale))
            * cost.step.predict(task.trials[0].tokens_per_step, 1) for task in drawn.tasks]
    rate = config.load * config.workers / (sum(solo) / len(solo))
    now = 0.0
    for i, task in enumerate(drawn.tasks):
        if i:
            now += rng.expovariate(rate)
        tenant = rng.randrange(config.tenants)
        first = task.trials[0]
        trials = tuple(replace(first, trial_id=f"{first.trial_id}-{k}", max_trials_per_pack=DEFAULT_MAX_TRIALS_PER_PACK,
                               slot_bytes=1 << 20, steps=max(1, round(first.steps * config.steps_scale)))
                       for k in range(config.trials_per_task))
        retimed.append(replace(task, tenant_id=f"tenant{tenant:03d}", tenant_weight=WEIGHTS[tenant % len(WEIGHTS)],
                               base_model=MODEL, gpus_needed=1, arrival_s=now, trials=trials))
    return Trace(f"{drawn.name}-scaled", tuple(retimed), {MODEL: cost}, gpu_memory_bytes=int(GPU_MEMORY_GB * 1e9))


def task_body(task: TraceTask, file_id: str) -> dict[str, Any]:
    """The trace task as a submission: one trial per trace trial (a learning-rate grid), its steps and batch."""
    trial = task.trials[0]
    batch = max(1, trial.tokens_per_step // MAX_SEQ_LEN)
    n = len(task.trials)  # learning rates log-spaced over [1e-5, 1e-2]
    rates = [round(1e-5 * 1000 ** (i / max(1, n - 1)), 8) for i in range(n)]
    return {"base_model": MODEL, "training_file": file_id, "validation_split": 0.2, "strategy": "grid",
            "search_space": {"learning_rate": rates, "lora_rank": [8], "batch_size": [batch],
                             "target_modules": [["q_proj", "v_proj"]]},
            "max_steps": trial.steps, "max_seq_len": MAX_SEQ_LEN, "eval_interval": max(1, trial.steps // 4),
            "training": {"checkpoints": False}, "seed": 7}


# ------------------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def cpu_s(self) -> float:
        """User + system CPU seconds so far of the process and every live process below it (an API's server
        processes, a worker's heartbeat), from /proc."""
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (fields := _stat(int(entry.name))):
                parents[int(entry.name)] = int(fields[1])
        tree, frontier = {self.popen.pid}, [self.popen.pid]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
            tree.update(children)
            frontier += children
        ticks = sum(sum(int(f[i]) for i in (11, 12)) for pid in tree if (f := _stat(pid)))
        return ticks / os.sysconf("SC_CLK_TCK")


def servers_cpu_s() -> dict[str, float]:
    """CPU seconds so far of the servers the run shares with whatever else uses them (PostgreSQL's postmaster, its
    live backends and the ones it reaped; Redis) and of this process, the load generator (pollers, streams,
    submissions)."""
    out = {"postgres": 0.0, "redis": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        name = "postgres" if comm.startswith("postgres") else "redis" if comm.startswith("redis-server") else None
        if name is None or not (fields := _stat(int(entry.name))):
            continue
        # utime + stime, and for the postmaster its reaped children's (the backends that already closed).
        own = int(fields[11]) + int(fields[12])
        reaped = int(fields[13]) + int(fields[14]) if name == "postgres" else 0
        out[name] += (own + reaped) / tick
    times = os.times()
    out["load generator"] = times.user + times.system
    return out


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command (state first), or None for a process gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


@dataclass
class Plane:
    env: dict[str, str]
    logs: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        log = self.logs / f"{name}.log"
        popen = subprocess.Popen([sys.executable, "-m", "loraplane.cli", *args], env={**self.env, **(env or {})},
                                 cwd=ROOT,
                                 stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = Proc(name, popen, log)
        return self.procs[name]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(timeout=30)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            found = predicate()
        except (httpx.HTTPError, OSError):
            found = None
        if found:
            return found
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not after {seconds:.0f} s")


# --------------------------------------------------------------------------------------------------- the load


@dataclass
class Latencies:
    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, seconds: float, ok: bool) -> None:
        with self.lock:
            self.samples.setdefault(what, []).append(seconds)
            if not ok:
                self.errors[what] = self.errors.get(what, 0) + 1

    def quantiles_ms(self, what: str) -> tuple[float, float, int]:
        values = self.samples.get(what, [])
        return (round(1000 * percentile(values, 50), 1), round(1000 * percentile(values, 99), 1), len(values))


def poll_status(base_url: str, keys: dict[str, str], task_ids: dict[str, list[str]], rps: float,
                latencies: Latencies, stop: threading.Event) -> None:
    """GET /v1/tasks/{id} of a random submitted task of a random tenant, `rps` a second in all (POLLERS threads,
    each at most rps / POLLERS a second)."""
    def loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=base_url, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                tenants = [t for t, ids in task_ids.items() if ids]
                if tenants:
                    tenant = rng.choice(tenants)
                    r = client.get(f"/v1/tasks/{rng.choice(task_ids[tenant])}",
                                   headers={"Authorization": f"Bearer {keys[tenant]}"})
                    latencies.add("status_read", time.perf_counter() - started, r.status_code == 200)
                stop.wait(max(0.0, POLLERS / rps - (time.perf_counter() - started)))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(POLLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def hold_stream(base_url: str, key: str, task_id: str, stop: threading.Event, opened: list[int]) -> None:
    """One task's event stream held open until it ends (with its task) or `stop`, as a dashboard watches it."""
    try:
        with httpx.stream("GET", f"{base_url}/v1/tasks/{task_id}/events/stream",
                          headers={"Authorization": f"Bearer {key}"}, timeout=httpx.Timeout(30, read=None)) as r:
            opened.append(1)
            try:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
            finally:
                opened.pop()
    except httpx.HTTPError:
        return


# ------------------------------------------------------------------------------------------------ the metrics


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A Prometheus text page as {name: [(labels, value)]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in httpx.get(url, timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        out.setdefault(name, []).append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def histogram_quantile(page: dict[str, list[tuple[dict[str, str], float]]], name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of histogram `name` (None: no observation)."""
    buckets = sorted((float(labels["le"]), count) for labels, count in page.get(f"{name}_bucket", [])
                     if labels.get("le") not in (None, "+Inf"))
    total = sum(count for _, count in page.get(f"{name}_count", []))
    if not total:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return math.inf


def counter(page: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in page.get(name, []))


# -------------------------------------------------------------------------------------------------- the run


def run(config: RunConfig, workdir: Path) -> dict[str, Any]:
    trace = scaled_trace(config)
    run_id = uuid.uuid4().hex[:8]
    db = f"loraplane_scale_{run_id}"
    admin_engine = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    database_url = f"{SERVER_URL.rpartition('/')[0]}/{db}"
    port, metrics_port, standby_metrics_port = free_port(), free_port(), free_port()
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "CELERY_BROKER_URL": REDIS_URL,
           "LORAPLANE_NAMESPACE": f"lp-scale-{run_id}", "LORAPLANE_HOME": str(workdir / "home"),
           "LORAPLANE_ARTIFACT_DIR": str(workdir / "artifacts"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
           "LORAPLANE_SECRET_KEY": Fernet.generate_key().decode(),
           "LORAPLANE_SCHEDULER_METRICS_PORT": str(metrics_port),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "LORAPLANE_PLANNER": config.planner}
    plane = Plane(env, workdir)
    base_url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        subprocess.run([sys.executable, "-m", "loraplane.cli", "migrate"], env=env, cwd=ROOT, check=True,
                       capture_output=True)
        plane.start("api", "api", "--host", "127.0.0.1", "--port", str(port), "--workers", "2")
        plane.start("scheduler", "scheduler")
        if config.failover:  # a standby: it waits on the leader lock until the active one is killed
            wait_until(lambda: _leader_held(database_url), 120, "the active scheduler's lock")
            plane.start("scheduler-standby", "scheduler",
                        env={"LORAPLANE_SCHEDULER_METRICS_PORT": str(standby_metrics_port)})
        per_process = math.ceil(config.workers / config.processes)
        hollow_args = ["--hollow", "--slots", str(config.slots), "--time-scale", str(config.time_scale),
                       "--memory-gb", str(GPU_MEMORY_GB)]
        groups = [(f"hollow-{g}", min(per_process, config.workers - g * per_process))
                  for g in range(config.processes) if config.workers - g * per_process > 0]
        for name, count in groups:
            plane.start(name, "worker", *hollow_args, "--count", str(count), "--worker-id", name)
        wait_until(lambda: httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200, 300, "the API")
        wait_until(lambda: len(httpx.get(f"{base_url}/v1/admin/workers", headers=admin, timeout=30,
                                         params={"limit": 5000}).json()["data"]) >= config.workers, 600,
                   f"{config.workers} hollow workers alive")
        keys, files = {}, {}
        tenant_names = sorted({t.tenant_id for t in trace.tasks})
        with httpx.Client(base_url=base_url, timeout=60) as client:
            for name in tenant_names:
                weight = next(t.tenant_weight for t in trace.tasks if t.tenant_id == name)
                tenant = client.post("/v1/admin/tenants", headers=admin, json={
                    "name": name, "weight": weight, "max_concurrent_trials": 100_000,
                    "max_trials_per_task": 64}).json()
                keys[name] = client.post(f"/v1/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
                upload = "\n".join(json.dumps(r) for r in ROWS).encode() + b"\n"
                files[name] = client.post("/v1/files", headers={"Authorization": f"Bearer {keys[name]}"},
                                          files={"file": ("rows.jsonl", upload)}).json()["id"]
        load = Load(base_url, keys, files, config.streams)
        # The simulator on the same trace: after the run, or beside it in a process of its own (on a machine with
        # cores to spare: it takes minutes at 256 workers).
        simulation = (ProcessPoolExecutor(1).submit(simulate, trace, config.workers, config.planner, seed=config.seed)
                      if config.simulator == "alongside" else None)
        result = drive(config, trace, plane, load, (metrics_port, standby_metrics_port), database_url, groups,
                       hollow_args, simulation)
        result.update(database(database_url, base_url, admin, keys))
        return result
    finally:
        plane.stop_all()
        with admin_engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin_engine.dispose()
        forget_namespace(env["LORAPLANE_NAMESPACE"])


def _leader_held(database_url: str) -> bool:
    """Whether a scheduler holds the leader lock (scheduler/service/daemon.py, LEADER_LOCK_ID) of this database."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0 AND objid = :k "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
                {"k": LEADER_LOCK_ID}).scalar_one())
    finally:
        engine.dispose()


def forget_namespace(namespace: str) -> None:
    """Deletes the run's keys from the shared Redis (its streams hold up to 200,000 reports each)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start:start + 500])
    client.close()


@dataclass
class Load:
    """What the run's tenants do: their keys and files, the tasks they submitted, the latencies they saw."""

    base_url: str
    keys: dict[str, str]
    files: dict[str, str]
    streams: int
    latencies: Latencies = field(default_factory=Latencies)
    stop: threading.Event = field(default_factory=threading.Event)
    opened: list[int] = field(default_factory=list)  # event streams open now
    task_ids: dict[str, list[str]] = field(default_factory=dict)  # tenant -> its submitted tasks
    submitted: dict[str, tuple[float, TraceTask]] = field(default_factory=dict)  # task -> (submitted at, trace task)

    def submit(self, client: httpx.Client, task: TraceTask) -> None:
        """One trace task submitted (timed), and an event stream held on it while fewer than `streams` are."""
        t0 = time.perf_counter()
        r = client.post("/v1/tasks", headers={"Authorization": f"Bearer {self.keys[task.tenant_id]}"},
                        json=task_body(task, self.files[task.tenant_id]))
        self.latencies.add("submission", time.perf_counter() - t0, r.status_code == 201)
        if r.status_code != 201:
            if not self.submitted:  # the first one refused: the body is wrong, and every one would be
                raise RuntimeError(f"submission refused: {r.status_code} {r.text[:500]}")
            return
        task_id = r.json()["id"]
        self.submitted[task_id] = (time.monotonic(), task)
        self.task_ids.setdefault(task.tenant_id, []).append(task_id)
        if len([t for t in threading.enumerate() if t.name.startswith("stream")]) < self.streams:
            threading.Thread(target=hold_stream, name=f"stream-{task_id}", daemon=True,
                             args=(self.base_url, self.keys[task.tenant_id], task_id, self.stop, self.opened)).start()


@dataclass
class Faults:
    """The run's two faults, each once: a tenth of the hollow workers (one of their processes) killed -9 and started
    again at once (churn), and the active scheduler killed -9 while a standby waits on the leader lock (failover:
    the seconds until the standby stores points again)."""

    config: RunConfig
    plane: Plane
    groups: list[tuple[str, int]]
    hollow_args: list[str]
    engine: Any
    metrics_ports: tuple[int, int]  # the active scheduler's, the standby's
    churned_at: float | None = None
    churned_name: str | None = None
    failed_over_at: float | None = None
    failover_s: float | None = None
    page_before: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def step(self, now: float, stored: int, expected: int) -> None:
        if self.config.churn and self.churned_at is None and stored >= CHURN_AT * expected and len(self.groups) > 1:
            name, count = self.groups[0]
            os.killpg(self.plane.procs[name].popen.pid, signal.SIGKILL)
            self.plane.procs[name].popen.wait(timeout=30)
            self.plane.start(name, "worker", *self.hollow_args, "--count", str(count), "--worker-id", name)
            self.churned_at, self.churned_name = now, name
        if self.config.failover and self.failed_over_at is None and \
                (stored >= FAILOVER_AT * expected or now >= FAILOVER_AT * self.config.ceiling_s):
            self.failed_over_at = now
            self.page_before = scrape(f"http://127.0.0.1:{self.metrics_ports[0]}/metrics")
            threading.Thread(target=self._fail_over, daemon=True).start()

    def _fail_over(self) -> None:
        with self.engine.connect() as conn:
            before = int(conn.execute(text("SELECT coalesce(max(id), 0) FROM metric_points")).scalar_one())
        killed = time.monotonic()
        os.killpg(self.plane.procs["scheduler"].popen.pid, signal.SIGKILL)
        deadline = killed + 120
        while time.monotonic() < deadline:
            with self.engine.connect() as conn:
                if int(conn.execute(text("SELECT coalesce(max(id), 0) FROM metric_points")).scalar_one()) > before:
                    self.failover_s = round(time.monotonic() - killed, 2)
                    return
            time.sleep(0.1)

    def scheduler_page(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The schedulers' metrics over the run: the active one's until it was killed, plus the standby's after."""
        if self.failed_over_at is None:
            return scrape(f"http://127.0.0.1:{self.metrics_ports[0]}/metrics")
        merged: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for page in (self.page_before, scrape(f"http://127.0.0.1:{self.metrics_ports[1]}/metrics")):
            for name, samples in page.items():
                for labels, value in samples:
                    key = tuple(sorted(labels.items()))
                    merged.setdefault(name, {})[key] = merged.get(name, {}).get(key, 0.0) + value
        return {name: [(dict(k), v) for k, v in values.items()] for name, values in merged.items()}


def drive(config: RunConfig, trace: Trace, plane: Plane, load: Load, metrics_ports: tuple[int, int],
          database_url: str, groups: list[tuple[str, int]], hollow_args: list[str],
          simulation: Future[SimResult] | None) -> dict[str, Any]:
    """Submits the trace on its (compressed) clock under the pollers and streams, injects the faults (`Faults`),
    and waits for every task to end; the measurements of the run."""
    engine = create_engine(database_url)
    faults = Faults(config, plane, groups, hollow_args, engine, metrics_ports)
    cpu_before = {name: p.cpu_s() for name, p in plane.procs.items()}
    servers_before = servers_cpu_s()
    load.task_ids.update({name: [] for name in load.keys})
    threading.Thread(target=poll_status, daemon=True, args=(load.base_url, load.keys, load.task_ids,
                                                            config.pollers_rps, load.latencies, load.stop)).start()
    started = time.monotonic()
    samples: list[tuple[float, int]] = []  # (seconds since start, points stored)
    open_streams: list[int] = []  # streams open at each sample
    checked_at = 0.0
    expected_points = sum(t.steps for task in trace.tasks for t in task.trials)
    with httpx.Client(base_url=load.base_url, timeout=120) as client:
        pending = list(trace.tasks)
        while True:
            now = time.monotonic() - started
            while pending and pending[0].arrival_s / config.time_scale <= now:
                load.submit(client, pending.pop(0))
            open_streams.append(len(load.opened))
            with engine.connect() as conn:
                samples.append((now, int(conn.execute(text("SELECT coalesce(max(id), 0) FROM metric_points"))
                                         .scalar_one())))
            faults.step(now, samples[-1][1], expected_points)
            if not pending and now - checked_at > 10:  # every task listed: at most every 10 s
                checked_at = now
                if all_ended(client, load.keys, load.submitted):
                    break
            if now > config.ceiling_s:
                break
            time.sleep(2.0)
        ended_s = time.monotonic() - started
        finished = ended_tasks(client, load.keys, load.submitted)
    load.stop.set()
    # A process started again by the churn counts from its new start; the killed scheduler is not counted.
    cpu = {name: round(max(0.0, p.cpu_s() - cpu_before.get(name, 0.0)) / ended_s, 3) if name != faults.churned_name
           else round(p.cpu_s() / ended_s, 3) for name, p in plane.procs.items()}
    cpu.update({name: round((seconds - servers_before[name]) / ended_s, 3)
                for name, seconds in servers_cpu_s().items()})
    result = {"wall_s": round(ended_s, 1), "tasks_submitted": len(load.submitted),
              **task_counts(finished, len(load.submitted)), **scheduler_figures(faults.scheduler_page()),
              **api_figures(load, ended_s), "ingest_points_per_s": sustained_rate(samples), "cpu_share": cpu,
              "churned_at_s": faults.churned_at, "failed_over_at_s": faults.failed_over_at,
              "failover_s": faults.failover_s,
              "streams_open_median": statistics.median(open_streams) if open_streams else 0}
    if config.simulator != "none":
        sim = simulation.result() if simulation is not None else simulate(trace, config.workers, config.planner,
                                                                           seed=config.seed)
        result.update(jct_against_simulator(config, sim, load.submitted, finished))
    result.update(points_check(engine))
    engine.dispose()
    return result


def task_counts(finished: dict[str, tuple[str, float | None]], submitted: int) -> dict[str, int]:
    states = [state for state, _ in finished.values()]
    ended = sum(1 for s in states if s in ("succeeded", "failed", "cancelled"))
    return {"tasks_succeeded": states.count("succeeded"), "tasks_failed": ended - states.count("succeeded"),
            "tasks_unfinished": submitted - ended}


def scheduler_figures(page: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    return {"ingest_lag_p50_s": histogram_quantile(page, "loraplane_scheduler_ingest_lag_seconds", 0.50),
            "ingest_lag_p99_s": histogram_quantile(page, "loraplane_scheduler_ingest_lag_seconds", 0.99),
            "replan_p50_ms": ms(histogram_quantile(page, "loraplane_scheduler_replan_seconds", 0.50)),
            "replan_p95_ms": ms(histogram_quantile(page, "loraplane_scheduler_replan_seconds", 0.95)),
            "messages_dropped": counter(page, "loraplane_scheduler_bus_messages_dropped_total")}


def api_figures(load: Load, seconds: float) -> dict[str, Any]:
    reads, submissions = load.latencies.quantiles_ms("status_read"), load.latencies.quantiles_ms("submission")
    return {"api_read_p50_ms": reads[0], "api_read_p99_ms": reads[1], "status_reads": reads[2],
            "status_read_rps": round(reads[2] / seconds, 1), "submission_p50_ms": submissions[0],
            "submission_p99_ms": submissions[1], "api_errors": dict(load.latencies.errors)}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def sustained_rate(samples: list[tuple[float, int]]) -> float:
    """Points per second over the busiest stretch of the run: the middle 80% of the points stored."""
    if len(samples) < 2 or samples[-1][1] == 0:
        return 0.0
    total = samples[-1][1]
    low = next(s for s in samples if s[1] >= 0.1 * total)
    high = next(s for s in samples if s[1] >= 0.9 * total)
    return round((high[1] - low[1]) / max(1e-9, high[0] - low[0]), 1)


def all_ended(client: httpx.Client, keys: dict[str, str], submitted: dict[str, tuple[float, TraceTask]]) -> bool:
    states = ended_tasks(client, keys, submitted)
    return bool(submitted) and all(s in ("succeeded", "failed", "cancelled") for s, _ in states.values())


def ended_tasks(client: httpx.Client, keys: dict[str, str],
                submitted: dict[str, tuple[float, TraceTask]]) -> dict[str, tuple[str, float | None]]:
    """Each submitted task's state and, once ended, its wall seconds from submission to end (the API's times)."""
    out: dict[str, tuple[str, float | None]] = {}
    for key in keys.values():
        after = None
        while True:
            params: dict[str, Any] = {"limit": 100, **({"after": after} if after else {})}
            page = client.get("/v1/tasks", headers={"Authorization": f"Bearer {key}"}, params=params).json()
            for task in page["data"]:
                seconds = None
                if task.get("finished_at") and task.get("created_at"):
                    seconds = iso_s(task["finished_at"]) - iso_s(task["created_at"])
                out[task["id"]] = (task["state"], seconds)
            if not page.get("has_more"):
                break
            after = page["data"][-1]["id"]
    return {task_id: out.get(task_id, ("unknown", None)) for task_id in submitted}


def iso_s(text_value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text_value.replace("Z", "+00:00")).timestamp()


def jct_against_simulator(config: RunConfig, sim: SimResult, submitted: dict[str, tuple[float, TraceTask]],
                          finished: dict[str, tuple[str, float | None]]) -> dict[str, Any]:
    """The run's mean and p95 JCT and makespan in model seconds (wall x time scale) against the simulator's on
    the same trace, N and policy (`config.planner`; the daemon's default is CP-SAT)."""
    jcts = [s * config.time_scale for state, s in finished.values() if state == "succeeded" and s is not None]
    if not jcts:
        return {}
    first = min(at for at, _ in submitted.values())
    ends = [at + (s or 0.0) for (at, _), (_, s) in zip(submitted.values(), finished.values(), strict=True)]
    makespan = (max(ends) - first) * config.time_scale
    mean = statistics.fmean(jcts)
    # The same tasks both ways: a run cut by its ceiling finishes the short tasks only, and its mean JCT is then
    # biased low against the simulator's over every task.
    pairs = [(s * config.time_scale, sim_jct) for task_id, (state, s) in finished.items()
             if state == "succeeded" and s is not None
             and (sim_jct := _sim_jct(sim, submitted[task_id][1])) is not None]
    matched = ({"matched_tasks": len(pairs), "matched_mean_jct_vs_sim": round(
        statistics.fmean(r for r, _ in pairs) / statistics.fmean(m for _, m in pairs), 3)} if pairs else {})
    return {"mean_jct_s": round(mean, 1), "p95_jct_s": round(percentile(jcts, 95), 1), "makespan_s": round(makespan, 1),
            "sim_mean_jct_s": round(sim.mean_jct_s, 1), "sim_p95_jct_s": round(sim.p95_jct_s, 1),
            "sim_makespan_s": round(sim.makespan_s, 1), "mean_jct_vs_sim": round(mean / sim.mean_jct_s, 3),
            "makespan_vs_sim": round(makespan / sim.makespan_s, 3), **matched}


def _sim_jct(sim: SimResult, task: TraceTask) -> float | None:
    """The simulator's JCT of one trace task (None: a trial of it never completed there)."""
    ends = [sim.completed_s.get(t.trial_id) for t in task.trials]
    return None if any(e is None for e in ends) else max(e for e in ends if e is not None) - task.arrival_s


def points_check(engine: Any) -> dict[str, Any]:
    """Each completed trial's train points against its steps: missing ones are lost. The unique constraint on
    (trial, step, split) keeps a point sent twice from being stored twice; what it turned away is not counted here."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT t.id, t.state, t.total_steps, count(p.id) FILTER (WHERE p.split = 'train') AS train, "
            "count(p.id) AS points FROM trials t LEFT JOIN metric_points p ON p.trial_id = t.id "
            "GROUP BY t.id, t.state, t.total_steps")).all()
    completed = [r for r in rows if r.state == "completed"]
    lost = sum(max(0, r.total_steps - r.train) for r in completed)
    over = sum(max(0, r.train - r.total_steps) for r in completed)
    return {"trials": len(rows), "trials_completed": len(completed),
            "trials_lost": sum(1 for r in rows if r.state in ("failed", "lost")),
            "points_lost": lost, "points_duplicated": over, "points_stored": sum(r.points for r in rows)}


def database(database_url: str, base_url: str, admin: dict[str, str], keys: dict[str, str]) -> dict[str, Any]:
    """Rows and bytes per million points; then DASHBOARD_TASKS finished tasks copied in, and the dashboard's tasks
    list and cluster page timed (p99 of 50 reads each)."""
    engine = create_engine(database_url)
    with engine.begin() as conn:
        points = int(conn.execute(text("SELECT count(*) FROM metric_points")).scalar_one())
        size = int(conn.execute(text("SELECT pg_total_relation_size('metric_points')")).scalar_one())
        stored = int(conn.execute(text("SELECT count(*) FROM tasks")).scalar_one())
        copies = max(0, DASHBOARD_TASKS - stored)
        if copies and stored:
            columns = [c for c in conn.execute(text(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'tasks'")).scalars()
                if c != "id"]
            names = ", ".join(f'"{c}"' for c in columns)
            conn.execute(text(
                f"INSERT INTO tasks (id, {names}) SELECT 'task_copy_' || g || '_' || "
                "substr(md5(random()::text), 1, 8), "
                f"{names} FROM generate_series(1, :n) AS g, LATERAL (SELECT * FROM tasks WHERE state = 'succeeded' "
                "ORDER BY id LIMIT 1) AS t"), {"n": copies})
    engine.dispose()
    tenant, key = next(iter(keys.items()))
    timings: dict[str, list[float]] = {"tasks_page": [], "cluster_page": []}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(50):
            for what, path, headers in (("tasks_page", "/v1/tasks?limit=50", {"Authorization": f"Bearer {key}"}),
                                        ("cluster_page", "/v1/admin/cluster", admin)):
                t0 = time.perf_counter()
                client.get(path, headers=headers).raise_for_status()
                timings[what].append(time.perf_counter() - t0)
    # One row a point (metric_points): the bytes say what a million points cost the database, indexes included.
    return {"points_total": points, "bytes_per_million_points": round(size / max(points, 1) * 1e6),
            "tasks_stored": max(stored, DASHBOARD_TASKS),
            "dashboard_tasks_p99_ms": round(1000 * percentile(timings["tasks_page"], 99), 1),
            "dashboard_cluster_p99_ms": round(1000 * percentile(timings["cluster_page"], 99), 1),
            "dashboard_tenant": tenant}


def bottleneck(result: dict[str, Any]) -> str:
    """The process that used the most CPU, and whether the machine's cores were the limit."""
    shares = result.get("cpu_share", {})
    if not shares:
        return "unknown"
    groups: dict[str, float] = {}
    for name, share in shares.items():
        key = "hollow workers" if name.startswith("hollow") else "scheduler" if name.startswith("scheduler") else name
        groups[key] = groups.get(key, 0.0) + share
    top = max(groups, key=lambda k: groups[k])
    cores = len(os.sched_getaffinity(0))
    # PostgreSQL and Redis are counted whole: another user of the same servers during the run counts too.
    return (f"{top} ({groups[top]:.2f} cores); all measured together used {sum(groups.values()):.2f} of {cores} "
            "cores")


HEADERS = ["workers", "slots", "tasks", "succeeded", "failed", "points/s", "lag p99 s", "replan p95 ms",
           "read p99 ms", "submit p99 ms", "points lost", "dup", "JCT vs sim", "same tasks", "makespan vs sim",
           "dash p99 ms", "wall s"]


def row(config: RunConfig, r: dict[str, Any]) -> list[Any]:
    return [config.workers, config.slots, r.get("tasks_submitted"), r.get("tasks_succeeded"), r.get("tasks_failed"),
            r.get("ingest_points_per_s"), r.get("ingest_lag_p99_s"), r.get("replan_p95_ms"), r.get("api_read_p99_ms"),
            r.get("submission_p99_ms"), r.get("points_lost"), r.get("points_duplicated"), r.get("mean_jct_vs_sim"),
            r.get("matched_mean_jct_vs_sim"), r.get("makespan_vs_sim"),
            max(r.get("dashboard_tasks_p99_ms") or 0, r.get("dashboard_cluster_p99_ms") or 0),
            r.get("wall_s")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--trace", default="tenant-stream", choices=["tenant-stream", "contended"])
    parser.add_argument("--tasks", type=int, default=None)
    parser.add_argument("--load", type=float, default=1.5)
    parser.add_argument("--time-scale", type=float, default=200.0)
    parser.add_argument("--steps-scale", type=float, default=1.0)
    parser.add_argument("--trials-per-task", type=int, default=1)
    parser.add_argument("--planner", default="cpsat", choices=["cpsat", "greedy"])
    parser.add_argument("--ceiling-s", type=float, default=900.0)
    parser.add_argument("--no-churn", action="store_true")
    parser.add_argument("--no-failover", action="store_true")
    parser.add_argument("--processes", type=int, default=10, help="hollow worker processes (churn kills one)")
    parser.add_argument("--simulator", default="after", choices=["after", "alongside", "none"],
                        help="the simulator on the same trace: after the run, alongside it in a process of its own "
                             "(where cores are spare), or not at all (1,024 workers: it takes hours)")
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for n in args.workers:
        config = RunConfig(workers=n, slots=args.slots, trace=args.trace, tasks=args.tasks, load=args.load,
                           time_scale=args.time_scale, steps_scale=args.steps_scale, ceiling_s=args.ceiling_s,
                           trials_per_task=args.trials_per_task, planner=args.planner,
                           churn=not args.no_churn, failover=not args.no_failover,
                           simulator=args.simulator,
                           processes=min(args.processes, n))
        with tempfile.TemporaryDirectory(prefix=f"cluster-scale-{n}-") as tmp:
            result = run(config, Path(tmp))
        result["bottleneck"] = bottleneck(result)
        runs.append({"config": config.__dict__, **result})
        print(json.dumps({"workers": n, **result}, default=str)[:2000], flush=True)
    largest = runs[-1]
    write_result(f"cluster_scale-{args.trace}", HEADERS, [row(RunConfig(**r["config"]), r) for r in runs], {
        "runs": runs,
        "hollow_worker_departures": "no GPU: a step sleeps the cost model's time (/ time scale); losses replayed "
                                    "from recorded sweeps; adapters and checkpoints are small JSON files with a "
                                    "hollow marker; no sampling, no exports, no generative metrics",
        # The top-level figures of the largest run, for scripts.
        **{k: largest.get(k) for k in ("ingest_points_per_s", "ingest_lag_p99_s", "replan_p95_ms", "api_read_p99_ms",
                                       "points_lost", "points_duplicated", "tasks_failed", "mean_jct_vs_sim")},
        "workers": largest["config"]["workers"],
        "failover_s": largest.get("failover_s"),
    })


if __name__ == "__main__":
    main()
