"""Preemption with a time slice (issue 34): which running packs give up their GPUs so that other tenants' waiting
trials can start. Pure: the simulator (scheduler/sim/simulate.py) and the scheduler's daemon call the same rule.

Why: a worker runs one pack (unless it may run several, worker/colocation.py, and one more fits), and a pack holds
one base model, so a tenant's short task on another model waits for
the whole of a long pack on the only GPU that could take it (measured: 18.6 min for a 13 s task, issue 34). The
planner's tenant weights order what *starts*; once a pack runs nothing it holds can be taken back. This rule takes
it back, at a checkpoint (the pause path that early exit uses), under four bounds:

- ``min_slice_s``: a pack runs at least this long before it may be preempted, so that a pause (a checkpoint, then
  another base model loaded) is paid at most once per slice;
- ``window_s``: each tenant's GPU time is counted over this trailing window, per unit of its weight; a pack is
  preempted only for a waiting tenant that has had less of it than every tenant in the pack (weighted fair share:
  a tenant of weight 2 may use twice the GPU time before another of weight 1 takes its GPU);
- ``max_pauses``: a trial is preempted at most this many times, so that a long trial finishes whatever arrives;
- the waiting tenant must have no trial in the pack (it is not preempted for itself).

The daemon and the simulator hold the preempted trials back from the next plans until the trials they made room for
have started (or left; the daemon for one slice at most), so the freed GPU goes to the tenant it was freed for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from common.settings import Settings


@dataclass(frozen=True)
class FairnessPolicy:
    min_slice_s: float = 300.0  # a pack's least run before it may be preempted
    window_s: float = 3600.0  # GPU time per tenant counted over this trailing window
    max_pauses: int = 3  # a trial is preempted at most this many times


def policy_from(settings: Settings) -> FairnessPolicy:
    """The settings' policy: each of LORAPLANE_PREEMPT_MIN_SLICE_S, _FAIR_WINDOW_S, _PREEMPT_MAX_PAUSES where set,
    else the default above (whether preemption is on at all is `settings.preempt`)."""
    given = {"min_slice_s": settings.preempt_min_slice_s, "window_s": settings.fair_window_s,
             "max_pauses": settings.preempt_max_pauses}
    assert set(given) == {f.name for f in fields(FairnessPolicy)}
    return FairnessPolicy(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]


@dataclass(frozen=True)
class PackView:
    """A running pack as the rule sees it."""

    pack_id: str
    gpus: int
    running_s: float  # how long it has run (since it started, or since its last member joined after a preemption)
    tenants: frozenset[str]
    member_pauses: tuple[int, ...]  # how often each member has been preempted before


@dataclass(frozen=True)
class WaitingTrial:
    """A pending trial that could not start now."""

    trial_id: str
    tenant_id: str
    gpus_needed: int


@dataclass(frozen=True)
class Preemption:
    pack_id: str
    for_tenant: str
    reason: str  # in words, for the trial's event


def past_slice(packs: Sequence[PackView], policy: FairnessPolicy) -> list[PackView]:
    """The packs that may be preempted at all, whoever waits: they have run their slice and no member has been
    paused `max_pauses` times. None: the tenants' GPU time need not be read."""
    return [p for p in packs if p.running_s >= policy.min_slice_s
            and all(n < policy.max_pauses for n in p.member_pauses)]


def normalised_usage(usage_gpu_s: Mapping[str, float], weights: Mapping[str, int], tenant: str) -> float:
    """A tenant's GPU seconds in the window per unit of its weight (weights ≥ 1; unknown tenants weigh 1)."""
    return usage_gpu_s.get(tenant, 0.0) / max(1, weights.get(tenant, 1))


def preemptions(packs: Sequence[PackView], waiting: Iterable[WaitingTrial], usage_gpu_s: Mapping[str, float],
                weights: Mapping[str, int], policy: FairnessPolicy) -> list[Preemption]:
    """The packs to pause now, at most one for each waiting tenant, the tenant furthest below its share first.

    Call it only where the plan just made starts none of the ``waiting`` trials: a pack is preempted for a tenant
    whose trials cannot start otherwise. For that tenant, a pack qualifies if it has run ``min_slice_s``, holds none
    of the tenant's trials, has as many GPUs as the tenant's smallest waiting trial needs, no member has been paused
    ``max_pauses`` times, and every tenant in it has had more GPU time per weight in the window than the waiting
    one. Of those, the pack whose least-served tenant is most ahead goes first (ties: the longest running, then
    the pack id).
    """
    waiting, packs = list(waiting), past_slice(packs, policy)
    if not waiting or not packs:
        return []
    share = {t: normalised_usage(usage_gpu_s, weights, t)
             for t in {w.tenant_id for w in waiting} | {t for p in packs for t in p.tenants}}
    chosen: list[Preemption] = []
    taken: set[str] = set()
    for tenant in sorted({w.tenant_id for w in waiting}, key=lambda t: (share[t], t)):
        need = min(w.gpus_needed for w in waiting if w.tenant_id == tenant)
        candidates = [p for p in packs if p.pack_id not in taken and tenant not in p.tenants and p.gpus >= need
                      and min(share[t] for t in p.tenants) > share[tenant]]
        if not candidates:
            continue
        best = max(candidates, key=lambda p: (min(share[t] for t in p.tenants), p.running_s, p.pack_id))
        taken.add(best.pack_id)
        ahead = min(share[t] for t in best.tenants)
        chosen.append(Preemption(best.pack_id, tenant, (
            f"preempted after {best.running_s:.0f} s for tenant {tenant}, whose trials could not start: it has had "
            f"{share[tenant]:.0f} GPU-s per unit of weight in the last {policy.window_s:.0f} s, the pack's "
            f"tenants at least {ahead:.0f}")))
    return chosen


def usage_in_window(segments: Iterable[tuple[float, float, float, Mapping[str, int]]], now: float,
                    window_s: float) -> dict[str, float]:
    """Each tenant's GPU seconds within [now − window_s, now], from ``(start_s, end_s, gpus, {tenant: members})``
    segments of packs' lives (a running pack's last segment ends now): a segment's GPU time is split among its
    tenants by their number of members."""
    since = now - window_s
    usage: dict[str, float] = {}
    for start, end, gpus, members in segments:
        overlap = min(end, now) - max(start, since)
        total = sum(members.values())
        if overlap <= 0 or total <= 0:
            continue
        for tenant, n in members.items():
            usage[tenant] = usage.get(tenant, 0.0) + overlap * gpus * n / total
    return usage
