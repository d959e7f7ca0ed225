"""Tasks: the tuning request (with its search space) and the task object.

Every search-space value is checked here, so an error names its exact place
(`search_space.learning_rate[1]`, `search_space.lora_rank.max`). A dimension is a list of values or a
range; the wrap validators below dispatch on the input's shape themselves instead of letting pydantic
try both union members, which would report two confusing errors for one mistake.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from api.schemas.common import FiniteFloat, RequestModel, Text, UtcDateTime
from common.architectures import ALL_TARGET_MODULES
from common.metrics import DEFAULT_MAX_NEW_TOKENS, DEFAULT_METRIC, MAX_NEW_TOKENS_LIMIT, METRICS
from common.regex_policy import (
    MAX_PATTERN_LENGTH,
    MAX_PATTERN_MEMORY,
    MAX_REPEAT_COUNT,
    SYNTAX,
    PatternRefused,
    compile_pattern,
)
from common.search_space import AUTO, DEFAULT_LR_SCHEDULE
from common.settings import DEFAULT_MAX_TRIALS_PER_PACK
from common.task_spec import DEFAULT_MAX_SEQ_LEN, DEFAULT_SEED
from scheduler.planning.waits import WaitReason

# The target names of every supported architecture, in canonical order; which of them a model has is checked
# against the model at submission (api.services.tasks.check_target_modules).
MODULE_NAMES = ALL_TARGET_MODULES
ModuleName = Literal[
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"
]
assert get_args(ModuleName) == MODULE_NAMES

# Strict and finite even where they are validated outside a RequestModel (the lists of `_dimension`).
LearningRate = Annotated[FiniteFloat, Field(gt=0, le=1)]
Rank = Annotated[StrictInt, Field(ge=1, le=256)]
Alpha = Annotated[FiniteFloat, Field(gt=0, le=100_000)]
BatchSize = Annotated[StrictInt, Field(ge=1, le=1024)]
Dropout = Annotated[FiniteFloat, Field(ge=0, lt=1)]
Beta = Annotated[FiniteFloat, Field(gt=0, le=100)]
# A task's max_seq_len bounds (the Together facade's model limits say the same: api/routes/together.py).
MIN_MAX_SEQ_LEN, MAX_MAX_SEQ_LEN = 16, 8192


class RangeSpec(RequestModel):
    min: FiniteFloat
    max: FiniteFloat
    num: Annotated[StrictInt, Field(ge=1, le=1000)] | None = Field(
        default=None, description="Number of points for a grid (evenly spaced in `scale`); random draws from them."
    )
    scale: Literal["linear", "log"] = "linear"

    @model_validator(mode="after")
    def _ordered(self) -> RangeSpec:
        if self.min > self.max:
            raise PydanticCustomError("range_order", "'min' must not be greater than 'max'.")
        if self.scale == "log" and self.min <= 0:
            raise PydanticCustomError("range_log", "A log-scale range needs 'min' > 0.")
        return self


class LearningRateRange(RangeSpec):
    min: LearningRate
    max: LearningRate


class RankRange(RangeSpec):
    min: Rank
    max: Rank


class AlphaRange(RangeSpec):
    min: Alpha
    max: Alpha


class BatchSizeRange(RangeSpec):
    min: BatchSize
    max: BatchSize


class DropoutRange(RangeSpec):
    min: Dropout
    max: Dropout


class BetaRange(RangeSpec):
    min: Beta
    max: Beta


def _empty() -> PydanticCustomError:
    return PydanticCustomError("empty_list", "List at least one value.")


def _dimension(item: Any, range_model: type[RangeSpec]) -> WrapValidator:
    values: TypeAdapter[list[Any]] = TypeAdapter(list[item])

    def validate(v: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(v, list):
            if not v:
                raise _empty()
            return values.validate_python(v)  # a ValidationError here keeps its [index] location
        if isinstance(v, dict):
            return range_model.model_validate(v)
        raise PydanticCustomError("dimension_type", "Give a list of values or a range {min, max, num, scale}.")

    return WrapValidator(validate)


def _module_choice(v: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
    if v == "all-linear":
        return v
    if isinstance(v, list):
        if not v:
            raise _empty()
        names = _module_names.validate_python(v)
        return [m for m in MODULE_NAMES if m in names]  # canonical order, duplicates dropped
    raise PydanticCustomError("modules_type", "A choice is a list of module names or the string 'all-linear'.")


def _modules_dimension(v: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
    if v == "all-linear":
        return ["all-linear"]
    if isinstance(v, list):
        if not v:
            raise _empty()
        return _module_choices.validate_python(v)
    raise PydanticCustomError("modules_type", "Give a list of choices (lists of module names) or 'all-linear'.")


ModuleChoice = Annotated[list[ModuleName] | Literal["all-linear"], WrapValidator(_module_choice)]
_module_names: TypeAdapter[list[Any]] = TypeAdapter(list[ModuleName])
_module_choices: TypeAdapter[list[Any]] = TypeAdapter(list[ModuleChoice])


class SearchSpace(RequestModel):
    """Each dimension: a list of values or a range. Left out: the default (see the field)."""

    learning_rate: Annotated[
        list[LearningRate] | LearningRateRange, _dimension(LearningRate, LearningRateRange)
    ] | None = Field(default=None, description="Default: one value by the model's size, "
                                   "1e-3 below 1B parameters, 2e-4 below 20B or unknown, 1e-4 above.")
    lora_rank: Annotated[list[Rank] | RankRange, _dimension(Rank, RankRange)] | None = Field(
        default=None, description="Default [8]."
    )
    lora_alpha: Annotated[list[Alpha] | AlphaRange, _dimension(Alpha, AlphaRange)] | None = Field(
        default=None, description="Default: 2 x each trial's rank."
    )
    batch_size: Annotated[list[BatchSize] | BatchSizeRange, _dimension(BatchSize, BatchSizeRange)] | None = Field(
        default=None, description="Default [4]."
    )
    lora_dropout: Annotated[list[Dropout] | DropoutRange, _dimension(Dropout, DropoutRange)] | None = Field(
        default=None, description="Default [0.0]."
    )
    target_modules: Annotated[
        list[ModuleChoice] | Literal["all-linear"], WrapValidator(_modules_dimension)
    ] | None = Field(
        default=None,
        description='Default "all-linear": every linear layer of the decoder except lm_head. Each choice is a list of '
        'module names of the model (GET /v1/models lists them) or "all-linear".')
    beta: Annotated[list[Beta] | BetaRange, _dimension(Beta, BetaRange)] | None = Field(
        default=None, description='A DPO task\'s (objective "dpo") strength of the pull towards the base model: the '
        "implicit reward's scale. Default [0.1] (the DPO paper's); refused for an SFT task.")


def _search_space(v: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
    """ "auto", or an object of dimensions validated as `SearchSpace` (its errors keep their own locations:
    `search_space.learning_rate[1]`, not a union member's name)."""
    if v == AUTO or isinstance(v, SearchSpace):
        return v
    if not isinstance(v, dict):
        raise PydanticCustomError("search_space_type", 'Give an object of dimensions, or "auto".')
    return SearchSpace.model_validate(v)


SearchSpaceOrAuto = Annotated[SearchSpace | Literal["auto"], WrapValidator(_search_space)]


class NoEarlyExit(RequestModel):
    """Every trial trains its full budget."""

    policy: Literal["none"] = "none"


class AltoEarlyExit(RequestModel):
    """ALTO §5: stop diverging and overfitting trials as they happen, and keep the best quarter at the
    warm-up boundary. Defaults are ALTO's; scheduler/early_exit/policy.py holds the same ranges and says how each
    is read."""

    policy: Literal["alto"]
    window: Annotated[StrictInt, Field(ge=2, le=100)] = Field(
        default=2, description="Evaluations in each loss slope (w).")
    patience_div: Annotated[StrictInt, Field(ge=1, le=100)] = Field(
        default=2, description="Evaluations in a row with both slopes >= tau_slope before a diverging trial stops.")
    patience_ovf: Annotated[StrictInt, Field(ge=1, le=100)] = Field(
        default=2, description="Evaluations in a row with a gap > tau_gap before an overfitting trial stops.")
    tau_slope: Annotated[FiniteFloat, Field(ge=0, le=100)] = Field(
        default=0.001, description="Loss rise per evaluation that counts as diverging.")
    tau_gap: Annotated[FiniteFloat, Field(ge=0, le=100)] = Field(
        default=0.1, description="(val - smoothed train) / smoothed train loss that counts as overfitting.")
    warmup_ratio: Annotated[FiniteFloat, Field(gt=0, le=0.5)] = Field(
        default=0.05, description="Share of each trial's own steps before it is first ranked against the others.")
    keep_ratio: Annotated[FiniteFloat, Field(gt=0, le=1)] = Field(
        default=0.45, description="Share of the trials ranked at a warm-up rung that continue past it (rounded up).")
    rungs: Annotated[StrictInt, Field(ge=1, le=5)] = Field(
        default=2, description="Warm-up rungs, at warmup_ratio x 2^k of each trial's own steps (ALTO's: 1).")
    ema_alpha: Annotated[FiniteFloat, Field(gt=0, le=1)] = Field(
        default=0.05, description="Weight of one step's train loss in the smoothed train loss.")


class AshaEarlyExit(RequestModel):
    """Asynchronous successive halving over rungs of training tokens: at each rung only the best
    1/reduction_factor of the trials that reached it continue."""

    policy: Literal["asha"]
    reduction_factor: Annotated[StrictInt, Field(ge=2, le=64)] = Field(default=4, description="eta.")
    num_rungs: Annotated[StrictInt, Field(ge=1, le=10)] = Field(
        default=3, description="Rungs at R/eta^num_rungs .. R/eta of the task's largest token budget R.")


EARLY_EXIT_MODELS: dict[str, type[RequestModel]] = {"none": NoEarlyExit, "alto": AltoEarlyExit, "asha": AshaEarlyExit}


class _Policy(BaseModel):
    policy: Literal["none", "alto", "asha"] = "none"


def _early_exit(v: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
    """Dispatch on `policy` (default none) to that policy's model, so that an error names one parameter
    (`early_exit.window`) and a parameter of another policy says so."""
    if isinstance(v, NoEarlyExit | AltoEarlyExit | AshaEarlyExit):
        return v
    if not isinstance(v, dict):
        raise PydanticCustomError("early_exit_type", "Give an object {policy, ...that policy's parameters}.")
    policy = _Policy.model_validate({k: v[k] for k in ("policy",) if k in v}).policy  # error: early_exit.policy
    model = EARLY_EXIT_MODELS[policy]
    unknown = [k for k in v if k not in model.model_fields]
    if unknown:
        takes = ", ".join(k for k in model.model_fields if k != "policy") or "no parameters"
        raise ValidationError.from_exception_data("EarlyExit", [InitErrorDetails(
            type=PydanticCustomError("unknown_parameter", "'{name}' is not a parameter of the '{policy}' policy "
                                     "(it takes {takes}).", {"name": k, "policy": policy, "takes": takes}),
            loc=(k,), input=v[k]) for k in unknown])
    return model.model_validate(v)


EarlyExit = Annotated[NoEarlyExit | AltoEarlyExit | AshaEarlyExit, WrapValidator(_early_exit)]


class Training(RequestModel):
    """How every trial of the task trains (the same for all of them; the search space varies the rest)."""

    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default=DEFAULT_LR_SCHEDULE, description="The learning rate after warm-up; default cosine decay to zero.")
    warmup_steps: Annotated[StrictInt, Field(ge=0, le=1_000_000)] | None = Field(
        default=None, description="Steps of linear warm-up; default 3% of each trial's steps.")
    weight_decay: Annotated[FiniteFloat, Field(ge=0, le=1)] = 0.0
    max_grad_norm: Annotated[FiniteFloat, Field(gt=0)] | None = Field(
        default=None, description="Clip each trial's gradient to this global norm (its own parameters only)."
    )
    use_rslora: StrictBool = Field(default=False, description="Scale adapters by alpha/sqrt(r) instead of alpha/r.")
    checkpoints: StrictBool = Field(
        default=True, description="Keep each trial's adapter checkpoints (its epochs' ends, its best and its last: "
        "GET .../trials/{id}/checkpoints). Each is an export the pack writes beside training: they cost a pack "
        "2-4% (docs/benchmarks.md); false keeps only the trial's adapter.")
    epoch_checkpoints: Annotated[StrictInt, Field(ge=0, le=100)] | None = Field(
        default=None, description="The epoch-end checkpoints each trial keeps besides its best and its last (the "
        "newest epochs); default: every epoch's (a trial of more than 20 epochs exports at 20 epoch ends, evenly "
        "spaced); 0: the best and the last only (GET .../trials/{id}/checkpoints).")


def _not_for_metric(name: str, metric: str, reason: str) -> ValidationError:
    return ValidationError.from_exception_data("Evaluation", [InitErrorDetails(
        type=PydanticCustomError("unknown_parameter", "'{name}' is not a parameter of the '{metric}' metric "
                                 "({reason}).", {"name": name, "metric": metric, "reason": reason}),
        loc=(name,), input=None)])


MetricName = Literal["loss", "exact_match", "contains", "regex", "json_valid", "reward_accuracy"]
assert get_args(MetricName) == METRICS and DEFAULT_METRIC == "loss"


class Evaluation(RequestModel):
    """How the trials are judged, and so which one is the best (common/metrics.py scores them)."""

    metric: MetricName = Field(
        default="loss",
        description='"loss": the lowest validation loss wins. The others decode each validation row greedily with '
        "every trial's best adapter when it ends and score the share of rows whose answer passes: exact_match "
        "(the normalised answer equals the reference), contains (the normalised reference is in the answer), regex "
        "(`pattern` matches the answer), json_valid (the answer parses as JSON); the highest score wins. A DPO task "
        "(objective \"dpo\") takes \"loss\" (its validation pairs' DPO loss) or \"reward_accuracy\": the share of "
        "validation pairs whose chosen answer the trial's best adapter rewards more than the rejected one.")
    max_new_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] = Field(
        default=DEFAULT_MAX_NEW_TOKENS, description="The longest answer decoded per row (generative metrics).")
    pattern: Text | None = Field(
        default=None, min_length=1, max_length=MAX_PATTERN_LENGTH,
        description="An RE2 regular expression searched for in each answer; required by the regex metric, refused "
        "by the others. RE2 is Python's syntax without look-around, back-references, atomic groups, possessive "
        "repeats or verbose mode (a 422 invalid_regex says which). Bounded (a 422 regex_too_complex names the "
        f"limit): at most {MAX_PATTERN_LENGTH} characters, repeat counts up to {MAX_REPEAT_COUNT} (nested ones "
        f"multiplied together), and {MAX_PATTERN_MEMORY >> 20} MiB compiled.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        """RE2's compile within the policy's limits (common/regex_policy.py): the engine that judges the pattern
        here is the one the worker searches with."""
        if pattern is None:
            return None
        try:
            compile_pattern(pattern)
        except PatternRefused as exc:
            if exc.limit == SYNTAX:
                raise PydanticCustomError("regex_invalid", "Not a valid RE2 regular expression: {why}.",
                                          {"why": str(exc)}) from None
            raise PydanticCustomError("regex_too_complex", "The pattern is refused: {why}.",
                                      {"why": str(exc), "limit": exc.limit}) from None
        return pattern

    @model_validator(mode="after")
    def _pattern_iff_regex(self) -> Evaluation:
        if self.metric == "regex" and self.pattern is None:
            raise ValidationError.from_exception_data("Evaluation", [InitErrorDetails(
                type=PydanticCustomError("missing", "The regex metric needs a pattern."), loc=("pattern",),
                input=None)])
        if self.metric != "regex" and self.pattern is not None:
            raise _not_for_metric("pattern", self.metric, "only regex takes a pattern")
        return self


class Objective(RequestModel):
    """What the trials minimise: "sft", the next-token loss of the answers (prompt/completion or chat rows), or
    "dpo", Direct Preference Optimisation on preference rows (`prompt` or `messages`, `chosen`, `rejected`) against
    the base model itself as the reference."""

    type: Literal["sft", "dpo"] = "sft"
    beta: Beta | None = Field(
        default=None, description="DPO only: one beta for every trial (default 0.1); search_space.beta searches "
        "several.")
    loss: Literal["sigmoid", "ipo"] | None = Field(
        default=None, description='DPO only: "sigmoid" (the DPO paper\'s, default) or "ipo" (Azar et al. 2023, on '
        "per-token log-probabilities).")
    label_smoothing: Annotated[FiniteFloat, Field(ge=0, lt=0.5)] | None = Field(
        default=None, description="DPO only, sigmoid loss: the assumed share of pairs whose preference is flipped "
        "(conservative DPO); default 0.")

    @model_validator(mode="after")
    def _dpo_parameters(self) -> Objective:
        if self.type == "sft":
            for name in ("beta", "loss", "label_smoothing"):
                if getattr(self, name) is not None:
                    raise ValidationError.from_exception_data("Objective", [InitErrorDetails(
                        type=PydanticCustomError("unknown_parameter", "'{name}' is a parameter of the DPO "
                                                 "objective, not of SFT.", {"name": name}), loc=(name,), input=None)])
        if self.loss == "ipo" and self.label_smoothing:
            raise ValidationError.from_exception_data("Objective", [InitErrorDetails(
                type=PydanticCustomError("unknown_parameter", "label_smoothing is the sigmoid loss's, not IPO's."),
                loc=("label_smoothing",), input=None)])
        return self


class Scheduling(RequestModel):
    max_trials_per_pack: Annotated[StrictInt, Field(ge=1, le=64)] = Field(
        default=DEFAULT_MAX_TRIALS_PER_PACK,
        description="The most trials of this task that share one pack (a worker's slot cap may lower it).")


MetadataKey = Annotated[Text, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]


def _alias_error(loc: tuple[str, ...], message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data("TaskCreate", [InitErrorDetails(
        type=PydanticCustomError("alias_not_mapped", message), loc=loc, input=value)])


# OpenAI's fine-tuning hyperparameters that loraplane has no equivalent of: the field to give instead.
_UNMAPPED_HYPERPARAMETERS = {
    "learning_rate_multiplier": "give learning_rate, an absolute rate (OpenAI's multiplies a rate it keeps hidden)",
}


def openai_names(body: dict[str, Any]) -> dict[str, Any]:
    """A task body in OpenAI's / Together's names, in loraplane's: `model` is `base_model`; `hyperparameters`
    (fixed values, as those APIs take them) is one trial: each of its names of a search-space dimension becomes
    that dimension with the one value (`"auto"`: the dimension's default), `n_epochs` is `epochs`. A name given
    both ways, or a hyperparameter with no loraplane equivalent, is refused naming the field to use."""
    body = dict(body)
    if "model" in body:
        if "base_model" in body:
            raise _alias_error(("model",), "Give base_model or its alias model, not both.", body["model"])
        body["base_model"] = body.pop("model")
    if "hyperparameters" not in body:
        return body
    fixed = body.pop("hyperparameters")
    if not isinstance(fixed, dict):
        raise _alias_error(("hyperparameters",), 'Give an object of fixed values, e.g. {"learning_rate": 0.0002, '
                           '"lora_rank": 8, "n_epochs": 3}.', fixed)
    if "search_space" in body:
        raise _alias_error(("hyperparameters",), "Give search_space (the values to search) or hyperparameters "
                           "(one trial of fixed values), not both.", fixed)
    space: dict[str, Any] = {}
    for name, value in fixed.items():
        if name == "n_epochs":
            if "epochs" in body:
                raise _alias_error(("hyperparameters", name), "Give epochs or hyperparameters.n_epochs, not both.",
                                   value)
            if value != "auto":
                body["epochs"] = value
        elif name in SearchSpace.model_fields:
            if value != "auto":
                space[name] = [value]
        else:
            why = _UNMAPPED_HYPERPARAMETERS.get(name) or (
                f"unknown; loraplane's are n_epochs and the search space's: {', '.join(SearchSpace.model_fields)}")
            raise _alias_error(("hyperparameters", name), f"Hyperparameter {name!r}: {why}.", value)
    body["search_space"] = space
    return body


class MlflowIntegration(RequestModel):
    """Log every trial to an MLflow tracking server: a run each (in `experiment`, created if missing) with its
    hyperparameters as params, its train and validation loss and metric by step, its end as the run's status with
    its stop reason as a tag, and its adapter as artifacts under `adapter/` (where the server serves artifacts).
    Synced by the scheduler as the trial trains; a server that is down is caught up with later, and delays nothing."""

    type: Literal["mlflow"]
    tracking_uri: Text = Field(min_length=1, max_length=2000, description="The server's http(s) URL; it must be a "
                               "public address (or one the operator allows), as a webhook's.")
    experiment: Text = Field(default="loraplane", min_length=1, max_length=250)
    token: Text | None = Field(default=None, min_length=1, max_length=1000, description="Sent as a bearer token; "
                               "kept encrypted like a webhook's secret and never shown again.")


class WandbIntegration(RequestModel):
    """Log every trial to Weights & Biases once it ends: a run each (id the trial's, in `project`) with its
    hyperparameters as config, its curves by step, its end in the summary and its adapter as a `model` artifact.
    `offline` writes the run's files on the service's side (under the artifact store's `wandb/`, for `wandb sync`)."""

    type: Literal["wandb"]
    project: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    mode: Literal["online", "offline"] = "online"
    api_key: Text | None = Field(default=None, min_length=1, max_length=200, description="Needed online; kept "
                                 "encrypted like a webhook's secret and never shown again.")

    @model_validator(mode="after")
    def _key_online(self) -> WandbIntegration:
        if self.mode == "online" and self.api_key is None:
            raise ValueError("api_key: W&B's online mode needs the API key its runs are logged under")
        return self


Integration = Annotated[MlflowIntegration | WandbIntegration, Field(discriminator="type")]


class TaskCreate(RequestModel):
    """A tuning task. OpenAI's and Together's names are taken too: `model` for `base_model`, `hyperparameters` (one
    trial of fixed values: search-space names with one value each, and `n_epochs` for `epochs`) for `search_space`;
    `suffix` and `metadata` are kept and returned."""

    base_model: Text = Field(min_length=1, max_length=100)
    training_file: Text = Field(min_length=1, max_length=200)
    validation_file: Text | None = Field(default=None, min_length=1, max_length=200)
    validation_split: Annotated[FiniteFloat, Field(gt=0, le=0.5)] | None = Field(
        default=None, description="Fraction of the training file held out. Without it or a validation_file: 0.1, "
        "raised to hold out 128 rows where a tenth holds fewer, at most 0.25. A task of several trials ranked on "
        "fewer than 64 validation rows gets a task.small_validation warning event."
    )
    search_space: SearchSpaceOrAuto = Field(
        default=AUTO,
        description='The dimensions to search (each left out takes its default), or "auto" (the default): learning '
        'rates for the model\'s size x ranks for the dataset\'s size, six trials (docs/defaults.md).')
    strategy: Literal["grid", "random"] = "grid"
    max_trials: Annotated[StrictInt, Field(ge=1, le=10_000)] | None = None
    epochs: Annotated[StrictInt, Field(ge=1, le=100)] | None = Field(default=None, description="Default 1.")
    max_steps: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    max_seq_len: Annotated[StrictInt, Field(ge=MIN_MAX_SEQ_LEN, le=MAX_MAX_SEQ_LEN)] = DEFAULT_MAX_SEQ_LEN
    eval_interval: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, description="Steps between validations; default a tenth of the longest trial."
    )
    early_exit: EarlyExit = Field(
        default_factory=NoEarlyExit,
        description='{"policy": "none" | "alto" | "asha", ...overrides of that policy\'s parameters}; default none.')
    seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = DEFAULT_SEED
    training: Training = Field(default_factory=Training)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    evaluation: Evaluation = Field(
        default_factory=Evaluation,
        description='{"metric": "loss" | "exact_match" | "contains" | "regex" | "json_valid" | "reward_accuracy", '
        '"max_new_tokens", "pattern"}: how the best trial is chosen; default the validation loss.')
    objective: Objective = Field(
        default_factory=Objective,
        description='{"type": "sft" | "dpo", "beta", "loss", "label_smoothing"}: what the trials minimise; default '
        '"sft". A DPO task trains on preference rows (format preference or preference_messages).')
    integrations: list[Integration] = Field(default_factory=list, max_length=4, description="Experiment trackers "
                                            "every trial is logged to (MLflow, Weights & Biases).")
    refit: bool = Field(
        default=False, description="Once the search ends, train the best trial's configuration again on the "
        "training and validation rows together, for as many passes over them as the winner's adapter made over the "
        "training rows (its own trial, `refit_trial_id`; download it with GET .../adapter?refit=true). The task "
        "succeeds when the refit ends; if the refit fails, the best trial's adapter is still the result.")
    suffix: Text | None = Field(default=None, min_length=1, max_length=64,
                                description="Your label for the task (as OpenAI's `suffix`): kept and returned.")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        default=None, max_length=16, description="Up to 16 string pairs of your own (keys up to 64 characters, values "
        "up to 512), as OpenAI's `metadata`: kept and returned, not interpreted.")

    @model_validator(mode="before")
    @classmethod
    def _openai_names(cls, data: Any) -> Any:
        return openai_names(data) if isinstance(data, dict) else data


class TrialCounts(BaseModel):
    pending: int = 0
    running: int = 0
    waiting: int = 0  # held at its warm-up boundary (early exit "alto") until its task's ranking
    completed: int = 0
    stopped_early: int = 0
    failed: int = 0
    cancelled: int = 0


class BestTrial(BaseModel):
    id: str
    hyperparameters: dict[str, Any]
    best_val_loss: float | None
    best_step: int | None
    metric_score: float | None = Field(
        default=None, description="Its score on the task's generative metric (null for the loss metric).")
    selection_loss: float | None = Field(
        default=None, description="What its validation curve scored when the trials were ranked: the lowest point "
        "of the curve smoothed by an exponential average (half weight on each newest loss), so one lucky "
        "evaluation on a small validation split does not pick the winner. Its adapter is still the checkpoint of "
        "best_val_loss, at best_step.")


class Cost(BaseModel):
    tokens: int = Field(description="Σ over trials of steps x batch_size x max_seq_len: an upper bound, rows are at "
                        "most max_seq_len tokens long.")
    gpu_seconds: float = Field(description="GPU time the task's packs hold.")
    wall_seconds: float | None = Field(
        description="From submission until its last trial ends; null in an estimate when no live worker that can "
        "load the model could take the trials.")


class EstimateBasis(BaseModel):
    """What an estimate rests on (scheduler/planning/estimate.py `Basis`)."""

    source: Literal["prior", "fitted"] = Field(
        description="prior: no pack of this model has run on this device kind, the step time is the kind's prior "
        "(scheduler/planning/cost.py); fitted: fitted from the measured steps of `packs` packs of the model on it.")
    device_kind: str = Field(description='The device kind planned on: "cpu", or "cuda" for a GPU.')
    packs: int = Field(ge=0, description="The packs whose measured steps it rests on (0 for the priors).")


class CostEstimate(Cost):
    """A predicted cost, with what it rests on and the range its wall time is expected in."""

    wall_seconds_low: float | None = Field(
        default=None, description="The low end of the range the actual wall time is expected in: wider on the "
        "priors than fitted (measured ratios, scheduler/planning/estimate.py); null without wall_seconds, or for an "
        "estimate stored before bands.")
    wall_seconds_high: float | None = Field(default=None, description="The high end of that range.")
    basis: EstimateBasis | None = Field(default=None, description="What it rests on; null for an estimate stored "
                                        "before bases.")


class TaskEstimate(CostEstimate):
    """What the task was predicted to cost at submission, from the planner's cost model and the cluster then
    (api/services/estimates.py); `actual` once it ended: its usage and its wall time."""

    actual: Cost | None = Field(default=None, description="What it took (tokens trained, GPU seconds, wall seconds).")


class TaskWaiting(BaseModel):
    """Why the task's pending trials wait, as the scheduler's last plan saw it (scheduler/planning/waits.py)."""

    reason: WaitReason = Field(description="no_worker | model_not_loadable | does_not_fit | behind_pack | "
                               "planned_later | retry_backoff")
    message: str = Field(description='In words: "3 trials waiting behind pack pack-… on worker local (4 trials of '
                         'tiny-random-llama, about 3 min left); 1st in queue; starts in about 3 min".')
    position: int | None = Field(description="1 = next among the waiting tasks, in the planner's order (submission); "
                                 "null while its trials wait out a retry backoff.")
    estimated_start_at: UtcDateTime | None = Field(description="When its first waiting trial is predicted to "
                                                   "start; null when nothing predicts it.")
    waiting_trials: int = Field(description="Its pending trials that did not start.")
    pack_id: str | None = Field(default=None, description="behind_pack: the pack it waits behind.")
    worker_id: str | None = Field(default=None, description="behind_pack: that pack's worker.")
    updated_at: UtcDateTime = Field(description="When the scheduler last changed this.")


class TaskOut(BaseModel):
    id: str | None = Field(description="null only in a dry run (POST /v1/tasks?dry_run=true): nothing was written.")
    object: Literal["task"] = "task"
    tenant_id: str = Field(description="The tenant that owns it (the operator's lists show every tenant's).")
    state: str
    base_model: str
    training_file: str
    validation_file: str | None
    validation_split: float | None
    strategy: str
    search_space: dict[str, Any]
    max_trials: int | None
    epochs: int | None
    max_steps: int | None
    max_seq_len: int
    eval_interval: int
    early_exit: dict[str, Any]
    seed: int
    training: dict[str, Any]
    scheduling: dict[str, Any]
    evaluation: dict[str, Any]
    objective: dict[str, Any] = Field(default_factory=lambda: {"type": "sft"},
                                      description='{"type": "sft"} or {"type": "dpo", "loss", "label_smoothing"}.')
    trial_counts: TrialCounts
    progress: float = Field(ge=0, le=1)
    best_trial: BestTrial | None
    refit: bool = Field(default=False, description="Whether the best configuration is trained again on the "
                        "training and validation rows once the search ends.")
    refit_trial_id: str | None = Field(
        default=None, description="That refit's trial, once the search has ended (it is not ranked: its adapter is "
        "at GET .../adapter?refit=true).")
    estimated_seconds_left: float | None
    estimate: TaskEstimate | None = Field(
        default=None, description="Predicted tokens, GPU seconds and wall seconds at submission, with the `actual` "
        "once the task ended; null for a task submitted before estimates.")
    waiting: TaskWaiting | None = Field(
        default=None, description="Why its pending trials wait, where it is in the queue and when it is predicted to "
        "start; null while no trial of it waits (each change of reason is also a `task.waiting` event).")
    suffix: str | None = Field(default=None, description="The label given at submission, if any.")
    metadata: dict[str, str] | None = Field(default=None, description="The pairs given at submission, if any.")
    integrations: list[dict[str, Any]] = Field(
        default_factory=list, description="Its experiment trackers as given, without their tokens (`token_set`); how "
        "far each trial's run is synced: GET .../integrations.")
    error: str | None
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None
