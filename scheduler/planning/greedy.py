"""The first-fit planner: the CP-SAT planner's hint and fallback (pure, no I/O).

List scheduling by Smith's rule with cheapest insertion. Pending trials are taken shortest solo time per unit
of tenant weight first (`Prepared.priority`); each goes wherever it adds the least to the objective
`Σ weight·completion + makespan_weight·makespan`, given what is already placed:

- a new pack of its own on the k earliest-free GPUs that hold it and load its model, at the earliest time its
  tenant's quota allows; or
- an open pack of its model (a running pack, or a new pack of this plan that nothing is planned after on its
  GPUs), if memory, caps and quotas still hold. Joining costs its own slower completion plus the delay it
  causes every member it shares the pack with (coefficients.py: a short member slows a long one only while they
  share the pack). Only packs that start before the new pack could are worth a look: starting no earlier and
  stepping no faster, a join could never finish sooner than a pack of its own.

Both options also pay for the GPU time they take from the trials still to be placed: every unit a GPU stays
taken delays, in a list schedule over G GPUs, about 1/G of their weight. Without that term a trial would
never see that a pack of its own holds a GPU for its whole solo time while joining a pack holds the pack's
GPUs only for the time it adds; with it, trials whose model has a large shared step cost (ALTO's 70B, 32B)
pack, and trials whose shared cost is small (the tenant stream's 8B jobs) mostly run alone.

So with a GPU set free now a trial never joins a pack (it starts alone, at once), and under a queue a short
trial slips into a running pack rather than wait behind long ones when the delay it causes is smaller than
the wait it saves: processor sharing where it pays, shortest-first everywhere. Running packs are back-filled
by the same rule. Speed: GPUs sit in heaps by free time per memory size, open packs in heaps by end per pack
kind; at most `CANDIDATE_PACKS` open packs (the earliest-ending) are priced per trial, each in O(members).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from dataclasses import dataclass, field

from scheduler.planning.coefficients import SCALE, Prepared, finish_plan
from scheduler.planning.types import PendingTrial, PlanningInput, PlanResult, RunningPack, ScheduledPack

# Open packs priced per trial (the earliest-ending of its kind). Above this many the insertion is a heuristic
# choice among the likeliest; the simulated 16- and 64-GPU clusters never have more open packs of one kind.
CANDIDATE_PACKS = 32


def _units(milli: int) -> int:
    return max(1, -(-milli // SCALE))


@dataclass
class _Pack:
    """A pack of the plan being built: a new one, or a running one (back-fill). Member j has `steps[j]` steps
    of cost `items[j]` each, and `milli[j]` = SCALE·(time from the pack's start to its last step)."""

    key: str
    worker_ids: tuple[str, ...]
    kind: tuple[str, int]
    start: int
    base: int  # shared step cost (SCALE-ths); a legacy running pack's whole load is in it
    running: RunningPack | None
    floor_end: int  # the pack ends no earlier (a running pack's predicted end)
    count: int  # members in all, running ones included
    max_trials_per_pack: int  # most members in all
    mem_left: int  # bytes left for more members on its smallest GPU
    ids: list[str] = field(default_factory=list)  # members the plan knows: running ones first, then placed
    steps: list[int] = field(default_factory=list)
    items: list[int] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)
    milli: list[int] = field(default_factory=list)
    placed: list[str] = field(default_factory=list)  # pending trials placed here by this plan
    end: int = 0
    version: int = 0  # bumped on every change: stale heap entries are skipped
    open: bool = True  # nothing is planned after it on its GPUs, so it may still grow

    def comp(self, j: int) -> int:
        return self.start + _units(self.milli[j])


def _quota_ok(prep: Prepared, used: dict[str, dict[str, tuple[int, int]]],
              changes: dict[str, tuple[str, int, int]]) -> bool:
    """Whether the spans `changes` (key -> tenant, start, end; new or moved) keep every tenant within quota."""
    for tenant in {ten for ten, _, _ in changes.values()}:
        quota = prep.quota_cap(tenant)
        if quota is None:
            continue
        spans = dict(used.get(tenant, {}))
        spans.update({k: (s, e) for k, (ten, s, e) in changes.items() if ten == tenant})
        # Concurrency peaks at some interval start: count the spans covering each start.
        if any(sum(1 for s, e in spans.values() if s <= x < e) > quota for x, _ in spans.values()):
            return False
    return True


def plan_greedy(inp: PlanningInput) -> PlanResult:
    """List scheduling by Smith's rule with cheapest insertion (see the module docstring)."""
    t0 = time.perf_counter()
    plan = _GreedyPlan(inp)
    order = plan.prep.priority()
    rest = sum(t.tenant_weight for t in order)  # weight of the trials not placed yet
    for t in order:
        rest -= t.tenant_weight
        plan.place(t, rest)
    return finish_plan(plan.prep, plan.scheduled(), time.perf_counter() - t0, "greedy_fallback")


class _GreedyPlan:
    """The plan being built: GPUs by free time, open packs by end, tenants' spans; `place` adds one trial."""

    def __init__(self, inp: PlanningInput) -> None:
        self.prep = prep = Prepared(inp)
        self.mw, self.n_workers = inp.makespan_weight, len(inp.workers)
        self.quotas = bool(inp.tenant_quota)
        self.tenant_of = {t.trial_id: t.tenant_id for t in prep.trials}
        self.avail = avail = prep.fixed_busy()
        self.seq = itertools.count()
        # GPUs by memory size, each size a heap of (free at, GPU id); an entry is stale once avail moved on.
        self.sizes = sorted({g.memory_bytes for g in inp.workers})
        self.free_heaps: dict[int, list[tuple[int, str]]] = {m: [] for m in self.sizes}
        for spec in inp.workers:
            self.free_heaps[spec.memory_bytes].append((avail[spec.worker_id], spec.worker_id))
        for h in self.free_heaps.values():
            heapq.heapify(h)
        self.last_on: dict[str, _Pack] = {}  # GPU -> the pack planned last on it
        self.open_heaps: dict[tuple[str, int], list[tuple[int, int, int, _Pack]]] = {}  # (end, seq, version, pack)
        self.used: dict[str, dict[str, tuple[int, int]]] = {}  # tenant -> span key -> (start, end), for quotas
        self.makespan = max([0, *avail.values()])
        self.packs: list[_Pack] = []
        for r in sorted(inp.running, key=lambda r: r.pack_id):
            self._add_running(r)

    def _publish(self, p: _Pack) -> None:
        p.version += 1
        heapq.heappush(self.open_heaps.setdefault(p.kind, []), (p.end, next(self.seq), p.version, p))

    def _add_running(self, r: RunningPack) -> None:
        """Takes in a running pack: its GPUs, its members' spans for quotas, and open to back-fill if it has room."""
        prep, used = self.prep, self.used
        # A legacy pack (members unknown) is its load in the shared cost until its end; a known one, members.
        p = _Pack(r.pack_id, r.worker_ids, (r.base_model, len(r.worker_ids)), 0,
                  prep.step_base(r.base_model) if r.members else prep.step_running(r), r,
                  floor_end=prep.running_end(r), count=r.trials,
                  max_trials_per_pack=min(r.max_trials_per_pack, r.trials + r.free_slots),
                  mem_left=min(prep.worker_mem[g] for g in r.worker_ids) - prep.mem_running(r), end=prep.running_end(r))
        for member in prep.running_members(r) if r.members else []:
            p.ids.append(member.trial_id)
            p.steps.append(member.steps)
            p.items.append(member.item)
            p.weights.append(member.weight)
        p.milli = [n * p.base + sum(i * min(n2, n) for n2, i in zip(p.steps, p.items, strict=True))
                   for n in p.steps]
        for j, known in enumerate(r.members):
            used.setdefault(known.tenant_id, {})[known.trial_id] = (0, p.comp(j))
            self.tenant_of[known.trial_id] = known.tenant_id
        if not r.members:
            for ten, n in r.tenant_trials:
                used.setdefault(ten, {}).update({f"{r.pack_id}#{ten}#{i}": (0, r.ends_at) for i in range(n)})
        self.packs.append(p)
        for g in r.worker_ids:
            self.last_on[g] = p
        if r.free_slots > 0:
            self._publish(p)

    def place(self, t: PendingTrial, rest: int) -> None:
        """Places t where it adds the least to the objective: a new pack of its own, or the cheapest open pack
        of its kind; `rest` is the weight of the trials still to be placed after it."""
        prep, avail, n_workers = self.prep, self.avail, self.n_workers
        kind, item = (t.base_model, t.gpus_needed), prep.step_item(t)
        base = prep.step_base(t.base_model)
        need = prep.mem_base(t.base_model) + prep.mem_item(t)
        workers = self._earliest_workers(t, need)
        solo = prep.duration(t.remaining_steps, base + item)
        start = self._quota_start(t, max(avail[g] for g in workers), solo)
        new_cost = (t.tenant_weight * (start + solo) + self.mw * max(0, start + solo - self.makespan)) * n_workers
        new_cost += rest * sum(start + solo - avail[g] for g in workers)
        best = self._best_join(t, kind, item, start, new_cost, rest)
        if best is not None:
            _, milli, own, p = best
            p.milli = [*milli, own]
            p.count += 1
            p.max_trials_per_pack = min(p.max_trials_per_pack, t.max_trials_per_pack)
            p.mem_left -= prep.mem_item(t)
        else:
            p = _Pack(f"new-{t.trial_id}", tuple(sorted(workers)), kind, start, base, None, floor_end=0, count=1,
                      max_trials_per_pack=t.max_trials_per_pack,
                      mem_left=min(prep.worker_mem[g] for g in workers) - need,
                      milli=[t.remaining_steps * (base + item)])
            self.packs.append(p)
            for g in workers:
                if g in self.last_on:
                    self.last_on[g].open = False
                self.last_on[g] = p
        self._commit(p, t, item)

    def _commit(self, p: _Pack, t: PendingTrial, item: int) -> None:
        """Records t as p's newest member: p's end, its members' spans, its GPUs' free times, the makespan."""
        p.ids.append(t.trial_id)
        p.steps.append(t.remaining_steps)
        p.items.append(item)
        p.weights.append(t.tenant_weight)
        p.placed.append(t.trial_id)
        p.end = max(p.floor_end, *(p.comp(j) for j in range(len(p.ids))))
        if self.quotas:
            for j, i in enumerate(p.ids):
                if i in self.tenant_of:
                    self.used.setdefault(self.tenant_of[i], {})[i] = (p.start, p.comp(j))
        avail, free_heaps, worker_mem = self.avail, self.free_heaps, self.prep.worker_mem
        for g in p.worker_ids:
            avail[g] = max(avail[g], p.end)
            heapq.heappush(free_heaps[worker_mem[g]], (avail[g], g))
        self.makespan = max(self.makespan, p.end)
        self._publish(p)

    def _earliest_workers(self, t: PendingTrial, need: int) -> list[str]:
        """The t.gpus_needed earliest-free GPUs with `need` bytes that load t's model, from the heaps, stale entries
        dropped; those that cannot load the model are passed over and put back. Ties: a GPU whose worker holds the
        model warm first (it starts without loading it), then by id."""
        prep, avail, sizes = self.prep, self.avail, self.sizes
        picked: list[tuple[int, str]] = []
        for m in sizes[bisect.bisect_left(sizes, need):]:
            h, got, passed = self.free_heaps[m], list[tuple[int, str]](), set[tuple[int, str]]()
            while h and len(got) < t.gpus_needed:
                at, gid = heapq.heappop(h)
                if at != avail[gid] or (at, gid) in got or (at, gid) in passed:
                    continue
                if prep.loads(gid, t.base_model):
                    got.append((at, gid))
                else:
                    passed.add((at, gid))
            for e in [*got, *passed]:
                heapq.heappush(h, e)
            picked.extend(got)
        warm = prep.warm_workers.get(t.base_model, [])
        if warm and picked:
            # A warm GPU free no later than the last one picked may take a cold one's place at the same time.
            last = max(at for at, _ in picked)
            picked.extend((avail[g], g) for g in warm if avail[g] <= last and prep.worker_mem[g] >= need
                          and prep.loads(g, t.base_model) and (avail[g], g) not in picked)
        ranked = sorted(picked, key=lambda e: (e[0], prep.cold(e[1], t.base_model), e[1]))
        return [gid for _, gid in ranked[: t.gpus_needed]]

    def _quota_start(self, t: PendingTrial, start: int, dur: int) -> int:
        """The earliest time ≥ start at which t alone for `dur` keeps its tenant within quota."""
        prep, used = self.prep, self.used
        if not self.quotas or prep.quota_cap(t.tenant_id) is None:
            return start
        times = sorted({start, *(e for _, e in used.get(t.tenant_id, {}).values() if e > start)})
        return next(x for x in times if _quota_ok(prep, used, {t.trial_id: (t.tenant_id, x, x + dur)}))

    def _best_join(self, t: PendingTrial, kind: tuple[str, int], item: int, start: int, new_cost: int,
                   rest: int) -> tuple[int, list[int], int, _Pack] | None:
        """The cheapest join of t below `new_cost` (its own pack starting at `start`) as (cost, members' new
        milli, t's milli, pack), or None: prices the earliest-ending open packs of this kind that start before
        the new pack could."""
        best: tuple[int, list[int], int, _Pack] | None = None
        heap, seen, price_join = self.open_heaps.get(kind, []), list[tuple[int, int, int, _Pack]](), self._price_join
        while heap and len(seen) < CANDIDATE_PACKS:
            entry = heapq.heappop(heap)
            p = entry[3]
            if entry[2] != p.version or not p.open:
                continue  # stale: the pack changed or something is planned after it
            seen.append(entry)
            if p.start < start:
                priced = price_join(p, t, item, best[0] if best else new_cost, rest)
                if priced:
                    best = (*priced, p)
        for entry in seen:
            heapq.heappush(heap, entry)
        return best

    def _price_join(self, p: _Pack, t: PendingTrial, item: int, bound: int,
                    rest: int) -> tuple[int, list[int], int] | None:
        """(cost in n_workers-ths, members' new milli, t's milli) of t joining p, or None if it may not or
        costs `bound` or more."""
        prep, n_workers = self.prep, self.n_workers
        if p.count + 1 > min(p.max_trials_per_pack, t.max_trials_per_pack) or prep.mem_item(t) > p.mem_left:
            return None
        n = t.remaining_steps
        # Its own time at least: every step the shared cost and its own item, the members' items aside.
        if t.tenant_weight * (p.start + _units(n * (p.base + item))) * n_workers >= bound:
            return None
        own = n * (p.base + item) + sum(i * min(n2, n) for n2, i in zip(p.steps, p.items, strict=True))
        mine = p.start + _units(own)
        cost, last = t.tenant_weight * mine, mine
        milli = []
        for j, (n2, m) in enumerate(zip(p.steps, p.milli, strict=True)):
            m2 = m + item * min(n, n2)  # member j is slowed while t is in, and only then
            milli.append(m2)
            c2 = p.start + _units(m2)
            cost += p.weights[j] * (c2 - p.comp(j))
            last = max(last, c2)
        end = max(last, p.floor_end)
        # In n_workers-ths: the pack's GPUs stay taken (end - p.end) longer, which the trials still to place pay.
        cost = (cost + self.mw * max(0, end - self.makespan)) * n_workers + rest * len(p.worker_ids) * (end - p.end)
        if cost >= bound:
            return None
        if self.quotas:
            moved = {i: (self.tenant_of[i], p.start, p.start + _units(m)) for i, m in zip(p.ids, milli, strict=True)
                     if i in self.tenant_of}
            if not _quota_ok(prep, self.used, moved | {t.trial_id: (t.tenant_id, p.start, mine)}):
                return None
        return cost, milli, own

    def scheduled(self) -> list[ScheduledPack]:
        """The plan's packs that got pending trials: new ones, and running ones back-filled."""
        return [ScheduledPack(p.key, p.worker_ids, p.kind[0], tuple(p.placed), p.start, 0,
                              backfill=p.running is not None)
                for p in self.packs if p.placed]
