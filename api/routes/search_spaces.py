"""Search spaces: expand one without submitting a task (the dashboard's "how many trials" count)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import TenantDep
from api.schemas.common import error_responses
from api.schemas.search_spaces import SearchSpaceExpand, SearchSpaceExpansion
from api.services.tasks import expand_trials, require_max_trials, space_of

router = APIRouter(prefix="/search-spaces", tags=["search_spaces"], responses=error_responses(401, 422))


@router.post("/expand")
def expand_search_space(
    body: SearchSpaceExpand,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=0, le=1000, description="At most this many trials listed.")] = 100,
) -> SearchSpaceExpansion:
    """The trials `POST /v1/tasks` would create from this space, by the same code: the same count, the same
    hyperparameters, and the same 422 where the task would be refused (a grid over `max_trials` or over the
    tenant's quota). Nothing is written."""
    require_max_trials(body.strategy, body.max_trials)
    trials = expand_trials(space_of(body.search_space), strategy=body.strategy, max_trials=body.max_trials,
                           seed=body.seed, tenant=tenant)
    return SearchSpaceExpansion(
        strategy=body.strategy, count=len(trials), max_trials_per_task=tenant.max_trials_per_task,
        trials=[{**config, "seed": body.seed + i} for i, config in enumerate(trials[:limit])],
        has_more=len(trials) > limit,
    )
