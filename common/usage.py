"""Usage accounting: GPU seconds and tokens per trial, task and tenant (issue 18).

A pack holds its worker's GPUs (one, or several of one host: `Pack.gpus`) from its start to its end (or until now,
while it runs): its GPU seconds are its seconds times its GPUs. They are shared among the
trials it trained by the real tokens each trained there, as their workers reported when the trial left the pack
(`trial_usage`, one row per trial per stay); a pack with no such report (still running) shares its time equally
among the trials placed in it. So the trials' GPU seconds add up exactly to the packs' time.
Over a window [start, end) a pack counts only the part of its time inside the window. Packs side by side on one
worker (issue 34: a worker on one GPU runs packs of several base models at once) share its GPU: while k of them run,
each counts 1/k of the time (`split_overlaps`), so a GPU second is billed once however many packs it served.

Each step is counted once, whatever happens to the pack: a lost pack's time ends when it was declared lost (its
process may train on, unheard, until it learns so: that time is no one's bill), it records no tokens (its trials
went back to pending and train those steps again in another pack, which counts them: scheduler/service/ingest.py),
and its time is shared equally among its trials (the reports of those it lost never came).

`share_pack` is the pure rule; the rest reads the database.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from common import states
from common.tables import Checkpoint, File, Pack, SamplingUsage, Task, Trial, TrialUsage, as_utc, utcnow


def share_pack(seconds: float, trial_ids: Sequence[str], tokens: Mapping[str, int]) -> dict[str, float]:
    """A pack's `seconds` shared among `trial_ids` by their `tokens` (trials without a report get none of it);
    equally when no trial trained a reported token.

    >>> share_pack(10.0, ["a", "b"], {"a": 300, "b": 100})
    {'a': 7.5, 'b': 2.5}
    >>> share_pack(10.0, ["a", "b"], {})
    {'a': 5.0, 'b': 5.0}
    """
    if not trial_ids:
        return {}
    total = sum(tokens.get(t, 0) for t in trial_ids)
    if total <= 0:
        return {t: seconds / len(trial_ids) for t in trial_ids}
    return {t: seconds * tokens.get(t, 0) / total for t in trial_ids}


def split_overlaps(spans: Sequence[tuple[str, float, float]]) -> dict[str, float]:
    """Each span's (key, start, end) seconds, the time it overlapped others split equally among them: while k spans
    are live each counts 1/k. The result adds up to the union of the spans.

    >>> split_overlaps([("a", 0.0, 10.0), ("b", 5.0, 15.0), ("c", 20.0, 21.0)])
    {'a': 7.5, 'b': 7.5, 'c': 1.0}
    """
    out = {key: 0.0 for key, _, _ in spans}
    edges = sorted((t, is_start, key) for key, start, end in spans if end > start
                   for t, is_start in ((start, True), (end, False)))
    live: set[str] = set()
    last = None
    for t, is_start, key in edges:
        if live and last is not None and t > last:
            for k in live:
                out[k] += (t - last) / len(live)
        last = t
        if is_start:
            live.add(key)
        else:
            live.discard(key)
    return out


def clip(start: datetime, end: datetime, window: tuple[datetime | None, datetime | None]) -> tuple[datetime, datetime]:
    """[start, end) cut to the window (an open end: unbounded); empty ones as (lo, lo)."""
    lo = max(start, window[0]) if window[0] is not None else start
    hi = min(end, window[1]) if window[1] is not None else end
    return lo, max(lo, hi)


def overlap_s(start: datetime, end: datetime, window: tuple[datetime | None, datetime | None]) -> float:
    """Seconds of [start, end) inside the window (an open end: unbounded)."""
    lo, hi = clip(start, end, window)
    return (hi - lo).total_seconds()


@dataclass
class Usage:
    """One tenant's (or task's) usage."""

    gpu_seconds: float = 0.0
    tokens: int = 0
    trials: dict[str, int] = field(default_factory=dict)  # ended trials by final state
    storage_bytes: int = 0  # live uploaded files and kept checkpoints, now
    checkpoint_bytes: int = 0  # of which the kept checkpoints
    sampling_tokens: int = 0  # prompt and answer tokens of its sampling requests answered in the window

    def rounded(self) -> Usage:
        return Usage(round(self.gpu_seconds, 3), self.tokens, dict(self.trials), self.storage_bytes,
                     self.checkpoint_bytes, self.sampling_tokens)


def _tokens_by_pack(session: Session, pack_ids: Iterable[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    ids = list(pack_ids)
    if ids:
        rows = session.execute(select(TrialUsage.pack_id, TrialUsage.trial_id, func.sum(TrialUsage.tokens))
                               .where(TrialUsage.pack_id.in_(ids)).group_by(TrialUsage.pack_id, TrialUsage.trial_id))
        for pack_id, trial_id, tokens in rows:
            out[pack_id][trial_id] = int(tokens)
    return out


def gpu_seconds_by_trial(
    session: Session, window: tuple[datetime | None, datetime | None] = (None, None), now: datetime | None = None,
    trial_ids: set[str] | None = None,
) -> dict[str, float]:
    """Each trial's share of the GPU time of every pack that ran inside the window (only `trial_ids`' packs when
    given)."""
    now = now or utcnow()
    query = select(Pack).where(Pack.started_at.is_not(None))
    if window[1] is not None:
        query = query.where(Pack.started_at < window[1])
    if window[0] is not None:
        query = query.where((Pack.finished_at.is_(None)) | (Pack.finished_at > window[0]))
    # Rows as they are now: a pack this session loaded earlier (the cluster view reads the packs first) may have
    # started since, and the identity map would hand back its old, unstarted attributes.
    every = list(session.scalars(query.execution_options(populate_existing=True)))
    held = _held_seconds(every, window, now)
    packs = [p for p in every if trial_ids is None or not trial_ids.isdisjoint(p.trial_ids)]
    tokens = _tokens_by_pack(session, (p.id for p in packs))
    out: dict[str, float] = defaultdict(float)
    for pack in packs:
        seconds = held[pack.id] * pack.gpus
        reported = tokens[pack.id] if pack.state != states.PACK_LOST else {}  # a lost pack's: equally (module doc)
        for trial_id, share in share_pack(seconds, [str(t) for t in pack.trial_ids], reported).items():
            out[trial_id] += share
    return dict(out)


class _PackSpan(Protocol):
    """What `_held_seconds` reads of a pack: a `Pack`, or a row of those columns."""

    @property
    def id(self) -> str: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def finished_at(self) -> datetime | None: ...


def _held_seconds(packs: Sequence[_PackSpan], window: tuple[datetime | None, datetime | None],
                  now: datetime) -> dict[str, float]:
    """Each pack's seconds inside the window on its worker, shared with the packs beside it (`split_overlaps`)."""
    by_worker: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for pack in packs:
        assert pack.started_at is not None
        end = as_utc(pack.finished_at) if pack.finished_at is not None else now
        lo, hi = clip(as_utc(pack.started_at), end, window)
        by_worker[pack.worker_id].append((pack.id, lo.timestamp(), hi.timestamp()))
    return {pack_id: seconds for spans in by_worker.values() for pack_id, seconds in split_overlaps(spans).items()}


def gpu_seconds_by_tenant(session: Session, window: tuple[datetime | None, datetime | None],
                          now: datetime | None = None) -> dict[str, float]:
    """Each tenant's GPU seconds inside the window: what it is billed, and what the scheduler's fairness rule and the
    cluster view weigh it by. `gpu_seconds_by_trial`'s shares summed by the trials' tenants (`split_overlaps` on each
    worker, then a pack's seconds shared by its trials' reported tokens, equally without any or when it was lost),
    read for a cluster of hundreds of workers: the packs' few columns, their reported tokens summed by tenant (a
    trial reports only from a pack it was placed in), and for the packs shared equally how many of their trials each
    tenant has (`_equal_shares`). Summing `gpu_seconds_by_trial` itself loaded every pack of the window whole and
    each trial's owner by id: seconds at 256 workers (tests/api/test_api_cluster.py holds the two equal)."""
    now = now or utcnow()
    start, end = window
    in_window: list[ColumnElement[bool]] = [Pack.started_at.is_not(None)]
    if end is not None:
        in_window.append(Pack.started_at < end)
    if start is not None:
        in_window.append(or_(Pack.finished_at.is_(None), Pack.finished_at > start))
    packs = session.execute(select(Pack.id, Pack.worker_id, Pack.state, Pack.gpus, Pack.started_at, Pack.finished_at)
                            .where(*in_window)).all()
    held = _held_seconds(packs, window, now)
    tokens: dict[str, dict[str, int]] = defaultdict(dict)
    for pack_id, tenant_id, n in session.execute(
            select(TrialUsage.pack_id, TrialUsage.tenant_id, func.sum(TrialUsage.tokens))
            .join(Pack, Pack.id == TrialUsage.pack_id).where(*in_window)
            .group_by(TrialUsage.pack_id, TrialUsage.tenant_id)):
        tokens[pack_id][tenant_id] = int(n or 0)
    out: dict[str, float] = defaultdict(float)
    equal: dict[str, float] = {}  # the packs whose seconds are shared equally among their trials
    for p in packs:
        seconds, reported = held[p.id] * p.gpus, tokens.get(p.id, {}) if p.state != states.PACK_LOST else {}
        total = sum(reported.values())
        if total > 0:
            for tenant_id, n in reported.items():
                out[tenant_id] += seconds * n / total
        else:
            equal[p.id] = seconds
    for tenant_id, seconds in _equal_shares(session, equal).items():
        out[tenant_id] += seconds
    return dict(out)


def _equal_shares(session: Session, seconds: dict[str, float]) -> dict[str, float]:
    """These packs' seconds shared equally among the trials placed in them (`Pack.trial_ids`), by tenant. A trial
    in a pack now (`Trial.pack_id`, which stays set once it ended there) was placed in it: a pack all of whose
    trials are still in it is counted by tenant in SQL; the trials of the others (back in the queue after a lost
    pack, or in another pack since) are read by id. A pack's trial deleted since (its tenant gone) bills no one."""
    out: dict[str, float] = defaultdict(float)
    if not seconds:
        return out
    placed: dict[str, list[Any]] = dict(
        session.execute(select(Pack.id, Pack.trial_ids).where(Pack.id.in_(list(seconds)))).all())
    members: dict[str, dict[str, int]] = defaultdict(dict)
    for pack_id, tenant_id, n in session.execute(
            select(Trial.pack_id, Trial.tenant_id, func.count(Trial.id)).where(Trial.pack_id.in_(list(seconds)))
            .group_by(Trial.pack_id, Trial.tenant_id)):
        members[str(pack_id)][tenant_id] = n
    by_id: list[tuple[list[str], float]] = []
    for pack_id, trial_ids in placed.items():
        if not trial_ids:
            continue
        share = seconds[pack_id] / len(trial_ids)
        if sum(members[pack_id].values()) == len(trial_ids):
            for tenant_id, n in members[pack_id].items():
                out[tenant_id] += share * n
        else:
            by_id.append(([str(t) for t in trial_ids], share))
    if by_id:
        wanted = list({t for trial_ids, _ in by_id for t in trial_ids})
        owner: dict[str, str] = dict(
            session.execute(select(Trial.id, Trial.tenant_id).where(Trial.id.in_(wanted))).all())
        for trial_ids, share in by_id:
            for trial_id in trial_ids:
                if trial_id in owner:
                    out[owner[trial_id]] += share
    return out


def task_usage(session: Session, task_id: str) -> tuple[int, float]:
    """(tokens trained, GPU seconds) of one task's trials over its whole life."""
    trial_ids = set(session.scalars(select(Trial.id).where(Trial.task_id == task_id)))
    tokens = session.scalar(select(func.coalesce(func.sum(TrialUsage.tokens), 0)).where(TrialUsage.task_id == task_id))
    # Only the packs that ran after the task was submitted: none before held its trials, and the part of one beside
    # them that fell before it does not change their share. Every pack ever run was read at each task's end (a
    # growing cost for the scheduler on a busy cluster: benchmarks/cluster_scale.py).
    created = session.scalar(select(Task.created_at).where(Task.id == task_id))
    window = (as_utc(created) if created is not None else None, None)
    seconds = gpu_seconds_by_trial(session, window=window, trial_ids=trial_ids)
    return int(tokens or 0), sum(s for t, s in seconds.items() if t in trial_ids)


def tenant_usage(
    session: Session, window: tuple[datetime | None, datetime | None], tenant_ids: Sequence[str] | None = None,
    now: datetime | None = None,
) -> dict[str, Usage]:
    """Usage per tenant inside the window: GPU seconds (pack time inside it, shared by tokens), tokens trained (the
    reports that arrived inside it), tokens of the sampling requests answered inside it, trials by final state (those
    of tasks that ended inside it) and the bytes of live uploaded files and kept checkpoints now. `tenant_ids` None:
    every tenant with any of it."""
    usage: dict[str, Usage] = defaultdict(Usage)
    for tenant_id, seconds in gpu_seconds_by_tenant(session, window, now).items():
        usage[tenant_id].gpu_seconds += seconds
    tokens = select(TrialUsage.tenant_id, func.sum(TrialUsage.tokens)).group_by(TrialUsage.tenant_id)
    sampled = (select(SamplingUsage.tenant_id, func.sum(SamplingUsage.prompt_tokens + SamplingUsage.completion_tokens))
               .group_by(SamplingUsage.tenant_id))
    ended = (select(Trial.tenant_id, Trial.state, func.count()).join(Task, Task.id == Trial.task_id)
             .where(Task.finished_at.is_not(None)).group_by(Trial.tenant_id, Trial.state))
    if window[0] is not None:
        tokens = tokens.where(TrialUsage.created_at >= window[0])
        sampled = sampled.where(SamplingUsage.created_at >= window[0])
        ended = ended.where(Task.finished_at >= window[0])
    if window[1] is not None:
        tokens = tokens.where(TrialUsage.created_at < window[1])
        sampled = sampled.where(SamplingUsage.created_at < window[1])
        ended = ended.where(Task.finished_at < window[1])
    for tenant_id, n in session.execute(tokens):
        usage[tenant_id].tokens += int(n or 0)
    for tenant_id, n in session.execute(sampled):
        usage[tenant_id].sampling_tokens += int(n or 0)
    for tenant_id, state, n in session.execute(ended):
        usage[tenant_id].trials[state] = int(n)
    storage = select(File.tenant_id, func.sum(File.bytes)).where(File.deleted_at.is_(None)).group_by(File.tenant_id)
    for tenant_id, n in session.execute(storage):
        usage[tenant_id].storage_bytes += int(n or 0)
    checkpoints = select(Checkpoint.tenant_id, func.sum(Checkpoint.size_bytes)).group_by(Checkpoint.tenant_id)
    for tenant_id, n in session.execute(checkpoints):
        usage[tenant_id].storage_bytes += int(n or 0)
        usage[tenant_id].checkpoint_bytes = int(n or 0)
    wanted = list(usage) if tenant_ids is None else list(tenant_ids)
    return {t: usage[t].rounded() if t in usage else Usage() for t in wanted}
