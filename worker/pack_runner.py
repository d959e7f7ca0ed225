"""Runs one pack message on this worker: the shell around the training engine.

Pre-state: the scheduler recorded the pack and moved its trials to running. Post-state: the scheduler
has received, in order, `pack.started`, the trials' loss points (and `trial.checkpoint`s), one
`trial.finished` per trial as soon as that trial ended (with the adapter already in the artifact store),
`trial.admitted` / `trial.rejected` for each back-fill the scheduler sent while the pack ran,
`pack.profile` and `pack.finished` — or `pack.failed` with the error.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from common.artifacts import (
    LocalArtifactStore,
    adapter_key,
    checkpoint_key,
    saved_checkpoint_key,
    saved_checkpoint_step,
    saved_checkpoints_prefix,
)
from common.bus import BACKFILL_NOT_JOINED, Bus
from common.checkpoints import Saved, kept
from common.datasets import parse_jsonl, split_rows
from common.messages import (
    CheckpointSaved,
    PackFailed,
    PackFinished,
    PackMessage,
    PackProfile,
    PackProgress,
    PackRefused,
    PackStarted,
    TrialAdmitted,
    TrialCheckpoint,
    TrialCheckpointLost,
    TrialFinished,
    TrialPayload,
    TrialRejected,
)
from common.metrics import DEFAULT_MAX_NEW_TOKENS, DEFAULT_METRIC, SCORED_METRICS, score_answers
from common.regex_policy import SYNTAX, PatternRefused, check_pattern
from common.search_space import DEFAULT_DPO_BETA, DEFAULT_LR_SCHEDULE, warmup_steps_for
from common.settings import get_settings
from worker import telemetry
from worker.bus_client import CommandInbox, Reporter, ReportsLost
from worker.colocation import Reservation, RunningPacks
from worker.drain import DrainFlag
from worker.engine import (
    AdapterCheckpoint,
    Evaluation,
    ModelSource,
    NoScore,
    PackCallbacks,
    PackConfig,
    StepStats,
    TrialOutcome,
    TrialSpec,
    load_base_model,
    train_pack,
)
from worker.engine.base_model import base_dtype
from worker.engine.distributed import shard_base
from worker.engine.export import PeftFiles
from worker.engine.keeper import EngineKeeper
from worker.engine.spec import DpoObjective
from worker.engine.trainer import PackTimings, StopMode
from worker.heartbeat import BeatProgress, Heartbeat, Incarnation
from worker.model_cache import Loaded, ModelCache, cache_budget, device_memory, model_source
from worker.pack_processes import PackProcesses
from worker.profile import PackProfiler
from worker.rank_pool import RankPool, Ranks

log = logging.getLogger(__name__)

ADAPTER_UPLOADS = 4  # threads compressing and storing a pack's finished adapters side by side


def tar_dir(source_dir: Path, archive: Path, *, gzip: bool) -> Path:
    # Level 1: adapter weights are fp32 noise to gzip; higher levels cost seconds per adapter and save ~nothing.
    # Copied in 8 MiB pieces (tarfile's own are 16 KiB: a thousand GIL hand-overs an adapter, on the pack's writer
    # thread beside the training thread).
    with tarfile.open(archive, "w:gz", compresslevel=1) if gzip else tarfile.open(archive, "w") as tar:
        tar.copybufsize = 8 << 20  # type: ignore[attr-defined]  # an attribute of TarFile that typeshed omits
        for item in sorted(source_dir.iterdir()):
            tar.add(item, arcname=item.name)
    return archive


def store_tar(store: LocalArtifactStore, key: str, files: PeftFiles) -> int:
    """An adapter's files in memory stored at ``key`` as a plain tar (what ``untar`` reads), in one write and one
    fsync, published when whole; returns its size. A checkpoint written as a directory, archived and then copied into
    the store was three writes of it on the pack's writer thread."""
    return store.put_written(key, files.write_tar)


def untar(store: LocalArtifactStore, key: str, target: Path) -> Path:
    """The archive stored at ``key`` (``tar_dir``'s, compressed or not) unpacked into ``target``; returns it."""
    with store.open(key) as f, tarfile.open(fileobj=f, mode="r:*") as tar:
        tar.extractall(target, filter="data")
    return target


def epochs_kept(t: TrialPayload) -> int | None:
    """The epoch checkpoints the trial keeps besides its best and last (its task's ``training.epoch_checkpoints``;
    None: every one)."""
    value = t.training.get("epoch_checkpoints")
    return None if value is None else int(value)


def stop_modes(requested: dict[str, str]) -> dict[str, StopMode]:
    """The inbox's stop commands as ``train_pack`` takes them (an unknown mode from a newer scheduler drops)."""
    return {trial_id: cast(StopMode, mode if mode in ("drop", "export", "pause") else "drop")
            for trial_id, mode in requested.items()}


def drain_stops(requested: Mapping[str, StopMode], trial_ids: Iterable[str]) -> dict[str, StopMode]:
    """The stops of a draining worker's pack (worker/drain.py): every trial paused, but for those the scheduler
    already stopped (its mode wins: a trial it dropped stays dropped, one it paused at its warm-up boundary waits for
    its task's ranking)."""
    return {**dict.fromkeys(trial_ids, "pause"), **requested}


def export_base_name(source: ModelSource) -> str:
    """What an exported adapter names as ``base_model_name_or_path``: a registered directory as the workers
    see it (what PEFT itself writes for a model loaded from a directory), else the registry name."""
    return source.path if source.kind == "hf" and source.path else source.name


def evaluation_of(stored: dict[str, Any] | None, trial_id: str = "") -> Evaluation | None:
    """The trial's scored metric (generative, or a DPO trial's reward accuracy) from the task's stored `evaluation`
    (None: scored by its loss).

    A regex metric whose pattern the policy refuses (a task stored before common/regex_policy.py, or a row
    written around the API) is never compiled here: the trial goes without a metric score (ranked by its loss,
    as a trial whose scoring failed) and the log says why."""
    if not stored or stored.get("metric", DEFAULT_METRIC) not in SCORED_METRICS:
        return None
    pattern = stored.get("pattern")
    if stored["metric"] == "regex":
        try:
            if not isinstance(pattern, str):
                raise PatternRefused(SYNTAX, "the regex metric needs a pattern")
            check_pattern(pattern)
        except PatternRefused as exc:
            log.error("trial %s: its regex metric's pattern is refused (%s: %s); it is scored by nothing",
                      trial_id, exc.limit, exc)
            return None
    return Evaluation(metric=str(stored["metric"]),
                      max_new_tokens=int(stored.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                      pattern=pattern)


def dpo_objective(t: TrialPayload) -> DpoObjective | None:
    """A DPO trial's objective: its task's loss and label smoothing, its own beta (a dimension of its task's search
    space); None for an SFT trial."""
    if not t.objective or t.objective.get("type") != "dpo":
        return None
    return DpoObjective(beta=float(t.hyperparameters.get("beta", DEFAULT_DPO_BETA)),
                        loss=str(t.objective.get("loss", "sigmoid")),
                        label_smoothing=float(t.objective.get("label_smoothing", 0.0)))


def score_metric(evaluation: Evaluation, answers: list[str], references: list[str]) -> float:
    """A trial's generative metric as ``train_pack`` scores it: the share of its answers that pass
    (common/metrics.py). A regex pattern the policy refuses when compiled (``evaluation_of`` refuses most first;
    compiling may still refuse one, by recursion) raises ``NoScore``: the trial goes without a metric.
    """
    try:
        return score_answers(evaluation.metric, answers, references, evaluation.pattern)
    except PatternRefused as exc:
        raise NoScore(f"its pattern is refused ({exc})") from exc


class PackRunner:
    """Holds what outlives one pack: the loaded base models (loaded once per process) and the bus.

    On a worker over several GPUs (worker/rank_pool.py) each rank has one: rank 0's, in the worker process, has the
    heartbeat and the ``pool`` of the other ranks and runs each pack (``run``); the others run their share of it
    (``run_share``). A worker on one device that runs up to ``max_packs`` packs at once, within ``memory_bytes``
    (None: the device's), runs each in one of its pack ``processes`` (worker/pack_processes.py): each of those has
    a runner of its own, which runs the pack there (``run_here``) and bumps its ``progress`` in the heartbeat's
    shared state; ``shared_device`` tells it whether its pack ran beside another.
    """

    def __init__(self, *, worker_id: str, device: torch.device, bus: Bus, store: LocalArtifactStore,
                 model_cache_dir: Path, heartbeat: Heartbeat | None = None, incarnation: Incarnation | None = None,
                 ranks: Ranks | None = None, pool: RankPool | None = None, report_timeout_s: float = 30.0,
                 model_cache_bytes: int | None = None, max_packs: int = 1, memory_bytes: int | None = None,
                 processes: PackProcesses | None = None, progress: BeatProgress | None = None,
                 shared_device: Callable[[], bool] | None = None, drain: DrainFlag | None = None,
                 train: Callable[..., list[TrialOutcome]] = train_pack) -> None:
        self.worker_id = worker_id
        # The engine's `train_pack`, or one with its contract (a hollow worker's timing model: worker/hollow/), and
        # what the pack profiles it reports say besides their measurements (a hollow worker's departures).
        self.train = train
        self.profile_notes: dict[str, Any] = {}
        self.device = device
        self.bus = bus
        self.store = store
        self.model_cache_dir = model_cache_dir
        self.heartbeat = heartbeat
        self.progress: Heartbeat | BeatProgress | None = progress or heartbeat
        incarnation = incarnation or (heartbeat.incarnation if heartbeat is not None else None)
        assert incarnation is not None, "a runner reports under its worker process's incarnation"
        self.incarnation = incarnation
        self.ranks = ranks  # None: a worker on one device
        self.pool = pool  # rank 0 of a worker over several GPUs: the other ranks
        self.processes = processes  # a worker running several packs at once: its pack processes
        self.shared_device = shared_device or (lambda: False)
        self.drain = drain  # set once the worker drains on SIGTERM (worker/drain.py); None: it never does
        # How long a pack's end waits for its reports to reach a bus that is away (then they are dropped,
        # and the scheduler, past its heartbeat timeout, requeues the pack's trials from their checkpoints).
        self.report_timeout_s = report_timeout_s
        self.inbox = CommandInbox(bus, worker_id)
        # The last pack's engine and its captured graphs, for the next pack of the same model and shape (one
        # device only: a rank's engine is over sharded layers).
        self.engines = EngineKeeper()
        # The warm base models (worker/model_cache.py): LORAPLANE_WORKER_MODEL_CACHE_BYTES of them, or as many bytes
        # as ``model_cache_bytes`` says (0: the last pack's model alone, as a pack process keeps).
        budget = cache_budget(get_settings().worker_model_cache_bytes, device) if model_cache_bytes is None \
            else model_cache_bytes
        self.models = ModelCache(self._load_model, budget_bytes=budget, device=device, on_evict=self._model_evicted)
        self.packs = RunningPacks(max_packs=max_packs, memory_bytes=memory_bytes or device_memory(device))

    def model(self, source: ModelSource) -> Loaded:
        """The base model and tokenizer of ``source``: warm from an earlier pack (or the preload) of the same
        registry entry and files, else loaded now and kept for the packs (and back-fills) after this one."""
        return self.models.get(source)

    def _load_model(self, source: ModelSource) -> tuple[Any, Any]:
        log.info("loading base model %s on %s", source.name, self.device)
        if self.ranks is None:
            return load_base_model(source, cache_dir=self.model_cache_dir, device=self.device)
        # Loaded in host memory in the device's type, then sharded onto this rank's device layer by layer:
        # the GPU never holds more than its shards and one whole layer (a model larger than one GPU fits).
        loaded = load_base_model(source, cache_dir=self.model_cache_dir, device=torch.device("cpu"),
                                 dtype=base_dtype(self.device))
        shard_base(loaded[0], device=self.device)
        return loaded

    def _model_evicted(self, model: Any) -> None:
        """An evicted model's kept engine goes with it (it wraps the model's layers and holds device memory)."""
        if self.engines.holds(model):
            self.engines.drop()

    @staticmethod
    def trial_spec(t: TrialPayload, read_rows: Callable[[str], list[dict[str, Any]]]) -> TrialSpec:
        """The spec of a pack message's trial ``t``, its files read with ``read_rows`` (benchmarks build theirs here
        too, to train exactly what the worker trains)."""
        rows = read_rows(t.training_file_key)
        if t.validation_file_key:
            train, val = rows, read_rows(t.validation_file_key)
        elif t.validation_split:
            train, val = split_rows(rows, t.validation_split, t.split_seed)
        else:
            train, val = rows, []
        if t.refit:  # the winner's configuration again, on every row it was tuned with: nothing is held out
            train, val = train + val, []
        hp, training = t.hyperparameters, t.training
        targets = hp["target_modules"]  # a list of module names, or the string "all-linear"
        return TrialSpec(
            trial_id=t.trial_id,
            learning_rate=float(hp["learning_rate"]),
            lora_rank=int(hp["lora_rank"]),
            lora_alpha=float(hp["lora_alpha"]),
            lora_dropout=float(hp["lora_dropout"]),
            batch_size=int(hp["batch_size"]),
            target_modules=[targets] if isinstance(targets, str) else list(targets),
            seed=int(hp["seed"]),
            max_steps=t.total_steps,
            max_seq_len=t.max_seq_len,
            eval_interval=t.eval_interval,
            train_rows=train,
            val_rows=val,
            weight_decay=float(training.get("weight_decay", 0.0)),
            warmup_steps=warmup_steps_for(t.total_steps, training.get("warmup_steps")),
            lr_schedule=str(training.get("lr_schedule", DEFAULT_LR_SCHEDULE)),
            max_grad_norm=training.get("max_grad_norm"),
            use_rslora=bool(training.get("use_rslora", False)),
            extra_eval_steps=tuple(t.extra_eval_steps),
            evaluation=evaluation_of(t.evaluation, t.trial_id),
            # A task from before checkpoints (its training has no such key) has none.
            adapter_checkpoints=bool(training.get("checkpoints", False)),
            dpo=dpo_objective(t),
        )

    def run(self, pack: PackMessage) -> None:
        """Runs ``pack`` on this worker: here, or in one of its pack processes when it has them."""
        pack_id = pack.pack_id
        if not self.bus.claim(f"pack:{pack_id}"):
            log.warning("pack %s was already claimed; skipping the duplicate delivery", pack_id)
            return
        assert self.heartbeat is not None, "only the worker process (rank 0) runs packs"
        if self.draining():  # delivered as the worker began to drain: its trials wait again, no attempt spent
            self._refuse(pack_id, "the worker is shutting down")
            return
        refused = self.packs.reserve(Reservation(pack_id, pack.base_model.name, pack.memory_bytes or 0))
        if refused is not None:
            self._refuse(pack_id, refused)
            return
        # From here until its last report went out, every heartbeat names this pack (see Heartbeat).
        self.heartbeat.add_pack(pack_id)
        try:
            if self.processes is None:
                self.run_here(pack)
            else:
                slot = self.heartbeat.slot_of(pack_id)
                self.processes.run(pack, slot, self.packs.reserved_bytes(), self.packs.shared)
        finally:
            self.heartbeat.remove_pack(pack_id)
            self.packs.release(pack_id)
            if not self.packs.count():
                telemetry.pack_ended()

    def run_here(self, pack: PackMessage) -> None:
        """Runs ``pack`` in this process and reports it, from `pack.started` to `pack.finished` (or `pack.failed`)."""
        pack_id = pack.pack_id
        reporter = Reporter(self.bus, pack_id, self.worker_id, self.incarnation)
        try:
            reporter.send(PackStarted)
            self._train_on_every_rank(pack, reporter)
            reporter.send(PackFinished)
        except ReportsLost:
            # The bus has been away too long to keep the reports: stop. The next heartbeat names no pack, so
            # the scheduler requeues the trials from their checkpoints.
            log.exception("pack %s stopped: its reports could not be sent", pack_id)
        except Exception as exc:  # the pack failed as a whole (model or data would not load)
            log.exception("pack %s failed", pack_id)
            try:
                reporter.send(PackFailed, error=f"{type(exc).__name__}: {exc}")
            except ReportsLost:
                pass
        finally:
            reporter.close(self.report_timeout_s)

    def warm_models(self) -> list[dict[str, Any]]:
        """The warm base models of this process (what a pack process publishes to its worker process)."""
        return self.models.warm()

    def drop_warm_models(self) -> None:
        """Lets go of every warm model no pack holds (an idle pack process whose room a starting pack needs)."""
        self.models.drop_idle()

    def _refuse(self, pack_id: str, reason: str) -> None:
        """Nothing of the pack ran: the scheduler takes its trials back (worker/colocation.py)."""
        log.warning("pack %s refused: %s", pack_id, reason)
        reporter = Reporter(self.bus, pack_id, self.worker_id, self.incarnation)
        try:
            reporter.send(PackRefused, reason=reason)
        except ReportsLost:
            log.exception("pack %s: its refusal could not be sent", pack_id)
        finally:
            reporter.close(self.report_timeout_s)

    def _train_on_every_rank(self, pack: PackMessage, reporter: Reporter) -> None:
        """``_train`` here and, on a worker over several GPUs, on the other ranks too: they get the pack first, and
        it ends once each has ended its share (its reports went out, before the pack's end is reported)."""
        if self.pool is None:
            self._train(pack, reporter)
            return
        self.pool.hand_over(pack)
        try:
            self._train(pack, reporter)
        except BaseException:
            self._end_if_ranks_wait(pack.pack_id)  # failed while the ranks train: they would wait for ever
            raise
        finally:
            self.pool.wait(pack.pack_id)

    def run_share(self, pack: PackMessage) -> None:
        """A rank's share of a pack over several GPUs (rank 0 runs ``run``, which reports its start and end)."""
        reporter = Reporter(self.bus, pack.pack_id, self.worker_id, self.incarnation)
        try:
            self._train(pack, reporter)
        except Exception:  # noqa: BLE001 - rank 0 reports the pack's failure, which every rank agreed on
            log.exception("pack %s failed", pack.pack_id)
            self._end_if_ranks_wait(pack.pack_id)
        finally:
            reporter.close(self.report_timeout_s)

    def _end_if_ranks_wait(self, pack_id: str) -> None:
        """A rank that fails while the pack trains leaves the others waiting in a collective: end this process
        (worker/rank_pool.py says what follows)."""
        if self.ranks is not None and self.ranks.training:
            log.critical("pack %s failed on rank %d while training: this process ends", pack_id, self.ranks.rank)
            logging.shutdown()
            os._exit(1)

    def progressed(self, pack_id: str) -> None:
        """The pack moved on (a step, a validation, a trial's end, a phase): its heartbeat says so, and the scheduler
        ends a pack that stops moving for LORAPLANE_WORKER_STALL_S (worker/heartbeat.py)."""
        if self.progress is not None:
            self.progress.progressed(pack_id)

    def draining(self) -> bool:
        """Whether the worker drains (worker/drain.py): its trials pause at their next step and are handed back."""
        return self.drain is not None and self.drain.is_set()

    def should_stop(self, pack_id: str, trial_ids: Iterable[str]) -> dict[str, StopMode]:
        """The trials to take out now: those the scheduler stopped, or all of them once it aborted the pack."""
        if self.inbox.aborted(pack_id):
            return dict.fromkeys(trial_ids, "drop")
        return stop_modes(self.inbox.stopped_trials(pack_id))

    def _train(self, pack: PackMessage, reporter: Reporter) -> None:
        pack_id, ranks = pack.pack_id, self.ranks
        source = model_source(pack.base_model.model_dump())
        trials = pack.trials if ranks is None else ranks.mine(pack.trials)
        task_of = {t.trial_id: t.task_id for t in trials}
        # The trials of one task share their files: read and parse each once per pack.
        read_rows = functools.cache(lambda key: parse_jsonl(self.store.get_bytes(key)))
        leads = ranks is None or ranks.rank == 0  # reports the pack's steps, profile and refused back-fills
        profiler = PackProfiler(device=str(self.device))
        timings = PackTimings()
        with self._holding_model(source), tempfile.TemporaryDirectory(prefix=f"{pack_id}-") as tmp_name:
            tmp = Path(tmp_name)
            set_up_started = time.perf_counter()
            (model, tokenizer), specs, resume = self._set_up(source, trials, read_rows, tmp / "resume", reporter,
                                                             timings)
            self.progressed(pack_id)  # the model loaded, the trials set up: a phase done
            # The pack's wall time runs from its start here: the load (load_s) and the rest of the set-up (in
            # other_s) are part of what its trials wait for; train_pack adds its own.
            timings.wall_s += time.perf_counter() - set_up_started
            calls = _PackCallbacks(self, pack_id, reporter, tmp, task_of, read_rows, profiler)
            calls.epochs_kept.update({t.trial_id: epochs_kept(t) for t in trials})
            with calls.storing_adapters(timings):
                self._train_pack(pack, model, tokenizer, specs, resume, source, tmp, calls, timings, leads)
            refused = self.inbox.drain_admissions(pack_id)  # each rank's inbox saw them; rank 0 answers
            for t in refused if leads else []:
                reporter.send(TrialRejected, trial_id=t.trial_id, reason=BACKFILL_NOT_JOINED)
        if ranks is not None:
            ranks.training = False
        if leads:
            gpus = {} if ranks is None else {"gpus": ranks.world}
            # A pack that shared the GPU with another measured the pair: the cost model leaves it out.
            shared = {"shared_device": True} if self.shared_device() or self.packs.shared(pack_id) else {}
            reporter.send(PackProfile, profile={**profiler.summary(), **gpus, **shared, **self.profile_notes,
                                                "phases": timings.summary()})
            telemetry.pack_profiled(timings.summary())  # the phase counters of the worker's metrics

    @contextmanager
    def _holding_model(self, source: ModelSource) -> Iterator[None]:
        """The pack's base model (taken in ``_set_up``) stays warm while it runs, whatever another pack loads."""
        try:
            yield
        finally:
            self.models.release(source.name)

    def _train_pack(self, pack: PackMessage, model: Any, tokenizer: Any, specs: list[TrialSpec],
                    resume: dict[str, Path], source: ModelSource, tmp: Path, calls: _PackCallbacks,
                    timings: PackTimings, leads: bool) -> None:
        pack_id, ranks, task_of = pack.pack_id, self.ranks, calls.task_of
        config = PackConfig(
            base_model_name=export_base_name(source), export_dir=tmp / "adapters", checkpoint_dir=tmp / "checkpoints",
            # Snapshots to host memory on a time policy; the writer uploads them (upload_checkpoint).
            checkpoint_interval_s=get_settings().checkpoint_interval_s,
            capacity=pack.capacity if ranks is None else ranks.capacity(pack.capacity),
            max_rank=pack.max_rank, target_modules=pack.target_modules,
        )
        callbacks = PackCallbacks(
            on_point=calls.point, should_stop=lambda: calls.stops(self.should_stop(pack_id, task_of)),
            on_step=calls.stepped if leads else None, on_checkpoint=calls.upload_checkpoint,
            on_adapter_checkpoint=calls.save_checkpoint,
            admissions=calls.admissions, on_admitted=calls.admitted, on_outcome=calls.finished, score=score_metric,
        )
        self.train(model, tokenizer, specs, config, callbacks, resume=resume, timings=timings,
                   lockstep=None if ranks is None else ranks.lockstep, keeper=self.engines if ranks is None else None)

    def _set_up(self, source: ModelSource, trials: list[TrialPayload],
                read_rows: Callable[[str], list[dict[str, Any]]], resume_into: Path, reporter: Reporter,
                timings: PackTimings) -> tuple[tuple[Any, Any], list[TrialSpec], dict[str, Path]]:
        """The base model (warm, or loaded: its seconds are the pack's ``load_s``), the trials' specs and the
        checkpoints they resume from. On a worker over several GPUs the ranks then agree that each has its own
        before the first pass (a rank that has not fails the pack on every rank)."""
        try:
            loaded = self.models.get(source, hold=True)  # released by `_holding_model`
            timings.load_s = loaded.load_s
            specs, trials = self._trial_specs(trials, read_rows, reporter)
            resume = self._fetch_checkpoints(trials, resume_into, reporter)
        except Exception as exc:
            if self.ranks is None:
                raise
            self.ranks.ready(exc)
        if self.ranks is not None:
            self.ranks.ready(None)
        return (loaded.model, loaded.tokenizer), specs, resume

    def _trial_specs(self, trials: list[TrialPayload], read_rows: Callable[[str], list[dict[str, Any]]],
                     reporter: Reporter) -> tuple[list[TrialSpec], list[TrialPayload]]:
        """The specs of the trials whose data could be read, and those trials. A trial whose files parse wrong or
        whose spec is malformed fails alone, reported as its own failure (the scheduler spends one of its attempts);
        the pack goes on with the others. A store that cannot be read (OSError) fails the pack: that is no trial's
        doing, and the scheduler charges the worker instead (scheduler/service/faults.py)."""
        specs, kept = [], []
        for t in trials:
            try:
                specs.append(self.trial_spec(t, read_rows))
            except OSError:
                raise
            except Exception as exc:
                log.warning("trial %s failed during set-up: %s", t.trial_id, exc)
                reporter.send(TrialFinished, trial_id=t.trial_id, status="failed", steps_done=0,
                              error=f"{type(exc).__name__}: {exc}")
                continue
            kept.append(t)
        return specs, kept

    def _fetch_checkpoints(self, trials: list[TrialPayload], into: Path, reporter: Reporter) -> dict[str, Path]:
        """Unpacks the checkpoint of every trial that resumes (a requeued trial that had one). A checkpoint that
        is gone (the database lagged behind the worker that replaced it, during an outage) costs that trial
        its progress, not the pack: it starts again from step 0, and `trial.checkpoint_lost` tells the
        scheduler to cut its curve back to nothing."""
        resume: dict[str, Path] = {}
        for t in trials:
            key = t.resume_key
            if not key:
                continue
            if not self.store.exists(key):
                log.warning("trial %s: its checkpoint %s is gone; it starts again from step 0", t.trial_id, key)
                reporter.send(TrialCheckpointLost, trial_id=t.trial_id, checkpoint_key=key)
                continue
            target = into / t.trial_id
            target.mkdir(parents=True)
            try:
                untar(self.store, key, target)
            except tarfile.TarError as exc:  # a torn or corrupt archive: as good as gone (and no one pack's fault)
                log.warning("trial %s: its checkpoint %s cannot be unpacked (%s); it starts again from step 0",
                            t.trial_id, key, exc)
                reporter.send(TrialCheckpointLost, trial_id=t.trial_id, checkpoint_key=key)
                shutil.rmtree(target, ignore_errors=True)
                continue
            resume[t.trial_id] = target
        return resume


class _PackCallbacks:
    """What ``train_pack`` calls back while one pack trains: checkpoint and adapter uploads, back-fills and the
    reports on them and on each step. ``task_of`` (trial id -> task id) is the pack's, and grows with each
    back-fill taken."""

    def __init__(self, runner: PackRunner, pack_id: str, reporter: Reporter, tmp: Path, task_of: dict[str, str],
                 read_rows: Callable[[str], list[dict[str, Any]]], profiler: PackProfiler) -> None:
        self.runner = runner
        self.pack_id = pack_id
        self.reporter = reporter
        self.tmp = tmp
        self.task_of = task_of
        self.read_rows = read_rows
        self.profiler = profiler
        self.written: dict[str, list[str]] = {}  # trial id -> its checkpoints' keys in the store, oldest first
        self.epochs_kept: dict[str, int | None] = {}  # trial id -> the epoch checkpoints it keeps (None: all)
        self.drained: set[str] = set()  # the trials the worker's drain paused (worker/drain.py)
        self._uploads = ThreadPoolExecutor(max_workers=ADAPTER_UPLOADS, thread_name_prefix="adapter-upload")
        self._pending: list[Future[None]] = []

    def upload_checkpoint(self, trial_id: str, step: int, path: Path) -> None:
        """On the pack's writer thread (worker/engine/writer.py), for each snapshot it persists: only the newest
        snapshot of a trial waits for it, so a slow store costs checkpoints, never training steps."""
        key = checkpoint_key(self.task_of[trial_id], trial_id, step)
        self.runner.store.put_file(key, tar_dir(path, self.tmp / f"{trial_id}.ckpt.tar", gzip=False))
        self.reporter.send(TrialCheckpoint, trial_id=trial_id, step=step, checkpoint_key=key)
        # Keep the newest two: the scheduler may not have ingested the newest report yet, and the
        # one before it is what the database points at meanwhile.
        keys = self.written.setdefault(trial_id, [])
        if key in keys:  # the same step again (a pause right after a periodic snapshot): one key, held once
            keys.remove(key)
        keys.append(key)
        while len(keys) > 2:
            self.runner.store.delete(keys.pop(0))

    def save_checkpoint(self, saved: AdapterCheckpoint) -> None:
        """On the pack's writer thread, for each adapter checkpoint the trainer exports: stored, reported, and the
        trial's stored checkpoints it no longer keeps deleted (common/checkpoints.py). Those of a run lost after this
        step (a trial resumed from an older snapshot) are dropped: its steps come again."""
        trial_id, step, store = saved.trial_id, saved.step, self.runner.store
        task_id = self.task_of[trial_id]
        key = saved_checkpoint_key(task_id, trial_id, step)
        size = store_tar(store, key, saved.files)
        steps = [saved_checkpoint_step(k) for k in store.keys(saved_checkpoints_prefix(task_id, trial_id))]
        keep = kept([Saved(s, saved.ends_epoch(s), None) for s in steps if s <= step],
                    epochs_kept=self.epochs_kept.get(trial_id), best=saved.best_step)
        dropped = sorted(s for s in steps if s not in keep)
        self.reporter.send(CheckpointSaved, trial_id=trial_id, step=step, epoch=saved.epoch,
                           epoch_end=saved.ends_epoch(step), val_loss=saved.val_loss, adapter_key=key,
                           size_bytes=size, dropped_steps=dropped)
        for s in dropped:  # after the report: a listing may name one for a moment, never lose a kept one
            store.delete(saved_checkpoint_key(task_id, trial_id, s))

    def admissions(self, free: int) -> list[tuple[TrialSpec, Path | None]]:
        """Back-fills the scheduler sent for this pack, as many as there are free slots (on a worker over several
        GPUs: this rank's share of them, `Ranks.share_admissions`)."""
        runner, reporter = self.runner, self.reporter
        taken: list[tuple[TrialSpec, Path | None]] = []

        def take(n: int) -> list[TrialPayload]:  # a draining worker's pack takes none: refused at its end instead
            return [] if runner.draining() else runner.inbox.take_admissions(self.pack_id, n)

        waiting = take(free) if runner.ranks is None else runner.ranks.share_admissions(free, take)
        for t in waiting:
            try:
                spec = runner.trial_spec(t, self.read_rows)
                path = runner._fetch_checkpoints([t], self.tmp / "resume", reporter).get(t.trial_id)
            except Exception as exc:  # its files or its checkpoint cannot be read
                reporter.send(TrialRejected, trial_id=t.trial_id, reason=f"{type(exc).__name__}: {exc}")
                continue
            self.task_of[t.trial_id] = t.task_id
            self.epochs_kept[t.trial_id] = epochs_kept(t)
            taken.append((spec, path))
        return taken

    def stops(self, requested: dict[str, StopMode]) -> dict[str, StopMode]:
        """The trials to take out now: the scheduler's ``requested`` stops and, once the worker drains, a pause of
        every other trial, which is then handed back (``drained`` in its report)."""
        if not self.runner.draining():
            return requested
        stops = drain_stops(requested, self.task_of)
        self.drained.update(trial_id for trial_id in stops if trial_id not in requested)
        return stops

    def admitted(self, trial_id: str, reason: str | None) -> None:
        if reason is None:
            self.reporter.send(TrialAdmitted, trial_id=trial_id)
        else:
            self.reporter.send(TrialRejected, trial_id=trial_id, reason=reason)

    @contextmanager
    def storing_adapters(self, timings: PackTimings) -> Iterator[None]:
        """While the pack trains, finished trials' adapters are compressed, stored and reported on
        ``ADAPTER_UPLOADS`` threads side by side; on the way out (an exception included) the pack waits for them
        (its ``idle_s``, part of its wall time) and raises the first that failed. One writer thread compressed them
        one by one: a 1B pack's last eight adapters held its end 10 s (H200, 2026-11-26); zlib lets go of the GIL."""
        try:
            yield
        finally:
            started = time.perf_counter()
            self._uploads.shutdown(wait=True)
            waited = time.perf_counter() - started
            timings.idle_s += waited
            timings.wall_s += waited
            for upload in self._pending:
                upload.result()

    def finished(self, outcome: TrialOutcome) -> None:
        """The trial's adapter stored and its end reported, on an upload thread (its slot frees now)."""
        self.runner.progressed(self.pack_id)
        self._pending.append(self._uploads.submit(self._store_and_report, outcome))

    def _store_and_report(self, outcome: TrialOutcome) -> None:
        """Reported once the trial's adapter is stored."""
        key = None
        if outcome.adapter_dir is not None:  # completed, or stopped early with its best adapter saved
            key = adapter_key(self.task_of[outcome.trial_id], outcome.trial_id)
            archive = tar_dir(outcome.adapter_dir, self.tmp / f"{outcome.trial_id}.tar.gz", gzip=True)
            self.runner.store.put_file(key, archive)
            telemetry.adapter_uploaded()
        self.reporter.send(
            TrialFinished, trial_id=outcome.trial_id, status=outcome.status,
            steps_done=outcome.steps_done, best_val_loss=outcome.best_val_loss,
            best_step=outcome.best_step, final_train_loss=outcome.final_train_loss,
            adapter_key=key, error=outcome.error, pack_steps=outcome.pack_steps,
            pack_tokens=outcome.pack_tokens,
            drained=True if outcome.status == "paused" and outcome.trial_id in self.drained else None,
        )

    def point(self, trial_id: str, step: int, split: str, loss: float) -> None:
        """A trial's train step, validation or metric: reported, and progress for the heartbeat."""
        self.reporter.point(trial_id, step, split, loss)
        self.runner.progressed(self.pack_id)

    def stepped(self, stats: StepStats) -> None:
        self.runner.progressed(self.pack_id)
        self.profiler.record(stats)
        telemetry.observe_step(stats)
        progress = self.profiler.take_progress()
        if progress is not None:  # the scheduler corrects its step-time predictions with it
            self.reporter.send(PackProgress, **progress)
