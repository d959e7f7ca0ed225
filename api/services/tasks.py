"""Creating and cancelling tasks.

`create_task` checks everything before it writes anything: the request's cross-field rules, the model (and the
request against it: target modules, max_seq_len, chat rows), the files, the expanded trials and the tenant's
quotas. Then it inserts the task, its trials and the `task.created` event, commits once, and only then wakes
the scheduler.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.db import commit
from api.deps import invalid_api_key
from api.errors import RATE_LIMIT, ApiError, conflict, invalid
from api.queries import find_file, get_task
from api.schemas.tasks import Objective as ObjectiveRequest
from api.schemas.tasks import RangeSpec, SearchSpace, TaskCreate
from api.services.estimates import estimate_task
from api.services.lengths import Shortened, check_row_lengths, record_shortened
from api.services.trackers import add_trackers, check_integrations, shown_integration
from common import search_space as ss
from common.architectures import ALL_LINEAR, target_modules_for
from common.bus import wake_scheduler
from common.datasets import PREFERENCE_FORMATS, SMALL_VALIDATION_ROWS, default_validation_split, validation_rows
from common.egress import Egress
from common.events import record_event
from common.metrics import GENERATIVE_METRICS, PREFERENCE_METRICS
from common.registry import may_use
from common.settings import get_settings
from common.states import TASK_CANCELLED, TASK_FINAL, TASK_QUEUED, TRIAL_ACTIVE, TRIAL_CANCELLED, TRIAL_PENDING
from common.tables import BaseModelEntry, File, Task, Tenant, Trial, new_id, utcnow
from common.task_spec import Evaluation, Objective, Scheduling, TaskSpec

DEFAULT_EPOCHS = 1


@dataclass(frozen=True)
class Budget:
    """The request's resolved training length and validation source."""

    epochs: int | None
    max_steps: int | None
    validation_split: float | None


def _check_request(body: TaskCreate) -> None:
    """Rules that involve more than one field (each error still names one field)."""
    if body.validation_file is not None and body.validation_split is not None:
        raise invalid("Give validation_file or validation_split, not both.", param="validation_split",
                      code="conflicting_fields")
    if body.epochs is not None and body.max_steps is not None:
        raise invalid("Give epochs or max_steps, not both.", param="max_steps", code="conflicting_fields")
    require_max_trials(body.strategy, body.max_trials)
    _check_objective(body)


def _check_objective(body: TaskCreate) -> None:
    """A DPO task's beta is given in one place, and each objective is judged by a metric it has: reward accuracy is
    a DPO task's, a generated answer an SFT task's (a preference row's prompt has two answers, neither the one)."""
    dpo, metric = body.objective.type == "dpo", body.evaluation.metric
    searched = isinstance(body.search_space, SearchSpace) and body.search_space.beta is not None
    if searched and not dpo:
        raise invalid("beta is a dimension of DPO tasks (objective.type \"dpo\"); an SFT task has none.",
                      param="search_space.beta", code="unknown_field")
    if searched and body.objective.beta is not None:
        raise invalid("Give objective.beta or search_space.beta, not both.", param="objective.beta",
                      code="conflicting_fields")
    if dpo and metric in GENERATIVE_METRICS:
        raise invalid(f"A DPO task is judged by \"loss\" or \"reward_accuracy\", not by {metric!r}.",
                      param="evaluation.metric", code="metric_not_for_objective")
    if not dpo and metric in PREFERENCE_METRICS:
        raise invalid(f"{metric!r} judges DPO tasks (objective.type \"dpo\"); an SFT task is judged by its loss or "
                      "a generative metric.", param="evaluation.metric", code="metric_not_for_objective")


def resolve_budget(
    *, epochs: int | None, max_steps: int | None, validation_file: str | None, validation_split: float | None,
    training_rows: int,
) -> Budget:
    """The request's budget with its defaults, for a training file of ``training_rows`` rows (also the
    search-space preview's, for its estimate)."""
    split = (None if validation_file is not None
             else validation_split or default_validation_split(training_rows))
    # A generative metric scores answers to validation rows, and every task has some: a validation_file, or a
    # split > 0 (the schema refuses 0; the default is common.datasets.default_validation_split's rule) that
    # `train_rows` refuses when it would hold out no row.
    return Budget(epochs=None if max_steps is not None else epochs or DEFAULT_EPOCHS, max_steps=max_steps,
                  validation_split=split)


def require_max_trials(strategy: str, max_trials: int | None) -> None:
    if strategy == "random" and max_trials is None:
        raise invalid("A random search needs max_trials.", param="max_trials", code="missing_field")


def space_of(search_space: SearchSpace) -> dict[str, ss.Dimension]:
    """The validated request's space in the pure expansion's terms (`common.search_space`)."""
    space: dict[str, ss.Dimension] = {}
    for name in ss.DIMENSIONS:
        dim = getattr(search_space, name)
        if isinstance(dim, RangeSpec):
            space[name] = ss.Range(min=dim.min, max=dim.max, num=dim.num, scale=dim.scale)
        elif dim is not None:
            space[name] = list(dim)
    return space


def normalised_space(space: dict[str, ss.Dimension]) -> dict[str, Any]:
    """The space as stored in the spec: defaults filled in; lora_alpha null means 2 x rank."""
    out: dict[str, Any] = {}
    for name in ss.DIMENSIONS:
        dim = space.get(name, ss.DEFAULTS.get(name))
        if dim is None and name in ss.OPTIONAL_DIMENSIONS:
            continue
        out[name] = (
            {"min": dim.min, "max": dim.max, "num": dim.num, "scale": dim.scale} if isinstance(dim, ss.Range) else dim
        )
    return out


def expand_trials(
    space: dict[str, ss.Dimension], *, strategy: str, max_trials: int | None, seed: int, tenant: Tenant
) -> list[dict[str, Any]]:
    """The trials' configurations, refused before they are built when they would exceed a limit.

    Task submission and the search-space preview (`POST /v1/search-spaces/expand`) both call this, so the
    count a form shows before submitting is the count the task gets."""
    quota = tenant.max_trials_per_task
    try:
        if strategy == "grid":
            size = ss.grid_size(space)
            if max_trials is not None and size > max_trials:
                raise invalid(f"The grid has {size} trials, more than max_trials={max_trials}.",
                              param="max_trials")
            if size > quota:
                raise invalid(f"The grid has {size} trials; this tenant allows at most {quota} per task.",
                              param="search_space", code="quota_exceeded")
            return ss.expand_grid(space)
        assert max_trials is not None
        if max_trials > quota:
            raise invalid(f"max_trials={max_trials}; this tenant allows at most {quota} trials per task.",
                          param="max_trials", code="quota_exceeded")
        return ss.sample_random(space, max_trials, seed)
    except ss.SearchSpaceError as exc:
        raise invalid(exc.message, param=f"search_space.{exc.param}") from exc


def usable_model(session: Session, tenant: Tenant, name: str, *, lock: bool = False) -> BaseModelEntry:
    """The registry entry a task of this tenant may name. A retired model or one the tenant may not use reads as
    unknown. `lock`: FOR SHARE, so that a concurrent DELETE (FOR NO KEY UPDATE) waits for the task, or the task for the
    retirement (and then reads deleted_at)."""
    model = session.get(BaseModelEntry, name, with_for_update={"read": True} if lock else None, populate_existing=lock)
    if model is None or model.deleted_at is not None or not may_use(model, tenant.id):
        raise invalid(f"No base model named '{name}'; see GET /v1/models.", param="base_model", code="unknown_model")
    return model


def check_target_modules(model: BaseModelEntry, space: dict[str, ss.Dimension]) -> None:
    """Every module a choice of `target_modules` names is one of the model's LoRA targets, when its architecture is
    known; "all-linear" (also the default) is always valid: it stands for all of them."""
    valid = target_modules_for(model.architecture)
    choices = space.get("target_modules")
    if valid is None or choices is None:
        return
    assert isinstance(choices, list)
    for index, choice in enumerate(choices):
        if choice == ALL_LINEAR:
            continue
        unknown = [name for name in choice if name not in valid]
        if unknown:
            raise invalid(
                f"Model '{model.name}' ({model.architecture}) has no module {', '.join(unknown)}; its LoRA "
                f"target modules are {', '.join(valid)} (\"{ALL_LINEAR}\" is all of them).",
                param=f"search_space.target_modules[{index}]", code="unknown_target_module",
            )


def check_context(model: BaseModelEntry, max_seq_len: int) -> None:
    if model.max_context is not None and max_seq_len > model.max_context:
        raise invalid(f"max_seq_len {max_seq_len} is longer than the context of model '{model.name}' "
                      f"({model.max_context} tokens); give at most {model.max_context}.", param="max_seq_len",
                      code="max_seq_len_over_context")


def _check_rows_fit_objective(file: File, field: str, objective: str) -> None:
    """Preference rows (prompt, chosen, rejected: common/datasets.py) train with the DPO objective and nothing else
    does: a file of the other kind is refused rather than trained as something it is not."""
    if objective != "dpo" and file.format in PREFERENCE_FORMATS:
        raise invalid(f"{field} '{file.id}' holds preference rows (chosen and rejected answers), which train with "
                      "the DPO objective: give \"objective\": {\"type\": \"dpo\"}, or prompt/completion or chat "
                      "rows.", param=field, code="preference_rows_need_dpo")
    if objective == "dpo" and file.format not in PREFERENCE_FORMATS:
        raise invalid(f"{field} '{file.id}' holds {file.format} rows; a DPO task trains on preference rows "
                      "({\"prompt\" or \"messages\", \"chosen\", \"rejected\"}).", param=field,
                      code="dpo_needs_preference_rows")


def _check_chat_template(model: BaseModelEntry, file: File, field: str) -> None:
    """Chat rows are rendered with the tokenizer's chat template: refused where the model has none (None: not
    known, accepted)."""
    if file.format == "messages" and model.chat_template is False:
        raise invalid(f"{field} '{file.id}' holds chat rows (messages), but model '{model.name}' has no chat "
                      "template to render them; use prompt/completion rows or a model with a chat template.",
                      param=field, code="model_has_no_chat_template")


def owned_file(session: Session, tenant: Tenant, file_id: str, field: str) -> File:
    # FOR SHARE: a concurrent DELETE of this file waits for us, then sees the task that uses it.
    file = find_file(session, tenant_id=tenant.id, file_id=file_id, lock="share")
    if file is None:
        raise invalid(f"No file with id '{file_id}'.", param=field, code="invalid_file")
    return file


def train_rows(train: File, split: float | None) -> int:
    if split is None:
        return train.rows
    held_out = validation_rows(train.rows, split)
    if held_out == 0:
        raise invalid(f"The training file has {train.rows} row(s), too few to split off a validation set; "
                      "upload more rows or a validation_file.", param="training_file", code="invalid_file")
    return train.rows - held_out


def _check_concurrency(session: Session, tenant: Tenant, new: int) -> None:
    active = session.scalar(
        select(func.count()).select_from(Trial).where(Trial.tenant_id == tenant.id, Trial.state.in_(TRIAL_ACTIVE))
    ) or 0
    limit = tenant.max_concurrent_trials
    if active + new > limit:
        raise ApiError(
            429, RATE_LIMIT, "quota_exceeded",
            f"This task adds {new} trials to the {active} pending or running; this tenant allows {limit} at once.",
        )


def _by_idempotency_key(session: Session, tenant: Tenant, key: str | None) -> Task | None:
    if key is None:
        return None
    return session.scalar(select(Task).where(Task.tenant_id == tenant.id, Task.idempotency_key == key))


def _spec(body: TaskCreate, budget: Budget, space: dict[str, ss.Dimension], steps: list[int], *,
          rows: tuple[int, int]) -> dict[str, Any]:
    """The normalised request, stored with the task: every default filled in, eval_interval resolved, and the
    (training, validation) rows a refit is sized by."""
    return TaskSpec(
        base_model=body.base_model,
        training_file=body.training_file,
        validation_file=body.validation_file,
        validation_split=budget.validation_split,
        strategy=body.strategy,
        search_space=normalised_space(space),
        max_trials=body.max_trials,
        epochs=budget.epochs,
        max_steps=budget.max_steps,
        max_seq_len=body.max_seq_len,
        eval_interval=body.eval_interval or max(1, max(steps) // 10),
        # every parameter of the policy: scheduler.early_exit.config.from_spec
        early_exit=body.early_exit.model_dump(),
        seed=body.seed,
        training=body.training.model_dump(),
        scheduling=Scheduling(**body.scheduling.model_dump()),
        evaluation=Evaluation(**body.evaluation.model_dump()),
        suffix=body.suffix,
        metadata=body.metadata,
        refit=body.refit,
        training_rows=rows[0],
        validation_rows=rows[1],
        integrations=tuple(shown_integration(i) for i in body.integrations),
        objective=Objective(type=body.objective.type, loss=body.objective.loss or "sigmoid",
                            label_smoothing=body.objective.label_smoothing or 0.0),
    ).to_stored()


def _insert(session: Session, task: Task, configs: list[dict[str, Any]], steps: list[int], seed: int) -> None:
    session.add(task)
    session.flush()  # the task row before its trials and events (foreign keys)
    for index, (config, total) in enumerate(zip(configs, steps, strict=True)):
        session.add(Trial(
            id=new_id("trial"), task_id=task.id, tenant_id=task.tenant_id, index=index, state=TRIAL_PENDING,
            hyperparameters={**config, "seed": seed + index}, total_steps=total,
        ))
    record_event(session, tenant_id=task.tenant_id, task_id=task.id, type="task.created",
                 message=f"Task created with {len(configs)} trial(s).", data={"trials": len(configs)})


def record_small_validation(session: Session, task: Task, rows: int, trials: int) -> None:
    """Warns a task of several trials whose validation set is too small to rank them (`task.small_validation`):
    the winner it gets may be the one the noise favoured (common.datasets.SMALL_VALIDATION_ROWS)."""
    if trials < 2 or rows >= SMALL_VALIDATION_ROWS:
        return
    record_event(
        session, tenant_id=task.tenant_id, task_id=task.id, type="task.small_validation", level="warn",
        message=f"{trials} trials will be ranked on {rows} validation row(s), fewer than {SMALL_VALIDATION_ROWS}: "
                "close trials cannot be told apart on so few, and the winner may be the one the noise favoured. "
                "Upload more training rows, or a validation_file of more rows.",
        data={"validation_rows": rows, "trials": trials, "recommended_rows": SMALL_VALIDATION_ROWS},
    )


@dataclass(frozen=True)
class Draft:
    """A task that passed every check, not written yet: its row (no id, not in the session) and its trials."""

    task: Task
    configs: list[dict[str, Any]]
    steps: list[int]
    shortened: list[Shortened] = field(default_factory=list)  # files whose rows max_seq_len shortens
    validation_rows: int = 0  # the rows its trials are ranked on (its validation file's, or held out of training)


def _prepare(session: Session, *, tenant: Tenant, body: TaskCreate, idempotency_key: str | None,
             egress: Egress | None) -> Task | Draft:
    """Every check of a submission, in order, and the task it would create with its estimate; or the earlier task
    of the same Idempotency-Key. Writes nothing; takes the locks a submission takes (released with the session)."""
    if existing := _by_idempotency_key(session, tenant, idempotency_key):
        return existing
    _check_request(body)
    check_integrations(body.integrations, egress or Egress(policy=get_settings().webhook_egress_policy))
    model = usable_model(session, tenant, body.base_model, lock=True)
    check_context(model, body.max_seq_len)
    train = owned_file(session, tenant, body.training_file, "training_file")
    _check_rows_fit_objective(train, "training_file", body.objective.type)
    _check_chat_template(model, train, "training_file")
    budget = resolve_budget(epochs=body.epochs, max_steps=body.max_steps, validation_file=body.validation_file,
                            validation_split=body.validation_split, training_rows=train.rows)
    files = [("training_file", train)]
    if body.validation_file is not None:
        files.append(("validation_file", owned_file(session, tenant, body.validation_file, "validation_file")))
        _check_rows_fit_objective(files[-1][1], "validation_file", body.objective.type)
        _check_chat_template(model, files[-1][1], "validation_file")
    shortened = check_row_lengths(session, model, files, body.max_seq_len)
    n_train = train_rows(train, budget.validation_split)
    n_val = files[1][1].rows if len(files) > 1 else train.rows - n_train
    space = task_space(body.search_space, body.objective, model.parameters, n_train)
    check_target_modules(model, space)
    configs = expand_trials(space, strategy=body.strategy, max_trials=body.max_trials, seed=body.seed, tenant=tenant)
    steps = trial_steps(configs, budget, n_train)
    estimate = estimate_task(session, base_model=body.base_model, configs=configs, steps=steps,
                             max_seq_len=body.max_seq_len,
                             max_trials_per_pack=body.scheduling.max_trials_per_pack).as_dict()

    # Locking the tenant row serialises the rest between concurrent submissions of one tenant, so two
    # racing requests can neither both fit in the quota nor both claim one Idempotency-Key; and against the
    # tenant's deletion (api/services/tenants.py), which takes the same lock: no task is left behind it.
    deleted_at = select(Tenant.deleted_at).where(Tenant.id == tenant.id).with_for_update(key_share=True)
    if session.scalar(deleted_at) is not None:
        raise invalid_api_key()
    if existing := _by_idempotency_key(session, tenant, idempotency_key):
        return existing
    _check_concurrency(session, tenant, len(configs))

    task = Task(
        tenant_id=tenant.id, base_model=body.base_model, training_file_id=body.training_file,
        validation_file_id=body.validation_file, state=TASK_QUEUED,
        spec=_spec(body, budget, space, steps, rows=(n_train, n_val)),
        idempotency_key=idempotency_key, created_at=utcnow(), estimate=estimate,
    )
    return Draft(task=task, configs=configs, steps=steps, shortened=shortened, validation_rows=n_val)


def task_space(search_space: SearchSpace | str, objective: ObjectiveRequest, parameters: int | None,
               n_train: int) -> dict[str, ss.Dimension]:
    """The request's search space ("auto" too) with the model's defaults (a DPO task's: its own, and its
    objective.beta its one beta); also the search-space preview's."""
    dpo = objective.type == "dpo"
    if not isinstance(search_space, SearchSpace):
        space = ss.auto_space(parameters, n_train, dpo=dpo)
    else:
        space = ss.with_size_defaults(space_of(search_space), parameters, dpo=dpo)
    if objective.beta is not None:
        space["beta"] = [objective.beta]
    return space


def trial_steps(configs: list[dict[str, Any]], budget: Budget, n_train: int) -> list[int]:
    """Each trial's optimizer steps: max_steps, or epochs over the training rows at its batch size."""
    return [budget.max_steps or (budget.epochs or DEFAULT_EPOCHS) * math.ceil(n_train / c["batch_size"])
            for c in configs]


def create_task(
    session: Session, *, tenant: Tenant, body: TaskCreate, idempotency_key: str | None = None,
    egress: Egress | None = None,
) -> tuple[Task, bool]:
    """Returns (task, created); a repeated Idempotency-Key returns the first task and False. ``egress``: the check
    of its trackers' URLs (the settings' by default)."""
    draft = _prepare(session, tenant=tenant, body=body, idempotency_key=idempotency_key, egress=egress)
    if isinstance(draft, Task):
        return draft, False
    task = draft.task
    task.id = new_id("task")
    try:
        _insert(session, task, draft.configs, draft.steps, body.seed)
        add_trackers(session, task, body.integrations)
        record_shortened(session, task, draft.shortened)
        record_small_validation(session, task, draft.validation_rows, len(draft.configs))
        session.commit()
    except IntegrityError:
        session.rollback()
        if existing := _by_idempotency_key(session, tenant, idempotency_key):  # raced where locks do nothing
            return existing, False
        raise
    wake_scheduler("task.created", task_id=task.id)
    return task, True


def dry_run_task(
    session: Session, *, tenant: Tenant, body: TaskCreate, idempotency_key: str | None = None,
    egress: Egress | None = None,
) -> Task | Draft:
    """What `create_task` would answer, written nowhere: the earlier task of the same Idempotency-Key, or the
    task it would create (with its estimate). Refused exactly as a submission; the session is rolled back."""
    try:
        return _prepare(session, tenant=tenant, body=body, idempotency_key=idempotency_key, egress=egress)
    finally:
        session.rollback()  # nothing was written; this releases the locks a submission would hold to its commit


def cancel_task(session: Session, *, tenant: Tenant, task_id: str) -> Task:
    task = get_task(session, tenant_id=tenant.id, task_id=task_id, lock=True)
    if task.state in TASK_FINAL:
        raise conflict("task_finished", f"Task '{task.id}' has already finished ({task.state}).")
    cancel_unfinished(session, [task], why="Task cancelled")
    commit(session)
    wake_scheduler("task.cancelled", task_id=task.id)
    return task


def cancel_unfinished(session: Session, tasks: Sequence[Task], *, why: str) -> None:
    """Cancels `tasks` (unfinished, locked by the caller) and their unfinished trials, with a `task.cancelled` event
    each; not committed. The scheduler stops the trials that run (it sends their packs `stop_trials`)."""
    now = utcnow()
    # Locked in id order, as the scheduler's ingest locks the trials a batch of reports names: two transactions that
    # lock the same trials in different orders can each wait for the other, and the database then fails one (a
    # cancel answered 503 while a pack over two GPUs reported its trials' points, tests/e2e/test_multi_gpu_worker.py).
    # All tasks' trials in one statement, so a tenant's deletion keeps that order across its tasks too.
    trials = session.scalars(select(Trial).where(Trial.task_id.in_([t.id for t in tasks]),
                                                 Trial.state.in_(TRIAL_ACTIVE))
                             .order_by(Trial.id).with_for_update(key_share=True))
    cancelled: Counter[str] = Counter()
    for trial in trials:
        trial.state = TRIAL_CANCELLED
        trial.stop_reason = "task cancelled"
        trial.finished_at = now
        cancelled[trial.task_id] += 1
    for task in tasks:
        task.state = TASK_CANCELLED
        task.finished_at = now
        n = cancelled[task.id]
        record_event(session, tenant_id=task.tenant_id, task_id=task.id, type="task.cancelled",
                     message=f"{why}; {n} unfinished trial(s) cancelled.", data={"trials": n})
