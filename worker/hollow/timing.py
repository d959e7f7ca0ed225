"""How long a hollow worker's pack step takes (pure): the planner's own cost model (scheduler/planning/cost.py) for
the pack's base model on a GPU, at the step's pooled tokens (each stepping trial's `tokens_per_step`, as the planner
counts them: batch size x max_seq_len, twice for DPO) and active slots; times a noise factor; divided by the time
scale for the wall clock it sleeps."""

from __future__ import annotations

import random
from dataclasses import dataclass

from common.registry import DEFAULT_MODELS
from scheduler.planning.cost import GPU_DEVICE_KIND, StepTimeModel, prior_cost, tokens_per_step

NOISE_FLOOR = 0.1  # a step never takes less than a tenth of its predicted time, whatever the noise draws


@dataclass(frozen=True)
class TimingModel:
    """``time_scale``: model seconds per wall second (10: a step the cost model puts at 0.3 s sleeps 0.03 s);
    ``noise``: the relative standard deviation of each step's time around the prediction (0: exactly it)."""

    time_scale: float = 1.0
    noise: float = 0.0

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not self.noise >= 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")


def step_model(base_model: str) -> StepTimeModel:
    """The planner's step-time model of ``base_model`` before any profile: its GPU prior (`prior_cost` of the
    registered size where the registry's defaults know it; on a GPU the prior's step time does not depend on it)."""
    parameters = next((m.parameters for m in DEFAULT_MODELS if m.name == base_model), None)
    return prior_cost(parameters, GPU_DEVICE_KIND).step


def trial_tokens(batch_size: int, max_seq_len: int, *, dpo: bool) -> int:
    """A trial's tokens in a pack step, as the planner counts them (`cost.tokens_per_step`)."""
    hyperparameters: dict[str, float] = {"batch_size": batch_size, **({"beta": 0.1} if dpo else {})}
    return tokens_per_step(hyperparameters, max_seq_len)


def noise_factor(rng: random.Random, noise: float) -> float:
    """One step's multiplier around 1 (Gaussian, relative standard deviation ``noise``, at least `NOISE_FLOOR`)."""
    return max(NOISE_FLOOR, rng.gauss(1.0, noise)) if noise > 0 else 1.0


def step_seconds(model: StepTimeModel, tokens: int, slots: int, factor: float) -> float:
    """The step's time on the simulated GPU, in model seconds: what the hollow worker reports as measured."""
    return model.predict(tokens, slots) * factor


def wall_seconds(model_seconds: float, timing: TimingModel) -> float:
    """What the step sleeps: its model time compressed by the time scale."""
    return model_seconds / timing.time_scale
