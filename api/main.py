"""The FastAPI application: routers, error handlers, and the registry seeded at startup.

Run with `uvicorn api.main:app`; OpenAPI docs at /docs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.routing import APIRoute
from sqlalchemy.exc import IntegrityError

from api import telemetry
from api.errors import install_error_handlers
from api.limits import RequestBodyLimit
from api.routes import (
    admin,
    admin_models,
    base_models,
    checkpoints,
    cluster,
    completions,
    curves,
    dashboard,
    events,
    files,
    fine_tuning,
    health,
    integrations,
    packs,
    search_spaces,
    tasks,
    together,
    trials,
    usage,
    webhooks,
)
from common.db import session_scope
from common.registry import ensure_default_models
from common.secret_box import get_secret_box
from common.settings import get_settings

log = logging.getLogger(__name__)


def _seed_registry() -> None:
    try:
        with session_scope() as session:
            ensure_default_models(session)
    except IntegrityError:  # another API process seeded the same rows at the same moment
        log.info("model registry already seeded by another process")


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    get_secret_box()  # a missing or malformed LORAPLANE_SECRET_KEY stops the start here, named (common/secret_box.py)
    await anyio.to_thread.run_sync(_seed_registry)
    yield


def _operation_id(route: APIRoute) -> str:
    """`tasks-submit_task` rather than FastAPI's path-derived names: clean generated clients."""
    return f"{route.tags[0]}-{route.name}" if route.tags else route.name


def create_app() -> FastAPI:
    app = FastAPI(
        title="loraplane",
        summary="Multi-tenant LoRA tuning as a service: many trials on one frozen base model.",
        version="0.1.0",
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
    )
    install_error_handlers(app)
    app.include_router(health.router)
    for module in (admin, admin_models, cluster, packs, files, base_models, search_spaces, tasks, trials, checkpoints,
                   curves, events, completions, integrations, fine_tuning, together):
        app.include_router(module.router, prefix="/v1")
    app.include_router(usage.router, prefix="/v1")
    app.include_router(usage.admin_router, prefix="/v1")
    app.include_router(webhooks.router, prefix="/v1")
    dashboard.install(app)
    app.add_middleware(RequestBodyLimit, max_bytes=get_settings().max_request_bytes)  # api/limits.py
    telemetry.install(app)  # GET /metrics (admin token) and the request counters
    return app


app = create_app()
