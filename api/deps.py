"""Dependencies every route composes: a session, the calling tenant, the admin, or a reader (either of them)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection, and_, bindparam, select
from sqlalchemy.orm import Session

from api.db import get_session
from api.errors import AUTHENTICATION, PERMISSION, ApiError
from common.egress import Egress, Resolver, system_resolver
from common.settings import get_settings
from common.tables import ApiKey, Tenant

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


async def api_key(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_api_key_scheme)]
) -> str:
    """The bearer API key as sent, not yet checked. `async` only so that it runs on the event loop: no
    worker thread is taken for a header read, and a request without a key is answered without one."""
    return _bearer(request, creds, "API key", "api_key")


ApiKeyDep = Annotated[str, Depends(api_key)]


def invalid_api_key() -> ApiError:
    """Also what a request answers whose tenant was deleted while it ran (its key is revoked by then)."""
    return _unauthenticated("invalid_api_key", "The API key is not valid (unknown or revoked).")


ADMIN_READ_ONLY = "admin_read_only"


def admin_read_only() -> ApiError:
    """What the admin token gets on a tenant route it may not use: every write (submit, cancel, upload, ...) and the
    tenant-only reads (files, webhooks, usage). It reads tenants' tasks only (`ReaderDep`)."""
    return ApiError(403, PERMISSION, ADMIN_READ_ONLY,
                    "The admin token may only read tenants' tasks, trials, curves and events (GET); "
                    "this route acts as a tenant: use one of the tenant's API keys.")


def is_admin_token(token: str) -> bool:
    """Whether `token` is the configured admin token (constant-time; False while none is configured)."""
    expected = get_settings().admin_token
    if not expected:
        return False
    return hmac.compare_digest(token.encode(), expected.encode())


def refused_key(key: str) -> ApiError:
    """The answer for a bearer that is no valid API key: 403 for the admin token (it is valid, just not here), 401
    for any other."""
    return admin_read_only() if is_admin_token(key) else invalid_api_key()


# An API key that authenticates, its hash bound as `key_hash`. The statements are built once: building one costs
# more than running it.
VALID_KEY = and_(ApiKey.key_hash == bindparam("key_hash"), ApiKey.revoked_at.is_(None))
_CALLER_OF_KEY = select(Tenant, ApiKey.id).join(ApiKey, ApiKey.tenant_id == Tenant.id).where(VALID_KEY)
_TENANT_ID_OF_KEY = select(ApiKey.tenant_id).where(VALID_KEY)


def tenant_id_for_key(conn: Connection, key: str) -> str:
    """The tenant that owns a valid key (401 for any other key), by one indexed lookup, without loading the
    tenant: what a status poll that found no task asks (api/routes/tasks.py)."""
    tenant_id = conn.execute(_TENANT_ID_OF_KEY, {"key_hash": hash_api_key(key)}).scalar_one_or_none()
    if tenant_id is None:
        raise refused_key(key)
    return str(tenant_id)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant, and which of its keys (an event stream keeps checking that key)."""

    tenant: Tenant
    key_id: str


def get_caller(session: SessionDep, key: ApiKeyDep) -> Caller:
    row = session.execute(_CALLER_OF_KEY, {"key_hash": hash_api_key(key)}).one_or_none()
    if row is None:
        raise refused_key(key)
    # Ends the lookup's read transaction (nothing was written; the tenant stays loaded), so its connection is
    # back in the pool while this request waits for the worker thread that runs the route. Held across that
    # wait, a burst of requests (100 SSE streams opening at once) deadlocked: every worker thread waited for a
    # pooled connection that only a request waiting for a thread could give back.
    session.commit()
    return Caller(tenant=row[0], key_id=row[1])


def get_tenant(session: SessionDep, key: ApiKeyDep) -> Tenant:
    return get_caller(session, key).tenant


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
    if not is_admin_token(token):
        raise ApiError(403, PERMISSION, "invalid_admin_token", "The admin token is not valid.")


def admin_actor(token: str) -> str:
    """How the audit log names the operator: "admin:" and the first 12 hex digits of the token's SHA-256, so rows
    of a rotated token can be told apart, while the log holds nothing that helps to guess the token."""
    return "admin:" + hash_api_key(token)[:12]


@dataclass(frozen=True)
class Reader:
    """Who reads a task and what hangs off it: a tenant (its own tasks only, scoped by `tenant_id`) or the operator
    with the admin token (`tenant_id` None: any tenant's, each read written to the audit log, api/services/audit.py).
    """

    tenant_id: str | None  # None: the operator
    key_id: str | None  # the tenant's API key (its event stream keeps checking it); None for the operator
    actor: str | None  # the operator as the audit log names it; None for a tenant

    @property
    def is_admin(self) -> bool:
        return self.tenant_id is None


def operator_reader(token: str) -> Reader:
    """The operator as a reader; `token` is the admin token (the caller checked it)."""
    return Reader(tenant_id=None, key_id=None, actor=admin_actor(token))


def get_reader(session: SessionDep, key: ApiKeyDep) -> Reader:
    """A tenant's API key or the admin token. The admin token is checked first: a constant-time compare in memory,
    before a tenant key's database lookup."""
    if is_admin_token(key):
        return operator_reader(key)
    caller = get_caller(session, key)
    return Reader(tenant_id=caller.tenant.id, key_id=caller.key_id, actor=None)


TenantDep = Annotated[Tenant, Depends(get_tenant)]
CallerDep = Annotated[Caller, Depends(get_caller)]  # the tenant and its key, for a request that keeps checking it
ReaderDep = Annotated[Reader, Depends(get_reader)]
AdminDep = Depends(require_admin)


def name_resolver() -> Resolver:
    """How a tenant-given URL's host is resolved (a webhook's, a tracker's): the system's resolver. The seam for tests
    on a machine without DNS (`app.dependency_overrides[name_resolver]`, tests/egress.py); nothing else about the
    check changes."""
    return system_resolver


def outbound_egress(resolver: Annotated[Resolver, Depends(name_resolver)]) -> Egress:
    """The check a tenant-given URL passes before the service will connect to it (common/egress.py)."""
    return Egress(policy=get_settings().webhook_egress_policy, resolver=resolver)


EgressDep = Annotated[Egress, Depends(outbound_egress)]
