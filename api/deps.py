"""Dependencies every route composes: a session, the calling tenant, or the admin."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.db import get_session
from api.errors import AUTHENTICATION, PERMISSION, ApiError
from common.models import ApiKey, Tenant
from common.settings import get_settings

# scope="function": the session closes when the route returns, before the response is sent, so a
# streamed response (SSE, adapter download) never holds a database connection while it streams.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

_api_key_scheme = HTTPBearer(auto_error=False, scheme_name="ApiKey", description="A tenant API key (lp_...).")
_admin_scheme = HTTPBearer(auto_error=False, scheme_name="AdminToken", description="The operator's admin token.")
_BEARER = {"WWW-Authenticate": "Bearer"}


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _unauthenticated(code: str, message: str) -> ApiError:
    return ApiError(401, AUTHENTICATION, code, message, headers=_BEARER)


def _bearer(request: Request, creds: HTTPAuthorizationCredentials | None, what: str, code: str) -> str:
    if creds is None or not creds.credentials:
        how = f"'Authorization: Bearer <{what}>'"
        if request.headers.get("authorization"):
            raise _unauthenticated("invalid_authorization", f"Send the {what} as {how}.")
        raise _unauthenticated(f"missing_{code}", f"No {what}: send {how}.")
    return creds.credentials


def get_tenant(
    request: Request,
    session: SessionDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_api_key_scheme)],
) -> Tenant:
    key = _bearer(request, creds, "API key", "api_key")
    tenant = session.scalar(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_api_key(key), ApiKey.revoked_at.is_(None))
    )
    if tenant is None:
        raise _unauthenticated("invalid_api_key", "The API key is not valid (unknown or revoked).")
    return tenant


def require_admin(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_scheme)]
) -> None:
    expected = get_settings().admin_token
    if not expected:
        raise ApiError(
            403, PERMISSION, "admin_disabled",
            "Admin endpoints are disabled: no admin token is configured (set LORAPLANE_ADMIN_TOKEN).",
        )
    token = _bearer(request, creds, "admin token", "admin_token")
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise ApiError(403, PERMISSION, "invalid_admin_token", "The admin token is not valid.")


TenantDep = Annotated[Tenant, Depends(get_tenant)]
AdminDep = Depends(require_admin)
