"""A task's early-exit config: the policy and its parameters, their bounds and defaults, and the stored form
(`spec["early_exit"]`) parsed once into an `EarlyExitConfig` (pure). What each parameter does, and why its default is
what it is: policy.py's docstring and docs/early-exit.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

Policy = Literal["alto", "asha", "none"]
POLICIES: tuple[Policy, ...] = ("alto", "asha", "none")


@dataclass(frozen=True)
class Bounds:
    """A parameter's type and range, checked by `from_spec` (api/schemas/tasks.py states the same)."""

    kind: type
    low: float
    high: float
    low_open: bool = False

    def check(self, value: Any) -> str | None:
        """None when `value` fits, else why not."""
        kinds = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"must be {'an integer' if self.kind is int else 'a number'}"
        above = value > self.low if self.low_open else value >= self.low
        if not (math.isfinite(value) and above and value <= self.high):
            return f"must be {'>' if self.low_open else '>='} {self.low:g} and <= {self.high:g}"
        return None


# Each policy's parameters (the names EarlyExitConfig, the task API and the stored spec share).
PARAMETERS: dict[str, dict[str, Bounds]] = {
    "alto": {
        "window": Bounds(int, 2, 100),
        "patience_div": Bounds(int, 1, 100),
        "patience_ovf": Bounds(int, 1, 100),
        "tau_slope": Bounds(float, 0, 100),
        "tau_gap": Bounds(float, 0, 100),
        "warmup_ratio": Bounds(float, 0, 0.5, low_open=True),
        "keep_ratio": Bounds(float, 0, 1, low_open=True),
        "rungs": Bounds(int, 1, 5),
        "ema_alpha": Bounds(float, 0, 1, low_open=True),
    },
    "asha": {
        "reduction_factor": Bounds(int, 2, 64),
        "num_rungs": Bounds(int, 1, 10),
    },
    "none": {},
}


class EarlyExitSpecError(ValueError):
    """A stored or given early-exit spec that does not describe a config; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class EarlyExitConfig:
    """The policy and every parameter; only the chosen policy's parameters matter. Defaults from ALTO §5.2,
    but for the warm-up cut's (`rungs`, `keep_ratio`: see policy.py's docstring, "defaults")."""

    policy: Policy = "none"
    # alto
    window: int = 2  # w: evaluations in each slope
    patience_div: int = 2  # p_div: evaluations in a row with both slopes >= tau_slope
    patience_ovf: int = 2  # p_ovf: evaluations in a row with gap > tau_gap
    tau_slope: float = 0.001  # per evaluation (see policy.py's docstring)
    tau_gap: float = 0.1
    warmup_ratio: float = 0.05  # of each trial's own steps: the first rung
    keep_ratio: float = 0.45  # ceil(keep_ratio * n) of the n trials ranked at a rung continue past it
    rungs: int = 2  # warm-up rungs, at warmup_ratio * 2^k of each trial's own steps
    ema_alpha: float = 0.05  # per training step (see policy.py's docstring for why)
    # asha
    reduction_factor: int = 4  # eta
    num_rungs: int = 3  # rungs at R/eta^3, R/eta^2, R/eta of the task's token budget R (see asha_rungs)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise EarlyExitSpecError("policy", f"must be one of {', '.join(POLICIES)}")
        for params in PARAMETERS.values():
            for name, bounds in params.items():
                if (why := bounds.check(getattr(self, name))) is not None:
                    raise EarlyExitSpecError(name, why)


def from_spec(spec: Mapping[str, Any]) -> EarlyExitConfig:
    """The config of a task's stored `spec["early_exit"]` ({"policy": ..., and that policy's parameters});
    parameters left out take their defaults. Raises EarlyExitSpecError on an unknown policy or parameter,
    or a value out of range."""
    policy = spec.get("policy", "none")
    if policy not in POLICIES:
        raise EarlyExitSpecError("policy", f"must be one of {', '.join(POLICIES)}, not {policy!r}")
    allowed = PARAMETERS[policy]
    for name in spec:
        if name != "policy" and name not in allowed:
            takes = ", ".join(allowed) or "no parameters"
            raise EarlyExitSpecError(name, f"not a parameter of the '{policy}' policy (it takes {takes})")
    values = {k: v for k, v in spec.items() if k != "policy"}
    for name, value in values.items():  # checked in EarlyExitConfig; ints given for floats become floats
        if allowed[name].kind is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
    return EarlyExitConfig(policy=policy, **values)


def to_spec(config: EarlyExitConfig) -> dict[str, Any]:
    """The stored form: the policy and all of its parameters (from_spec(to_spec(c)) == c)."""
    return {"policy": config.policy, **{name: getattr(config, name) for name in PARAMETERS[config.policy]}}


def defaults(policy: Policy) -> dict[str, Any]:
    """The parameters `policy` takes, with their defaults."""
    base = {f.name: f.default for f in fields(EarlyExitConfig)}
    return {name: base[name] for name in PARAMETERS[policy]}
