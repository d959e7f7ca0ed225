"""Liveness and readiness probes (no authentication)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.errors import UNAVAILABLE, ApiError
from common.bus import get_bus
from common.db import get_engine

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


def _check_database() -> None:
    with get_engine().connect() as conn:
        conn.execute(text("SELECT 1"))


def _check_bus() -> None:
    if not get_bus().ping():
        raise RuntimeError("ping answered false")


@router.get("/readyz", responses={503: {"description": "A dependency is down; `checks` says which."}})
def readyz() -> JSONResponse:
    """Ready to serve: the database answers `SELECT 1` and the bus answers a ping."""
    checks: dict[str, str] = {}
    for name, check in (("database", _check_database), ("bus", _check_bus)):
        try:
            check()
            checks[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
            log.warning("readiness check %s failed", name, exc_info=True)
            checks[name] = f"error: {type(exc).__name__}"
    failed = [name for name, state in checks.items() if state != "ok"]
    if failed:
        err = ApiError(503, UNAVAILABLE, "not_ready", f"Not ready: {', '.join(failed)} unavailable.", checks=checks)
        return JSONResponse(err.body(), status_code=503)
    return JSONResponse({"status": "ok", "checks": checks})
