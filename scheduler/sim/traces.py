"""Workload traces for the planner simulator (scheduler/sim/simulate.py): pure data, drawn from a seed.

Two traces (issue 5):

- `alto_mix`: ALTO §8.2 (Fig. 12), 11 heterogeneous tasks on 8× H100: Llama-3.1-70B tasks on 4 GPUs,
  Qwen2.5-32B on 2, Llama-3.1-8B and Qwen2.5-7B on 1, each tuning adapters on GSM8K at varied batch sizes.
- `tenant_stream`: a multi-tenant stream in tLoRA's style (§4): Poisson arrivals, one LoRA job per task with
  rank drawn from {2, 4, 8, 16} and batch size from {1, 2, 4, 8}, on 8B-class shared backbones.

Assumptions where the papers give no number (all fixed before any simulation was run):

- ALTO's mix: the count per model is not given; we use 2× 70B, 3× 32B, 3× Llama-8B, 3× Qwen-7B (11 tasks).
  Fig. 12's per-task grid is not given either; each task searches batch size {1, 2, 4, 8} ("varied batch
  sizes") × rank {16, 64} (two points of A.4's rank axis) = 8 trials, 3 epochs (A.4) over GSM8K's training
  split (90% of 7,473 rows = 6,725), LoRA on q, k, v, o, gate, up, down (A.4). All tasks arrive at t = 0
  (ALTO plans a submitted batch for makespan); the seed only permutes the submission order, which is what
  FIFO sees.
- Tokens: 512 padded tokens per sample (GSM8K rows are ~200–300 tokens; padding to the batch's longest row
  and ALTO's 1,024 cap put the padded mean well above that).
- tLoRA's stream: the trace (ACMETrace) is not available offline, so arrivals are Poisson with a rate that
  offers `load` (default 0.9) of the cluster's GPU-seconds when every job runs alone (the FIFO baseline's
  service time); step budgets are log-uniform in [100, 5,000] (ACMETrace durations are heavy-tailed);
  base models Llama-3.1-8B and Qwen2.5-7B with equal odds (tLoRA evaluates 8B backbones), one GPU per job;
  8 tenants, all of weight 1 (tLoRA has no tenant priorities); one trial per task, so a task's JCT is
  tLoRA's per-job JCT.
- Max trials per pack: 8, the API's default `scheduling.max_trials_per_pack` when these traces were fixed (the
  service's default is now `common.settings.DEFAULT_MAX_TRIALS_PER_PACK`, 32); kept at 8 so that the recorded
  simulations (benchmarks/results/planner-*.json) reproduce, and ALTO's tasks have 8 trials each anyway.

Cost model per base model on an 80 GB H100 SXM, from first principles (`model_cost`), per GPU of the pack:

- memory k0 = bf16 weights / gpus (FSDP-sharded backbone, ALTO's adapter parallelism) + 4 GiB workspace
  (CUDA context, cuBLAS workspace, allocator slack) + two unsharded bf16 layers when sharded (FSDP prefetch);
- memory k1 = activation bytes per pooled token / gpus (each rank holds its own adapters' tokens), with
  gradient checkpointing (ALTO A.4): one bf16 hidden vector per layer, one layer's working set during its
  recompute (2 bytes × (8·hidden + 4·intermediate)), and the logits (bf16 + fp32 for the loss + its fp32
  gradient = 10 bytes × vocab);
- step a = fixed seconds per step: streaming the full bf16 weights from HBM three times (forward, recompute,
  backward) at 2.7 TB/s effective, plus the FSDP all-gathers of the weights when sharded (forward and
  backward, (gpus−1)/gpus of the weights each, at 360 GB/s effective NVLink, not hidden at small batches),
  plus 15 ms of launches and optimizer work;
- step b = 6·params / gpus / 400 TFLOP/s per pooled token: forward 2P, recompute 2P, input gradients 2P (the
  frozen base needs no weight gradients), at ~40% of H100 bf16 peak;
- step c = 2 ms per slot (per-slot optimizer update and adapter bookkeeping; the grouped LoRA kernels make the
  adapter math part of b);
- slot bytes = 16 × adapter params (fp32 weights, gradients, two AdamW moments) / gpus: FSDP shards the
  adapter and its optimizer state over the pack's GPUs like the backbone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from scheduler.planning.cost import BYTES_PER_ADAPTER_PARAM, MemoryModel, ModelCost, StepTimeModel, adapter_params

GIB = 1024**3
GPU_MEMORY_BYTES = 80 * 10**9  # H100 SXM 80 GB
WORKSPACE_BYTES = 4 * GIB
HBM_BYTES_PER_S = 2.7e12  # ~80% of H100 SXM's 3.35 TB/s
NVLINK_BYTES_PER_S = 360e9  # ~80% of 450 GB/s per direction
EFFECTIVE_FLOPS = 400e12  # ~40% of H100 bf16 dense peak
LAUNCH_OVERHEAD_S = 0.015
SLOT_OVERHEAD_S = 0.002
TOKENS_PER_SAMPLE = 512
GSM8K_TRAIN_ROWS = 6725  # 90% of GSM8K's 7,473 training rows (ALTO A.4)
EPOCHS = 3
MAX_TRIALS_PER_PACK = 8


@dataclass(frozen=True)
class Architecture:
    """The shape numbers of a public model config that the cost model needs."""

    params: float
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int  # key/value heads × head dim
    vocab: int


ARCHITECTURES = {
    "llama-3.1-70b": Architecture(70.55e9, 8192, 80, 28672, 8 * 128, 128256),
    "qwen2.5-32b": Architecture(32.76e9, 5120, 64, 27648, 8 * 128, 152064),
    "llama-3.1-8b": Architecture(8.03e9, 4096, 32, 14336, 8 * 128, 128256),
    "qwen2.5-7b": Architecture(7.62e9, 3584, 28, 18944, 4 * 128, 152064),
    "llama-3.2-1b": Architecture(1.24e9, 2048, 16, 8192, 8 * 64, 128256),
    "qwen2.5-0.5b": Architecture(0.49e9, 896, 24, 4864, 2 * 64, 151936),
}
GPUS_NEEDED = {"llama-3.1-70b": 4, "qwen2.5-32b": 2, "llama-3.1-8b": 1, "qwen2.5-7b": 1,  # ALTO §8.2
               "llama-3.2-1b": 1, "qwen2.5-0.5b": 1}


@dataclass(frozen=True)
class TraceTrial:
    trial_id: str
    tokens_per_step: int
    steps: int
    slot_bytes: int
    max_trials_per_pack: int


@dataclass(frozen=True)
class TraceTask:
    task_id: str
    tenant_id: str
    tenant_weight: int
    base_model: str
    gpus_needed: int
    arrival_s: float
    trials: tuple[TraceTrial, ...]


@dataclass(frozen=True)
class Trace:
    name: str
    tasks: tuple[TraceTask, ...]  # by arrival
    costs: dict[str, ModelCost]  # by base model, per GPU of a pack on an 80 GB H100-class GPU
    gpu_memory_bytes: int = GPU_MEMORY_BYTES


def lora_modules(arch: Architecture) -> list[tuple[int, int]]:
    """(d_in, d_out) of q, k, v, o, gate, up, down in every layer (ALTO A.4's targets)."""
    h, i, kv = arch.hidden, arch.intermediate, arch.kv_dim
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)] * arch.layers


def slot_bytes(model: str, rank: int) -> int:
    """Adapter + optimizer bytes of one slot per GPU of the model's pack."""
    total = BYTES_PER_ADAPTER_PARAM * adapter_params(lora_modules(ARCHITECTURES[model]), rank)
    return math.ceil(total / GPUS_NEEDED[model])


def model_cost(model: str, gpus: int) -> ModelCost:
    """The first-principles memory and step-time model of the module docstring, per GPU of a `gpus` pack."""
    arch = ARCHITECTURES[model]
    weight_bytes = 2 * arch.params
    layer_bytes = weight_bytes / arch.layers
    k0 = weight_bytes / gpus + WORKSPACE_BYTES + (2 * layer_bytes if gpus > 1 else 0)
    per_token = 2 * arch.hidden * arch.layers + 2 * (8 * arch.hidden + 4 * arch.intermediate) + 10 * arch.vocab
    k1 = per_token / gpus
    all_gather_s = 2 * weight_bytes * (gpus - 1) / gpus / NVLINK_BYTES_PER_S
    a = 3 * weight_bytes / HBM_BYTES_PER_S + all_gather_s + LAUNCH_OVERHEAD_S
    b = 6 * arch.params / gpus / EFFECTIVE_FLOPS
    return ModelCost(MemoryModel(k0, k1), StepTimeModel(a, b, SLOT_OVERHEAD_S))


def _costs(models: list[str]) -> dict[str, ModelCost]:
    return {m: model_cost(m, GPUS_NEEDED[m]) for m in models}


ALTO_MIX = ["llama-3.1-70b"] * 2 + ["qwen2.5-32b"] * 3 + ["llama-3.1-8b"] * 3 + ["qwen2.5-7b"] * 3


def alto_mix(seed: int = 0) -> Trace:
    """ALTO §8.2's 11-task mix (counts and grid assumed, see the module docstring), all arriving at t = 0."""
    models = list(ALTO_MIX)
    random.Random(seed).shuffle(models)
    tasks = []
    for i, model in enumerate(models):
        trials = tuple(
            TraceTrial(f"task{i:02d}-b{bs}-r{rank}", bs * TOKENS_PER_SAMPLE, EPOCHS * math.ceil(GSM8K_TRAIN_ROWS / bs),
                       slot_bytes(model, rank), MAX_TRIALS_PER_PACK)
            for bs in (1, 2, 4, 8) for rank in (16, 64)
        )
        tasks.append(TraceTask(f"task{i:02d}", f"tenant{i:02d}", 1, model, GPUS_NEEDED[model], 0.0, trials))
    return Trace("alto-mix", tuple(tasks), _costs(sorted(set(models))))


STREAM_MODELS = ["llama-3.1-8b", "qwen2.5-7b"]


def tenant_stream(seed: int = 0, gpus: int = 16, *, tasks: int = 200, load: float = 0.9, tenants: int = 8,
                  min_steps: int = 100, max_steps: int = 5000) -> Trace:
    """tLoRA §4-style stream: Poisson arrivals offering `load` of `gpus` when every job runs alone."""
    if tasks < 1 or gpus < 1 or load <= 0:
        raise ValueError("tenant_stream needs tasks ≥ 1, gpus ≥ 1 and load > 0")
    rng = random.Random(seed)
    costs = _costs(STREAM_MODELS)
    drawn = []
    for i in range(tasks):
        model = rng.choice(STREAM_MODELS)
        rank, bs = rng.choice((2, 4, 8, 16)), rng.choice((1, 2, 4, 8))
        steps = round(math.exp(rng.uniform(math.log(min_steps), math.log(max_steps))))
        tenant = f"tenant{rng.randrange(tenants)}"
        trial = TraceTrial(f"job{i:05d}", bs * TOKENS_PER_SAMPLE, steps, slot_bytes(model, rank), MAX_TRIALS_PER_PACK)
        drawn.append((model, tenant, trial))
    solo_s = [t.steps * costs[m].step.predict(t.tokens_per_step, 1) for m, _, t in drawn]
    rate = load * gpus / (sum(solo_s) / len(solo_s))  # arrivals per second
    now, out = 0.0, []
    for i, (model, tenant, trial) in enumerate(drawn):
        if i:
            now += rng.expovariate(rate)
        out.append(TraceTask(f"task{i:05d}", tenant, 1, model, 1, now, (trial,)))
    return Trace("tenant-stream", tuple(out), costs)


SHARED_LONG_MODEL = "llama-3.1-8b"
SHARED_SHORT_MODELS = ["qwen2.5-0.5b", "llama-3.2-1b"]
SHARED_WEIGHTS = {"tenant0": 1, "tenant1": 1, "tenant2": 2}


def shared_gpu(seed: int = 0, gpus: int = 2, *, tasks: int = 60, load: float = 0.9) -> Trace:
    """Issue 34's case: a few GPUs shared by tenants of several base models, long tasks beside short ones.

    tenant0 (weight 1) submits long searches on Llama-3.1-8B: 4 trials of 2,000-8,000 steps (log-uniform), one in
    four tasks; tenant1 (weight 1) and tenant2 (weight 2) submit short ones on Qwen2.5-0.5B or Llama-3.2-1B: 1-3
    trials of 100-600 steps. Batch {1, 2, 4, 8} and rank {4, 8, 16} drawn per task; Poisson arrivals offering
    `load` of `gpus` when every trial runs alone (as `tenant_stream`). No pack mixes models, so a short task of a
    small model can only start on a GPU that no 8B pack holds."""
    if tasks < 1 or gpus < 1 or load <= 0:
        raise ValueError("shared_gpu needs tasks ≥ 1, gpus ≥ 1 and load > 0")
    rng = random.Random(seed)
    costs = _costs([SHARED_LONG_MODEL, *SHARED_SHORT_MODELS])
    drawn: list[tuple[str, str, tuple[TraceTrial, ...]]] = []
    for i in range(tasks):
        long = rng.random() < 0.25
        model = SHARED_LONG_MODEL if long else rng.choice(SHARED_SHORT_MODELS)
        tenant = "tenant0" if long else rng.choice(["tenant1", "tenant2"])
        bs, rank = rng.choice((1, 2, 4, 8)), rng.choice((4, 8, 16))
        lo, hi, count = (2000, 8000, 4) if long else (100, 600, rng.randint(1, 3))
        trials = tuple(TraceTrial(f"task{i:04d}-t{k}", bs * TOKENS_PER_SAMPLE,
                                  round(math.exp(rng.uniform(math.log(lo), math.log(hi)))), slot_bytes(model, rank),
                                  MAX_TRIALS_PER_PACK) for k in range(count))
        drawn.append((model, tenant, trials))
    solo_s = [sum(t.steps * costs[m].step.predict(t.tokens_per_step, 1) for t in trials) for m, _, trials in drawn]
    rate = load * gpus / (sum(solo_s) / len(solo_s))
    now, out = 0.0, []
    for i, (model, tenant, trials) in enumerate(drawn):
        if i:
            now += rng.expovariate(rate)
        out.append(TraceTask(f"task{i:04d}", tenant, SHARED_WEIGHTS[tenant], model, 1, now, trials))
    return Trace("shared-gpu", tuple(out), costs)


CONTENDED_MODELS = {"tenant0": "llama-3.1-8b", "tenant1": "llama-3.2-1b", "tenant2": "qwen2.5-0.5b"}


def contended(seed: int = 0, gpus: int = 2, *, tasks: int = 45, load: float = 2.0) -> Trace:
    """Issue 34's share test: three tenants, each with a model of its own (`CONTENDED_MODELS`) and weights 1, 1, 2
    (`SHARED_WEIGHTS`), each submitting one-trial tasks whose solo time is 600-2,400 s (steps from the model's step
    time, so every tenant asks for about the same GPU time), in turn, with Poisson arrivals offering `load` (over
    1: every tenant stays backlogged, so the GPU time each gets is its share, not its demand)."""
    if tasks < 1 or gpus < 1 or load <= 0:
        raise ValueError("contended needs tasks ≥ 1, gpus ≥ 1 and load > 0")
    rng = random.Random(seed)
    costs = _costs(sorted(set(CONTENDED_MODELS.values())))
    tenants = sorted(CONTENDED_MODELS)
    drawn = []
    for i in range(tasks):
        tenant = tenants[i % len(tenants)]
        model = CONTENDED_MODELS[tenant]
        bs, rank = rng.choice((2, 4, 8)), rng.choice((4, 8, 16))
        solo = math.exp(rng.uniform(math.log(600), math.log(2400)))
        steps = max(1, round(solo / costs[model].step.predict(bs * TOKENS_PER_SAMPLE, 1)))
        drawn.append((model, tenant, TraceTrial(f"task{i:04d}-t0", bs * TOKENS_PER_SAMPLE, steps,
                                                slot_bytes(model, rank), MAX_TRIALS_PER_PACK)))
    solo_s = [t.steps * costs[m].step.predict(t.tokens_per_step, 1) for m, _, t in drawn]
    rate = load * gpus / (sum(solo_s) / len(solo_s))
    now, out = 0.0, []
    for i, (model, tenant, trial) in enumerate(drawn):
        if i:
            now += rng.expovariate(rate)
        out.append(TraceTask(f"task{i:04d}", tenant, SHARED_WEIGHTS[tenant], model, 1, now, (trial,)))
    return Trace("contended", tuple(out), costs)


TRACES = {"alto-mix", "tenant-stream", "shared-gpu", "contended"}


def make_trace(name: str, seed: int, gpus: int, tasks: int | None = None, load: float | None = None) -> Trace:
    """The named trace; `tasks` and `load` shape the tenant stream (the ALTO mix has a fixed size and arrives at
    once). `load` only scales the arrival rate (tLoRA §4.3 scales arrivals the same way); the jobs drawn from a
    seed are the same at every load."""
    if name == "alto-mix":
        return alto_mix(seed)
    if name == "tenant-stream":
        return tenant_stream(seed, gpus, tasks=tasks or 200, load=0.9 if load is None else load)
    if name == "shared-gpu":
        return shared_gpu(seed, gpus, tasks=tasks or 60, load=0.9 if load is None else load)
    if name == "contended":
        return contended(seed, gpus, tasks=tasks or 45, load=2.0 if load is None else load)
    raise ValueError(f"unknown trace {name!r}; expected one of {sorted(TRACES)}")
