"""The planner's cost model: pack memory and step time per (base model, GPU kind), fitted from pack profiles.

Pure functions, no I/O (ALTO §7.1, PLoRA Appendix A). Memory follows ALTO's linear model
`M(B) = k0 + k1·tokens` plus adapter and optimizer bytes per slot; step time is linear in pooled tokens and
active slots. Measured step times from running packs correct the prediction online (`corrected`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

# A trial's batch size when its hyperparameters name none (trials stored before batch_size was a dimension).
DEFAULT_BATCH_SIZE = 1


def batch_size(hyperparameters: Mapping[str, Any]) -> int:
    """A trial's rows per step."""
    return int(hyperparameters.get("batch_size", DEFAULT_BATCH_SIZE))


def tokens_per_step(hyperparameters: Mapping[str, Any], max_seq_len: int) -> int:
    """The tokens a trial adds to its pack's step, as the planner, the early-exit policies, the curves and the
    estimates count them: batch size x max_seq_len, twice for a DPO trial (its configuration has a beta: each of its
    rows is a chosen and a rejected sequence). Rows are at most max_seq_len long, so this is an upper bound
    (padding included). A DPO trial's reference pass (a forward of the base over each pair once, in its first epoch)
    is not counted."""
    sequences = 2 if "beta" in hyperparameters else 1
    return batch_size(hyperparameters) * max_seq_len * sequences


# fp32 weight + fp32 grad + two fp32 AdamW moments per trainable adapter parameter (PLoRA Eq. 21, c_grad = 3).
BYTES_PER_ADAPTER_PARAM = 16

# Priors: the cost model of a base model no pack has profiled yet (`PRIOR_COST` below), and the
# coefficients profiles cannot determine (too few or degenerate samples). From the packed engine on one H100 80 GB
# (benchmarks/results/engine_throughput-*-gpu-20261123-packed*.json; "tokens" are the planner's, batch × max_seq_len):
# - SmolLM2-135M shape, 24 trials × batch 4 × 96 tokens (9,216): 293-338 ms per step of which 40-60 ms is GPU work;
#   the step is host-bound, so its time barely grows with the trials in it (24 cost about what 8 do). A step's
#   shared cost is therefore most of it: `PRIOR_STEP_BASE_S`.
# - Llama-3.2-1B shape, 32 trials × batch 1 × 512 tokens (16,384): 214 ms per step, GPU-bound (187 ms busy), i.e.
#   1.3e-5 s per token; a per-token cost measured on the larger model over-estimates the small one's (safe).
# - Per slot: the slot's AdamW update is ~0.1 ms of GPU work (2.6 ms for 24 slots); 1 ms also covers its host work.
# - Memory, everything in k1 (k0 = 0): peaks include the frozen weights and the pack's adapter store (24-32 slots,
#   rank up to 64, fp32 weights, grads and AdamW moments). The 1B shape peaks at 46.9 GiB at batch 1 (16,384 tokens)
#   and 62.9 GiB at batch 2 (32,768: 2.0 MiB per token), i.e. ~31 GiB fixed + ~1 MiB per token; at batch 4 it does
#   not fit in 80 GB. SmolLM2: 13.5 GiB at 9,216 tokens (1.5 MiB per token). At 2 MiB per token the prior admits at
#   most ~40k tokens on an 80 GB GPU, where the 1B shape needs ~71 GiB and SmolLM2 far less: no OOM on either, and
#   it still packs 18 SmolLM2 trials at batch 4 × 512 tokens (the API's default max_seq_len) into one pack. A
#   steeper prior only packs fewer trials; a flatter one risks an OOM. A model whose size the registry knows gets its
#   frozen weights as k0 on top (`prior_cost`): these slopes already hold the measured models' weights, so that counts
#   a small model's weights twice (conservative), and keeps a large model off a GPU its weights alone fill.
# The earlier priors (a 50 ms shared cost, 1e-4 s per token, 256 KiB per token) made a pack's step grow almost
# linearly with its trials (SmolLM2 at batch 4 × 96: 39 ms per trial against 50 ms shared), so the objective preferred
# a few small packs one after another, and a task's first plan held most of its trials back (issue 15).
PRIOR_K1_BYTES_PER_TOKEN = 2 * 1024**2
PRIOR_STEP_BASE_S = 0.25
PRIOR_STEP_S_PER_TOKEN = 1.3e-5
PRIOR_STEP_S_PER_SLOT = 1e-3


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes of one pack on one planning unit (a worker: the sum over its GPUs):
    `k0 + k1·tokens + bytes_per_slot_param·Σ slot params`."""

    k0_bytes: float
    k1_bytes_per_token: float
    bytes_per_slot_param: int = BYTES_PER_ADAPTER_PARAM

    def predict(self, tokens: int, slot_params: int) -> int:
        """Predicted peak bytes for a pack with `tokens` pooled tokens per step and `slot_params` adapter params."""
        return math.ceil(self.k0_bytes + self.k1_bytes_per_token * tokens + self.bytes_per_slot_param * slot_params)


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per optimizer step of a pack: `a + b·tokens + c·slots`."""

    a_s: float
    b_s_per_token: float
    c_s_per_slot: float

    def predict(self, tokens: int, slots: int) -> float:
        return self.a_s + self.b_s_per_token * tokens + self.c_s_per_slot * slots

    def scaled(self, ratio: float) -> StepTimeModel:
        """This model with every prediction multiplied by ``ratio`` (an online correction)."""
        return StepTimeModel(self.a_s * ratio, self.b_s_per_token * ratio, self.c_s_per_slot * ratio)


@dataclass(frozen=True)
class ModelCost:
    memory: MemoryModel  # per planning unit of the pack (a worker, whatever its GPUs)
    step: StepTimeModel
    # Nothing measured: the priors (`prior_cost`). The planner then keeps no trial back for a later pack while one
    # starting now has room (rules.fill_now): a prior step time cannot say whether a bigger pack pays.
    prior: bool = False
    # The packs whose measured steps it rests on: the profiles it was fitted on and the running packs that correct
    # it (cluster_state.load_costs; 0 for the priors). An estimate states it (estimate.Basis).
    packs: int = 0


# Without a profile: the cost priors above, the one prior of the daemon's planner and the API's estimates (for a
# model of known size, `prior_cost` adds its weights).
PRIOR_COST = ModelCost(
    memory=MemoryModel(k0_bytes=0.0, k1_bytes_per_token=PRIOR_K1_BYTES_PER_TOKEN),
    step=StepTimeModel(a_s=PRIOR_STEP_BASE_S, b_s_per_token=PRIOR_STEP_S_PER_TOKEN, c_s_per_slot=PRIOR_STEP_S_PER_SLOT),
    prior=True,
)

# Bytes of one frozen base parameter: the engine holds the base in bf16 on CUDA (worker/engine/base_model.py), whatever
# the checkpoint's own dtype (a GGUF's quantized weights are dequantized to it).
BYTES_PER_FROZEN_PARAM = 2
# A base held in NF4 (a registered model's `quantization`: worker/engine/quantize.py): 4 bits and its blocks' scales,
# 0.52 bytes a parameter measured (tests/engine/test_quantize.py); the embeddings and output head stay bf16, a few
# percent of a large model's parameters: 0.6 covers them.
BYTES_PER_FROZEN_PARAM_NF4 = 0.6


# Device kinds: what a cost model is fitted and its priors chosen for (a CPU step is ~100x a GPU's, so a CPU run
# must not teach a GPU estimate, nor the other way round). A worker's kind comes from its heartbeat's `device`
# (`device_kind`); the GPU priors above hold for every GPU kind.
CPU_DEVICE_KIND = "cpu"
GPU_DEVICE_KIND = "cuda"


def device_kind(device: str | None) -> str:
    """A worker's device kind from its heartbeat's `device` ("cpu", "cuda:0", "cuda:0,cuda:1"; None: not said, as a
    GPU worker, the service's target)."""
    return CPU_DEVICE_KIND if device is not None and device.startswith("cpu") else GPU_DEVICE_KIND


# The CPU priors, from the packed engine on this repository's 2-core x86_64 development machine at the worker's
# default 2 torch threads (benchmarks/results/cpu_priors-cpu-20261126.json, `python -m benchmarks.cpu_priors`;
# fp32, rank 8 on every linear layer, "tokens" the planner's). A CPU step is compute-bound: its per-token time grows
# with the model's parameters, so the prior's slope is a base (the tiny model's, mostly per-layer host work) plus a
# time per token per parameter (SmolLM2-135M's slope less that base, over its parameters). Its shared and per-slot
# costs are the larger of the two models' fits. A model of unknown size is priced as SmolLM2-135M. Measured:
# - tiny-random-llama (107,200 parameters), 64-8,192 tokens: 7.9-132 ms per step; fit 7.3 ms + 1.5e-5 s per token
#   + 3e-5 s per slot.
# - SmolLM2-135M (134,515,008 parameters), 64-1,024 tokens: 0.40-6.97 s per step; fit 6.6e-3 s per token (no
#   measurable shared or per-slot part), i.e. (6.6e-3 - 1.5e-5) / 134.5e6 = 4.9e-11 s per token per parameter.
# Against the H100 priors the SmolLM2 step is ~50x slower at 1,024 tokens (6.8 s against 0.26 s): the 200x
# under-estimate of issue 32 on a CPU worker.
CPU_PRIOR_STEP_BASE_S = 7.3e-3
CPU_PRIOR_STEP_S_PER_TOKEN = 1.5e-5
CPU_PRIOR_STEP_S_PER_TOKEN_PER_PARAM = 4.9e-11
CPU_PRIOR_STEP_S_PER_SLOT = 3e-5
CPU_PRIOR_UNKNOWN_PARAMETERS = 134_515_008  # SmolLM2-135M's (common/registry.py)


def cpu_prior_step(parameters: int | None) -> StepTimeModel:
    """The prior step time of a model of `parameters` (None: unknown) on a CPU worker."""
    n = parameters if parameters is not None and parameters > 0 else CPU_PRIOR_UNKNOWN_PARAMETERS
    return StepTimeModel(a_s=CPU_PRIOR_STEP_BASE_S,
                         b_s_per_token=CPU_PRIOR_STEP_S_PER_TOKEN + CPU_PRIOR_STEP_S_PER_TOKEN_PER_PARAM * n,
                         c_s_per_slot=CPU_PRIOR_STEP_S_PER_SLOT)


def prior_cost(parameters: int | None, kind: str = GPU_DEVICE_KIND, quantization: str | None = None) -> ModelCost:
    """The cost model of a base model no pack has profiled yet on a device kind, from its parameter count (the
    registry's `parameters`; None: unknown): `PRIOR_COST`, with the frozen base's bytes as the memory's k0 when the
    count is known, so that a model larger than a GPU is never planned onto one (a 70B base is 140 GB in bf16, 42 GB
    held in NF4: `quantization`). On a
    GPU the step time stays the prior's: a size alone does not say how fast the engine steps on a given GPU; on the
    CPU it is `cpu_prior_step` of the size. The memory model is the same on both (the CPU's memory is planned as
    a GPU's is)."""
    cost = PRIOR_COST
    if kind == CPU_DEVICE_KIND:
        cost = replace(cost, step=cpu_prior_step(parameters))
    if parameters is None or parameters <= 0:
        return cost
    per_param = BYTES_PER_FROZEN_PARAM_NF4 if quantization == "nf4" else BYTES_PER_FROZEN_PARAM
    return replace(cost, memory=replace(cost.memory, k0_bytes=float(per_param * parameters)))


@dataclass(frozen=True)
class Progress:
    """What a running pack measured over its last stretch of steps (its worker's `pack.progress` report)."""

    step_s: float  # mean seconds per step
    tokens: float  # mean pooled tokens per step (padding included)
    slots: float  # mean active slots

    @classmethod
    def from_report(cls, report: dict[str, object]) -> Progress:
        step_s, tokens, slots = (float(report[k]) for k in ("step_s", "tokens", "slots"))  # type: ignore[arg-type]
        if not (step_s > 0 and tokens >= 0 and slots >= 1):
            raise ValueError(f"implausible progress report {report}")
        return cls(step_s, tokens, slots)

    def ratio(self, model: StepTimeModel) -> float:
        """Measured over predicted step time at the measured pack's own size (1.0: nothing to learn)."""
        predicted = model.predict(round(self.tokens), round(self.slots))
        return corrected(predicted, self.step_s, prior_weight=0.0)


@dataclass(frozen=True)
class ProfileSample:
    """One profiled step (a row of a pack profile's `samples`)."""

    active_slots: int
    tokens: int
    padded_tokens: int
    seconds: float
    peak_memory_bytes: int | None

    @classmethod
    def from_row(cls, row: Sequence[object]) -> ProfileSample:
        slots, tokens, padded, seconds, peak = row
        return cls(int(slots), int(tokens), int(padded), float(seconds),  # type: ignore[call-overload, arg-type]
                   None if peak is None else int(peak))  # type: ignore[call-overload]


def samples_from_profiles(profiles: Sequence[dict[str, object]]) -> list[ProfileSample]:
    """All samples of the given pack profiles (worker/profile.py's summary dicts), but those of a pack that shared
    its GPU with another pack (`shared_device`): its step times and its peak memory measured the pair."""
    out: list[ProfileSample] = []
    for profile in profiles:
        if profile.get("shared_device"):
            continue
        rows = profile.get("samples") or []
        assert isinstance(rows, list)
        out.extend(ProfileSample.from_row(row) for row in rows)
    return out


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: refit without the columns that came out negative.

    An active-set loop (a tiny NNLS) is enough for 2–3 columns and avoids a scipy dependency.
    """
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        # Drop the most negative column; the others absorb its share.
        active.pop(int(np.argmin(sol)))
    return coef


def _rank(x: np.ndarray) -> int:
    return int(np.linalg.matrix_rank(x)) if x.size else 0


def fit_profiles(samples: Sequence[ProfileSample]) -> tuple[MemoryModel, StepTimeModel]:
    """Fits memory (k0, k1) and step time (a, b, c) by non-negative least squares.

    Tokens are the padded total (`tokens + padded_tokens`): padding costs memory and time like real tokens.
    With too few distinct points for a coefficient, that coefficient falls back to its prior and the rest
    is fitted on the residual, so one sample still gives a usable (if rough) model.
    """
    if not samples:
        raise ValueError("fit_profiles needs at least one sample")
    tok = np.array([s.tokens + s.padded_tokens for s in samples], dtype=float)
    slots = np.array([s.active_slots for s in samples], dtype=float)
    secs = np.array([s.seconds for s in samples], dtype=float)
    ones = np.ones_like(tok)

    mem_rows = [(t, s.peak_memory_bytes) for t, s in zip(tok, samples, strict=True) if s.peak_memory_bytes]
    if mem_rows:
        mt = np.array([r[0] for r in mem_rows])
        mp = np.array([float(r[1] or 0) for r in mem_rows])
        if _rank(np.column_stack([np.ones_like(mt), mt])) >= 2:
            k0, k1 = _nonneg_lstsq(np.column_stack([np.ones_like(mt), mt]), mp)
        else:
            # One token count only: the slope is unknowable, so assume the prior and put the rest in k0.
            k1 = PRIOR_K1_BYTES_PER_TOKEN
            k0 = max(0.0, float(np.max(mp - k1 * mt)))
    else:
        k0, k1 = 0.0, PRIOR_K1_BYTES_PER_TOKEN
    memory = MemoryModel(float(k0), float(k1))

    design = np.column_stack([ones, tok, slots])
    if _rank(design) >= 3:
        a, b, c = _nonneg_lstsq(design, secs)
    elif _rank(design[:, :2]) >= 2:
        c = PRIOR_STEP_S_PER_SLOT if _rank(np.column_stack([ones, slots])) < 2 else 0.0
        a, b = _nonneg_lstsq(design[:, :2], np.maximum(secs - c * slots, 0.0))
    else:
        # A single point (or all alike): split it with the priors, intercept takes the remainder.
        b, c = PRIOR_STEP_S_PER_TOKEN, PRIOR_STEP_S_PER_SLOT
        mean_rest = float(np.mean(secs - b * tok - c * slots))
        if mean_rest < 0:
            # The priors over-shoot this point: scale them down so the fit passes through it.
            scale = float(np.mean(secs)) / float(np.mean(b * tok + c * slots))
            b, c, mean_rest = b * scale, c * scale, 0.0
        a = mean_rest
    return memory, StepTimeModel(float(a), float(b), float(c))


def corrected(predicted_s: float, measured_s: float, prior_weight: float, ratio: float = 1.0) -> float:
    """Exponentially smoothed measured/predicted ratio for one (model, device); returns the new ratio.

    `ratio` is the running correction so far (1.0 when there is none); `prior_weight` in [0, 1] is how much
    of it is kept per new measurement. Multiply later predictions by the result.
    """
    if not 0.0 <= prior_weight <= 1.0:
        raise ValueError("prior_weight must be in [0, 1]")
    if predicted_s <= 0 or measured_s <= 0:
        return ratio  # nothing to learn from a degenerate measurement
    return prior_weight * ratio + (1.0 - prior_weight) * (measured_s / predicted_s)


def adapter_params(d_in_out_per_module: Sequence[tuple[int, int]], rank: int) -> int:
    """Trainable LoRA parameters: `Σ rank·(d_in + d_out)` over the adapted modules (all layers listed)."""
    if rank < 0:
        raise ValueError("rank must be ≥ 0")
    return sum(rank * (d_in + d_out) for d_in, d_out in d_in_out_per_module)


def trial_duration_s(remaining_steps: int, step_s: float) -> float:
    """Seconds left for a trial; rounded up to whole milliseconds and never 0 while steps remain."""
    if remaining_steps <= 0:
        return 0.0
    # Round away float noise first (3 × 0.1 s is 300.00000000000006 ms) so the ceiling only adds real time.
    return max(math.ceil(round(remaining_steps * step_s * 1000.0, 6)) / 1000.0, 0.001)
