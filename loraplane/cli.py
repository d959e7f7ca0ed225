"""`loraplane` command line: the service's processes, and the client commands that talk to its API.

service:
  loraplane up                 everything in one process tree (embedded default, or whatever the
                               environment points at)
  loraplane api                the FastAPI control plane
  loraplane scheduler          the planner daemon
  loraplane worker --gpu N     a Celery GPU agent bound to GPU N
  loraplane worker --gpus 0,1  one agent over several GPUs of this host (each pack over all of them)
  loraplane migrate            bring the database schema up to date
  loraplane rotate-secrets     re-encrypt stored secrets under the first key of LORAPLANE_SECRET_KEY
  loraplane simulate           compare planner policies on a workload trace with a simulated clock
  loraplane replay CURVES      replay a logged sweep's loss curves under an early-exit policy

client (loraplane/commands/, on loraplane.client; `--json` on each):
  loraplane login              store the API's URL and your API key (checked first)
  loraplane files upload|list|show|delete
  loraplane models [NAME]
  loraplane tasks create SPEC|list|show|watch|cancel|download|curves
  loraplane admin tenants|keys|workers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("loraplane")


def _schema_revision() -> str | None:
    """The database's schema revision (None: an empty database)."""
    from alembic.runtime.migration import MigrationContext

    from common.db import make_engine
    from common.settings import get_settings

    engine = make_engine(get_settings().resolved_database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _migrate() -> None:
    """Brings the schema up to date and says so in one line (Alembic's own line per revision is at DEBUG)."""
    from common.db import migrate
    from common.secret_box import SecretKeyError

    before = _schema_revision()
    try:
        migrate()
    except SecretKeyError as exc:  # revision 0014 encrypts existing webhook secrets: it needs the key
        raise SystemExit(f"loraplane: {exc}") from None
    after = _schema_revision()
    if before == after:
        log.info("database schema is up to date (revision %s)", after)
    else:
        log.info("database schema upgraded from revision %s to %s", before or "(empty)", after)


def cmd_migrate(_args: argparse.Namespace) -> None:
    _migrate()


def _require_secret_key() -> None:
    """The key of the secrets the database keeps (LORAPLANE_SECRET_KEY; generated into LORAPLANE_HOME in the
    embedded mode): checked before a process starts, so a missing or malformed one stops it at once, named."""
    from common.secret_box import SecretKeyError, get_secret_box

    try:
        get_secret_box()
    except SecretKeyError as exc:
        raise SystemExit(f"loraplane: {exc}") from None


def cmd_rotate_secrets(_args: argparse.Namespace) -> None:
    """Re-encrypts every stored secret under the first key of LORAPLANE_SECRET_KEY (common/webhooks.py)."""
    from common.db import session_scope
    from common.secret_box import get_secret_box
    from common.webhooks import rotate_secrets

    _require_secret_key()
    _migrate()
    with session_scope() as session:
        result = rotate_secrets(session, get_secret_box())
    sys.stdout.write(f"secrets (webhooks, trackers): {result.rotated} re-encrypted under the first key, "
                     f"{result.current} already under it\n")
    if result.unreadable:
        raise SystemExit(f"loraplane rotate-secrets: {len(result.unreadable)} secrets decrypt under no key of "
                         f"LORAPLANE_SECRET_KEY ({', '.join(result.unreadable)}); keep the key they were "
                         "encrypted with in the list, or have their tenants register them again")


def _api_workers(text: str) -> int:
    """`--workers N` or `auto` (one per core this process may run on)."""
    if text == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        workers = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or 'auto', got {text!r}") from None
    if workers < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 process, got {workers}")
    return workers


@contextlib.contextmanager
def _embedded_data_folder(what: str, roles: tuple[str, ...]) -> Iterator[None]:
    """In the embedded mode, this service holds its data folder's `roles` (api, scheduler) for as long as it runs
    (loraplane/service_guards.py); a second service of a role on the same folder stops here, naming the first. The
    distributed mode takes no lock."""
    from common.settings import get_settings
    from loraplane.service_guards import DataFolderInUse, hold_data_folder

    settings = get_settings()
    if not settings.embedded:
        yield
        return
    try:
        with hold_data_folder(settings.home, what, roles):
            yield
    except DataFolderInUse as exc:
        raise SystemExit(f"loraplane {what}: {exc}") from None


def _limit_api_memory() -> None:
    from common.settings import get_settings
    from loraplane.service_guards import limit_api_memory

    limit_api_memory(get_settings().api_memory_limit_mb)


def cmd_api(args: argparse.Namespace) -> None:
    import uvicorn

    with _embedded_data_folder("api", ("api",)):
        _require_secret_key()
        _migrate()  # once, here, before any server process starts
        if args.workers == 1:
            _limit_api_memory()
            # Imported by name so this package never imports api/ (dependencies point one way).
            uvicorn.run("api.main:app", host=args.host, port=args.port, log_level="info",
                        access_log=_access_log(args))
        else:
            with _api_metrics_dir() as metrics_dir:
                _serve_api_processes(args.host, args.port, args.workers, metrics_dir, _access_log(args))


def _access_log(args: argparse.Namespace) -> bool:
    """A line per request: `--access-log` or LORAPLANE_ACCESS_LOG=1 (off by default: the dashboard's polls would
    bury every other line)."""
    from common.settings import get_settings

    return bool(args.access_log or get_settings().access_log)


@contextlib.contextmanager
def _api_metrics_dir() -> Iterator[Path]:
    """Prometheus' multiprocess mode for the server processes: each writes its metrics into this run's own fresh
    directory (the spawned processes inherit the variable) and `GET /metrics` on any of them sums them all.
    Removed at the end: values of an earlier run must not be summed in."""
    from common import telemetry

    metrics_dir = telemetry.create_multiprocess_dir()
    before = os.environ.get(telemetry.MULTIPROC_ENV)
    os.environ[telemetry.MULTIPROC_ENV] = str(metrics_dir)
    try:
        yield metrics_dir
    finally:
        telemetry.remove_multiprocess_dir(metrics_dir)
        # Processes started later by this one must not inherit a directory that is gone.
        if before is None:
            os.environ.pop(telemetry.MULTIPROC_ENV, None)
        else:
            os.environ[telemetry.MULTIPROC_ENV] = before


def _listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that more sockets may share (SO_REUSEPORT): the kernel spreads new
    connections evenly over all of them."""
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off only on connections whose socket says
    # TCP, and with it on, a response written in two pieces (h11: head, then body) waits ~40 ms for an ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _api_process(sock: socket.socket, parent_pid: int, access_log: bool, log_level: str) -> None:
    """One server process of `loraplane api --workers N` or of `up`, on its own listening socket, within its own
    memory bound."""
    import uvicorn

    # SIGTERM (uvicorn's graceful shutdown) when the parent dies, even by SIGKILL: no server process is left
    # serving beside a restarted `loraplane api` (SO_REUSEPORT would let both listen on the port).
    _signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        return
    _limit_api_memory()
    uvicorn.Server(uvicorn.Config("api.main:app", log_level=log_level, access_log=access_log)).run(sockets=[sock])


def _serve_api_processes(host: str, port: int, workers: int, metrics_dir: Path, access_log: bool,
                         log_level: str = "info") -> None:
    """`workers` server processes, each on a socket of its own, each started again when it dies (the memory bound
    may end one: `_limit_api_memory`): with uvicorn's `workers=N` they share one socket, and whichever process
    wakes first accepts a whole burst of connections (asyncio accepts up to the backlog at once) and keeps them
    while they are kept alive; measured under wrk, all 32 of 32 went to one process. Each process is a fresh
    interpreter (spawn): its own database engines, event loop and SSE watch. Returns on SIGINT or SIGTERM, once
    the processes have stopped."""
    import multiprocessing

    from common.telemetry import mark_process_dead

    context = multiprocessing.get_context("spawn")
    try:
        sockets = [_listening_socket(host, port) for _ in range(workers)]  # a port in use fails here, at once
    except OSError as exc:
        raise SystemExit(f"loraplane: cannot listen on {host}:{port}: {exc.strerror or exc}") from None

    def start(sock: socket.socket) -> multiprocessing.process.BaseProcess:
        process = context.Process(target=_api_process, args=(sock, os.getpid(), access_log, log_level),
                                  name="loraplane-api")
        process.start()
        return process

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    processes = [start(sock) for sock in sockets]
    log.info("API on http://%s:%s: %d server processes (%s)", host, port, workers,
             ", ".join(str(p.pid) for p in processes))
    while not stop.wait(1.0):
        for i, process in enumerate(processes):
            if not process.is_alive():
                log.warning("API process %s exited with %s; starting another", process.pid, process.exitcode)
                mark_process_dead(int(process.pid or 0), metrics_dir)
                processes[i] = start(sockets[i])
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def _scheduler(stop: threading.Event) -> None:
    from common.bus import get_bus
    from common.celery import get_celery
    from common.settings import get_settings
    from scheduler.service.daemon import SchedulerDaemon

    SchedulerDaemon(get_settings(), get_bus(), get_celery()).run(stop)


def cmd_scheduler(_args: argparse.Namespace) -> None:
    with _embedded_data_folder("scheduler", ("scheduler",)):
        _require_secret_key()
        _migrate()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            _scheduler(stop)
        except KeyboardInterrupt:
            stop.set()


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU indices") from None
    if len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices must be distinct and not negative")
    return gpus


def cmd_worker(args: argparse.Namespace) -> None:
    from worker.main import run_worker

    watch_supervisor()
    report_ready_to_supervisor()
    if args.quiet:
        # `up` prints one box when everything answers: Celery's own start-up lines would only repeat it.
        for name in ("celery.apps.worker", "celery.worker.consumer.connection", "kombu.connection"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if args.hollow:
        _run_hollow(args)
        return
    gpus = args.gpus if args.gpus is not None else ([args.gpu] if args.gpu is not None else None)
    run_worker(gpus=gpus, worker_id=args.worker_id, loglevel=args.loglevel, quiet=args.quiet)


def _run_hollow(args: argparse.Namespace) -> None:
    """`loraplane worker --hollow`: hollow workers (worker/hollow/), the real shell around a timing model."""
    from worker.hollow.curves import DEFAULT_CURVES_DIR
    from worker.hollow.main import HollowOptions, run_hollow_workers

    options = HollowOptions(count=args.count, prefix=args.worker_id or "", gpu_kind=args.gpu_kind,
                            memory_gb=args.memory_gb, slots=args.slots, max_packs=args.max_packs,
                            time_scale=args.time_scale, noise=args.noise, curves_dir=args.curves or DEFAULT_CURVES_DIR)
    run_hollow_workers(options, loglevel=args.loglevel, quiet=args.quiet)


def _add_hollow_arguments(worker: argparse.ArgumentParser) -> None:
    hollow = worker.add_argument_group("hollow workers (docs/operator-guide.md, \"Hollow workers\")")
    hollow.add_argument("--hollow", action="store_true",
                        help="run hollow workers: the worker's real shell with training replaced by the cost model's "
                             "step times and losses replayed from recorded sweeps (no GPU, no trained adapter); "
                             "--worker-id is then their ids' prefix (<prefix>-0, <prefix>-1, ...)")
    hollow.add_argument("--count", type=int, default=1, help="hollow workers in this process (default 1)")
    hollow.add_argument("--gpu-kind", default="H200", help="the GPU kind they advertise (default H200)")
    hollow.add_argument("--memory-gb", type=float, default=141.0, help="each one's GPU memory in GB (default 141)")
    hollow.add_argument("--slots", type=int, default=32, help="each one's most trials in a pack (default 32)")
    hollow.add_argument("--max-packs", type=int, default=2, help="each one's most packs at once (default 2)")
    hollow.add_argument("--time-scale", type=float, default=1.0,
                        help="simulated seconds per wall second: 10 runs a step 10x faster than predicted (default 1)")
    hollow.add_argument("--noise", type=float, default=0.05,
                        help="relative standard deviation of each step's time (default 0.05)")
    hollow.add_argument("--curves", type=Path, default=None,
                        help="a directory of recorded sweeps (*-full*.jsonl) to replay (default: the repository's "
                             "benchmarks/results/sweeps)")


def cmd_simulate(args: argparse.Namespace) -> None:
    # Only the pure planner modules: runs with the base dependencies (OR-Tools, numpy), no database or torch.
    from scheduler.planning.fairness import FairnessPolicy
    from scheduler.sim.bounds import bounded_summary
    from scheduler.sim.simulate import POLICIES, simulate
    from scheduler.sim.traces import make_trace

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"unknown policy {unknown or args.policy!r}; choose from {','.join(POLICIES)}")
    if args.load is not None and (args.trace == "alto-mix" or args.load <= 0):
        raise SystemExit("--load takes a positive number and applies to the streams (tenant-stream, shared-gpu)")
    trace = make_trace(args.trace, args.seed, args.gpus, args.tasks, args.load)
    fairness = FairnessPolicy() if args.preempt else None
    # Shares are judged over the fairness policy's window, preempting or not (the same window either way).
    window_s = (fairness or FairnessPolicy()).window_s
    rows = [bounded_summary(trace, args.gpus, simulate(trace, args.gpus, p, time_limit_s=args.time_limit,
                                                       seed=args.seed, makespan_weight=args.makespan_weight,
                                                       fairness=fairness), window_s) for p in policies]
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    headers = ["policy", "makespan_s", "mean_jct_s", "p95_jct_s", "gpu_util", "replan_p95_ms", "replans",
               "unschedulable", "preempted", "share_gap_max"]
    cells = [headers] + [[f"{r[h]:.4g}" if isinstance(r[h], float) else str(r[h]) for h in headers] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    load = f", load {0.9 if args.load is None else args.load:g}" if args.trace != "alto-mix" else ""
    load += ", preemption (scheduler/planning/fairness.py)" if args.preempt else ""
    bounds = (f"lower bounds (no policy does better): makespan {rows[0]['makespan_lower_bound_s']:.4g} s, "
              f"mean JCT {rows[0]['mean_jct_lower_bound_s']:.4g} s")
    sys.stdout.write(f"trace {trace.name}, {args.gpus} GPUs{load}, seed {args.seed}\n" + "\n".join(lines) + "\n"
                     + bounds + "\n")


def _param(text: str) -> tuple[str, object]:
    """`--param name=value`: the value as JSON (2, 0.1), else as the string given."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def cmd_replay(args: argparse.Namespace) -> None:
    # Pure modules only: no database, no torch.
    from scheduler.early_exit.config import EarlyExitSpecError, from_spec
    from scheduler.sim.replay import CurvesFormatError, format_report, read_curves, replay

    try:
        config = from_spec({"policy": args.policy, **dict(args.param)})
    except EarlyExitSpecError as exc:
        raise SystemExit(f"loraplane replay: --param {exc}") from None
    try:
        sweep = read_curves(args.curves)
    except CurvesFormatError as exc:
        where = f"{args.curves}:{exc.line}" if exc.line else args.curves
        raise SystemExit(f"loraplane replay: {where}: {exc.message}") from None
    except OSError as exc:
        raise SystemExit(f"loraplane replay: {args.curves}: {exc.strerror or exc}") from None
    result = replay(config, sweep)
    if args.json:
        sys.stdout.write(json.dumps(result.summary()) + "\n")
    else:
        sys.stdout.write(format_report(result, args.curves, config, sweep))


SUPERVISOR_PID_ENV = "LORAPLANE_SUPERVISOR_PID"
# A pipe `up` gives its worker: the worker writes a byte into it once Celery consumes its queue.
READY_FD_ENV = "LORAPLANE_READY_FD"


def _signal_on_parent_death(sig: signal.Signals) -> None:
    """On Linux, this process gets `sig` when its parent dies, even by SIGKILL (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, sig)


def _die_with_parent() -> None:
    """Runs in the child before exec: the worker is killed when `loraplane up` dies, even by SIGKILL, so no
    orphaned worker keeps training for a service that is gone (and no second worker with the same id shares
    the GPU after `up` restarts). SIGKILL, not SIGTERM: SIGTERM's drain hands the trials back to a scheduler,
    and `up`'s died with it; the next scheduler resumes them from their checkpoints instead."""
    _signal_on_parent_death(signal.SIGKILL)


def watch_supervisor() -> None:
    """In a worker started by `up` (which names itself in the environment): exit at once when `up` is gone.
    The same guarantee as `_die_with_parent` where prctl does not exist."""
    expected = os.environ.get(SUPERVISOR_PID_ENV)
    if not expected:
        return

    def watch() -> None:
        while os.getppid() == int(expected):
            time.sleep(1.0)
        log.error("loraplane up (pid %s) is gone; this worker exits with it", expected)
        os._exit(1)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def report_ready_to_supervisor() -> None:
    """In a worker started by `up`: tell `up` (through the pipe it gave) when Celery is ready to take packs, so
    `up` prints its box after that, not before."""
    fd_text = os.environ.pop(READY_FD_ENV, None)  # popped: the worker's own children get no copy
    if fd_text is None:
        return
    from celery.signals import worker_ready

    fd = int(fd_text)

    def ready(**_: object) -> None:
        with contextlib.suppress(OSError):  # `up` is gone: the supervisor watch ends this process anyway
            os.write(fd, b"1")
            os.close(fd)

    worker_ready.connect(ready, weak=False)


class _Supervised:
    """Keeps one child process running: a worker that crashes is started again under the same worker id.
    The new process's first heartbeat carries a new incarnation, so the scheduler ends the dead one's pack at
    once and requeues its trials from their checkpoints."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = threading.Event()  # the first process consumes its queue (a restarted one does not clear it)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # no child is started once stop() began
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                ready_r, ready_w = os.pipe()
                env = {**os.environ, SUPERVISOR_PID_ENV: str(os.getpid()), READY_FD_ENV: str(ready_w)}
                self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent, pass_fds=(ready_w,))
                os.close(ready_w)
            self._watch(self.proc, ready_r)
            if not self._stop.is_set():
                log.warning("worker exited with %s; restarting it in 2s", self.proc.returncode)
                self._stop.wait(2)

    def _watch(self, proc: subprocess.Popen[bytes], ready_r: int) -> None:
        """Until `proc` exits or stop(): sets `ready` when it writes into its pipe."""
        import select

        listening = True
        while proc.poll() is None and not self._stop.is_set():
            if not listening:
                time.sleep(0.5)
            elif select.select([ready_r], [], [], 0.5)[0]:
                if os.read(ready_r, 1):
                    self.ready.set()
                listening = False  # one byte, or the end of the pipe: nothing more will come
        os.close(ready_r)

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
        if self.proc and self.proc.poll() is None:
            from common.settings import get_settings

            self.proc.terminate()  # the worker drains (worker/drain.py): it exits within its drain's bound
            try:
                self.proc.wait(timeout=get_settings().worker_drain_s + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cmd_up(args: argparse.Namespace) -> None:
    from common.private_files import private_dir
    from common.settings import get_settings

    generated_token = None
    if not os.environ.get("LORAPLANE_ADMIN_TOKEN"):
        generated_token = os.environ["LORAPLANE_ADMIN_TOKEN"] = "lpadmin_" + secrets.token_urlsafe(24)
        get_settings.cache_clear()
    settings = get_settings()
    if settings.resolved_broker_url == "filesystem://":  # the embedded broker has no host: kombu warns each dispatch
        logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    private_dir(settings.home)  # 0700: the database, the bus and the artifacts below are the owner's alone
    with _embedded_data_folder("up", ("api", "scheduler")):
        _up(args, settings.home, generated_token)


def _up(args: argparse.Namespace, home: Path, generated_token: str | None) -> None:
    """`up` once it holds its data folder: the scheduler in a thread, the worker and the API server in supervised
    child processes (each started again if it dies), until SIGINT or SIGTERM."""
    _require_secret_key()  # embedded: generated into the home on first start
    _migrate()
    stop = threading.Event()
    scheduler = threading.Thread(target=_scheduler, args=(stop,), name="scheduler", daemon=True)
    scheduler.start()
    worker = None
    if not args.no_worker:
        worker_argv = [sys.executable, "-m", "loraplane.cli", "worker", "--worker-id", args.worker_id, "--quiet"]
        worker = _Supervised(worker_argv)
        worker.start()
    lines = up_summary(f"http://{args.host}:{args.port}", home.resolve(), generated_token,
                       None if args.no_worker else args.worker_id)
    announcer = threading.Thread(target=_announce_when_ready, name="announcer", daemon=True, args=(
        _loopback_url(args.host, args.port), worker.ready if worker else None, lines, stop))
    announcer.start()
    try:
        # The API in a process of its own, apart from the scheduler and the worker: its memory bound ends only
        # itself, and a server process that dies is started again (issue 52). Warnings and errors only: the box
        # says where the API is, and the access log is off unless asked for.
        with _api_metrics_dir() as metrics_dir:
            _serve_api_processes(args.host, args.port, 1, metrics_dir, _access_log(args), log_level="warning")
    finally:
        stop.set()
        if worker is not None:
            worker.stop()
        scheduler.join(timeout=10)


# How long `up` waits for its worker to take packs before it prints its box anyway (saying the worker is not ready):
# the admin token must not wait on a worker that cannot start.
WORKER_READY_WAIT_S = 180.0


def up_summary(url: str, home: Path, generated_token: str | None, worker_id: str | None) -> list[str]:
    """The lines of `up`'s closing box: where everything is, and the admin token when this run generated it."""
    lines = ["loraplane is up", "", f"  API        {url}   (reference: {url}/docs)", f"  dashboard  {url}/"]
    if worker_id is not None:
        lines.append(f"  worker     {worker_id} (this machine)")
    lines.append(f"  data       {home}   (LORAPLANE_HOME)")
    lines.append("")
    if generated_token is None:
        lines.append("  admin token: the one in LORAPLANE_ADMIN_TOKEN")
    else:
        lines += ["  admin token, generated for this run (set LORAPLANE_ADMIN_TOKEN to keep one):",
                  f"    {generated_token}"]
    lines += ["", "Ctrl+C stops the API, the scheduler and the worker."]
    return lines


def framed(lines: list[str]) -> str:
    """`lines` in an ASCII frame, so the box stands out among log lines."""
    width = max(len(line) for line in lines)
    rule = "+" + "-" * (width + 2) + "+"
    return "\n".join([rule, *(f"| {line.ljust(width)} |" for line in lines), rule]) + "\n"


def _loopback_url(host: str, port: int) -> str:
    """Where this machine reaches an API listening on host:port (a wildcard address is reached on loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announce_when_ready(url: str, worker_ready: threading.Event | None, lines: list[str],
                         stop: threading.Event) -> None:
    """Prints the box once the API answers and the worker takes packs: the last lines of start-up, so the admin
    token stays on screen."""
    import httpx

    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                break
        stop.wait(0.2)
    deadline = time.monotonic() + WORKER_READY_WAIT_S
    while worker_ready is not None and not worker_ready.wait(0.5):
        if stop.is_set():
            return
        if time.monotonic() > deadline:
            lines = [*lines, "", f"The worker does not take packs yet after {WORKER_READY_WAIT_S:.0f}s: see the "
                                 "lines above."]
            break
    if not stop.is_set():
        sys.stdout.write("\n" + framed(lines))
        sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    from loraplane.commands import EXIT_CODES, register

    parser = argparse.ArgumentParser(prog="loraplane", description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the whole service in one process tree")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--worker-id", default="local")
    up.add_argument("--no-worker", action="store_true", help="run the API and the scheduler only")
    up.add_argument("--access-log", action="store_true",
                    help="log a line per HTTP request (or LORAPLANE_ACCESS_LOG=1; off by default)")
    up.set_defaults(func=cmd_up)
    api = sub.add_parser("api", help="run the HTTP control plane")
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--workers", type=_api_workers, default=1,
                     help="server processes sharing the port (default 1; 'auto': one per CPU core)")
    api.add_argument("--access-log", action="store_true",
                     help="log a line per HTTP request (or LORAPLANE_ACCESS_LOG=1; off by default)")
    api.set_defaults(func=cmd_api)
    sub.add_parser("scheduler", help="run the planner daemon").set_defaults(func=cmd_scheduler)
    worker = sub.add_parser("worker", help="run a GPU agent (Celery worker)")
    devices = worker.add_mutually_exclusive_group()
    devices.add_argument("--gpu", type=int, default=None, help="CUDA device index (CPU when CUDA is absent)")
    devices.add_argument("--gpus", type=_gpu_list, default=None,
                         help="several CUDA devices of this host, e.g. 0,1: each pack runs over all of them, its base "
                              "model sharded (without CUDA: a rank on the CPU for each)")
    worker.add_argument("--worker-id", default=None,
                        help="defaults to <hostname>-gpu<N> (<hostname>-gpu0-1 for --gpus 0,1)")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument("--quiet", action="store_true", help="no Celery banner or start-up lines (`up` passes it)")
    _add_hollow_arguments(worker)
    worker.set_defaults(func=cmd_worker)
    sub.add_parser("migrate", help="upgrade the database schema").set_defaults(func=cmd_migrate)
    sub.add_parser("rotate-secrets", help="re-encrypt stored secrets under the first key of LORAPLANE_SECRET_KEY "
                                          "(after putting a new key first)").set_defaults(func=cmd_rotate_secrets)
    sim = sub.add_parser("simulate", help="compare planner policies on a trace with a simulated clock")
    sim.add_argument("--trace", choices=["alto-mix", "tenant-stream", "shared-gpu", "contended"], default="alto-mix")
    sim.add_argument("--gpus", type=int, default=8)
    sim.add_argument("--policy", default="fifo,greedy,cpsat", help="comma list of fifo, greedy, cpsat, cpsat-wc")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per replan")
    sim.add_argument("--tasks", type=int, default=None,
                     help="tasks of a stream (default 200 for tenant-stream, 60 for shared-gpu, 45 for contended)")
    sim.add_argument("--load", type=float, default=None,
                     help="a stream's offered load, GPU-seconds of solo service per GPU-second (default 0.9)")
    sim.add_argument("--preempt", action=argparse.BooleanOptionalAction, default=True,
                     help="preempt packs for other tenants' waiting trials (scheduler/planning/fairness.py), as the "
                          "scheduler does by default (LORAPLANE_PREEMPT); --no-preempt turns it off")
    sim.add_argument("--makespan-weight", type=int, default=None,
                     help="weight of a replan's makespan in the planner objective (default 1 for a batch like "
                          "alto-mix, 0 for a stream like tenant-stream)")
    sim.add_argument("--json", action="store_true",
                     help="print a JSON list, one object per policy, each with the trace's lower bounds "
                          "(makespan_lower_bound_s, mean_jct_lower_bound_s) and its share_gap_max")
    sim.set_defaults(func=cmd_simulate)
    rep = sub.add_parser("replay", help="replay a logged sweep's curves under an early-exit policy")
    rep.add_argument("curves", help="JSONL, one trial a line (GET /v1/tasks/{id}/curves writes it; format in "
                                    "scheduler/sim/replay.py)")
    rep.add_argument("--policy", choices=["alto", "asha", "none"], default="alto")
    rep.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                     help="override one of the policy's parameters, e.g. warmup_ratio=0.1 (repeatable)")
    rep.add_argument("--json", action="store_true", help="print one JSON object: policy, trials, "
                     "samples_saved_frac, best_kept, best_val_ratio, spearman_warmup")
    rep.set_defaults(func=cmd_replay)
    register(sub)  # the client commands: login, files, models, tasks, admin
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (the client commands' codes are in `loraplane --help`)."""
    args = build_parser().parse_args(argv)
    if not getattr(args, "client", False):  # the client commands print their own lines, no log records
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("alembic").setLevel(logging.WARNING)  # a line per revision; _migrate says it in one
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request `up` makes to see the API answer
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
