"""Search spaces: expand one without submitting a task (the dashboard's "how many trials" count)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import SessionDep, TenantDep
from api.errors import invalid
from api.schemas.common import error_responses
from api.schemas.search_spaces import SearchSpaceExpand, SearchSpaceExpansion
from api.schemas.tasks import CostEstimate, SearchSpace
from api.services.estimates import estimate_task
from api.services.tasks import (
    check_context,
    check_target_modules,
    expand_trials,
    owned_file,
    require_max_trials,
    resolve_budget,
    task_space,
    train_rows,
    trial_steps,
    usable_model,
)
from common import search_space as ss
from common.architectures import target_modules_for
from common.tables import BaseModelEntry

router = APIRouter(prefix="/search-spaces", tags=["search_spaces"], responses=error_responses(401, 422))


@router.post("/expand")
def expand_search_space(
    body: SearchSpaceExpand,
    tenant: TenantDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=0, le=1000, description="At most this many trials listed.")] = 100,
) -> SearchSpaceExpansion:
    """The trials `POST /v1/tasks` would create from this space, by the same code: the same count, the same
    hyperparameters, and the same 422 where the task would be refused (a grid over `max_trials` or over the
    tenant's quota; with `base_model`, an unknown model or a module it does not have). With `base_model` and
    `training_file`, also the task's `estimate` (its budget fields as in `POST /v1/tasks`). Nothing is written."""
    require_max_trials(body.strategy, body.max_trials)
    model = usable_model(session, tenant, body.base_model) if body.base_model is not None else None
    budget, n_train = None, None
    if model is not None and body.training_file is not None:
        # The task's own checks and step counts (api/services/tasks.py).
        check_context(model, body.max_seq_len)
        train = owned_file(session, tenant, body.training_file, "training_file")
        budget = resolve_budget(epochs=body.epochs, max_steps=body.max_steps, validation_file=body.validation_file,
                                validation_split=body.validation_split, training_rows=train.rows)
        n_train = train_rows(train, budget.validation_split)
    space = _space(body, model, n_train)
    all_linear = None
    if model is not None:
        check_target_modules(model, space)
        targets = target_modules_for(model.architecture)
        all_linear = list(targets) if targets is not None else None
    trials = expand_trials(space, strategy=body.strategy, max_trials=body.max_trials, seed=body.seed, tenant=tenant)
    estimate = None
    if budget is not None and n_train is not None:
        estimate = CostEstimate.model_validate(estimate_task(
            session, base_model=str(body.base_model), configs=trials, steps=trial_steps(trials, budget, n_train),
            max_seq_len=body.max_seq_len, max_trials_per_pack=body.scheduling.max_trials_per_pack).as_dict())
    return SearchSpaceExpansion(
        strategy=body.strategy, count=len(trials), max_trials_per_task=tenant.max_trials_per_task,
        trials=[{**config, "seed": body.seed + i} for i, config in enumerate(trials[:limit])],
        has_more=len(trials) > limit, all_linear=all_linear, estimate=estimate,
    )


def _space(body: SearchSpaceExpand, model: BaseModelEntry | None, n_train: int | None) -> dict[str, ss.Dimension]:
    """The space to expand, as a task's (`task_space`): the one given (a learning rate left out set by the model's
    size; with no model, the unknown size's), or "auto"'s, which a task picks from its model's size and its training
    rows (common/search_space.py `auto_space`), so it needs both."""
    if not isinstance(body.search_space, SearchSpace) and (model is None or n_train is None):
        raise invalid('"auto" picks the space from the model\'s size and the number of training rows: give '
                      "base_model and training_file with it, as a task has them.", param="search_space",
                      code="auto_needs_model")
    return task_space(body.search_space, body.objective, model.parameters if model is not None else None,
                      n_train or 0)
