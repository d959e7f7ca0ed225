"""One error shape for every failure the API answers.

    {"error": {"type": "...", "code": "...", "message": "...", "param": "a.b[1]" | null, ...extra}}

`type` is the broad class a client branches on (OpenAI's convention); `code` is the precise, machine
readable reason; `param` names the offending request field as a dotted path; extra keys (such as the
row-level `errors` of a rejected upload) sit beside them inside the `error` object.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import DataError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount

from api.schemas.common import NO_CONTROL_CHARS

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
CONFLICT = "conflict_error"
RATE_LIMIT = "rate_limit_error"
UNAVAILABLE = "service_unavailable_error"
API_ERROR = "api_error"


class ApiError(Exception):
    """Raised anywhere below a route; rendered by the handler installed in `install_error_handlers`."""

    def __init__(
        self,
        status_code: int,
        type: str,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.type = type
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers
        self.extra = extra

    def body(self) -> dict[str, Any]:
        error = {"type": self.type, "code": self.code, "message": self.message, "param": self.param}
        return {"error": {**error, **self.extra}}


def invalid(message: str, *, param: str | None = None, code: str = "invalid_value", **extra: Any) -> ApiError:
    return ApiError(422, INVALID_REQUEST, code, message, param=param, **extra)


def not_found(kind: str, object_id: str) -> ApiError:
    """The single answer for "missing" and "belongs to another tenant": existence never leaks."""
    return ApiError(404, NOT_FOUND, f"{kind}_not_found", f"No {kind} with id '{object_id}'.")


def conflict(code: str, message: str, *, param: str | None = None) -> ApiError:
    return ApiError(409, CONFLICT, code, message, param=param)


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def param_from_loc(loc: Sequence[str | int]) -> str | None:
    """('body', 'search_space', 'learning_rate', 1) -> 'search_space.learning_rate[1]'."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


_PYDANTIC_CODES = {"missing": "missing_field", "extra_forbidden": "unknown_field", "json_invalid": "invalid_json",
                   "unknown_parameter": "unknown_field", "regex_invalid": "invalid_regex",
                   "regex_too_complex": "regex_too_complex"}
CONTROL_CHARS_MESSAGE = "Control characters (such as NUL, ESC, bell or a line break) are not allowed."


def _code_and_message(err: Any) -> tuple[str, str]:
    if err.get("type") == "string_pattern_mismatch" and (err.get("ctx") or {}).get("pattern") == NO_CONTROL_CHARS:
        return "invalid_characters", CONTROL_CHARS_MESSAGE  # rather than the pattern, which is hard to read
    return _PYDANTIC_CODES.get(str(err.get("type")), "invalid_value"), str(err.get("msg", "invalid value"))


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = []
    for err in exc.errors():
        loc = err.get("loc", ())
        # A JSON syntax error's loc ends in a character offset, not a field.
        param = None if err.get("type") == "json_invalid" else param_from_loc(loc)
        code, message = _code_and_message(err)
        errors.append({"param": param, "code": code, "message": message})
    first = errors[0] if errors else {"param": None, "code": "invalid_value", "message": "invalid request"}
    message = f"{first['param']}: {first['message']}" if first["param"] else str(first["message"])
    return invalid(message, param=first["param"], code=str(first["code"]), errors=errors)


# The methods routes take; no route declares OPTIONS: `http_error` below answers it for every path.
_ROUTE_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
DATABASE_RETRY_AFTER_S = 5  # a database restart or fail-over is usually over within seconds


def allowed_methods(request: Request) -> str:
    """The `Allow` header for the request's path: every method some route answers there, and OPTIONS.

    Found by asking each route whether it would take the path with that method (the public `matches`), so a
    405 lists the methods of every route of the path, not only those of the first one that matched it.
    """
    scope = request.scope
    # A mount that matched has moved its prefix into root_path; the probe starts from the request as it came.
    root_path = scope.get("app_root_path", scope.get("root_path", ""))
    allowed = []
    for method in _ROUTE_METHODS:
        probe = {"type": scope["type"], "path": scope["path"], "root_path": root_path, "method": method}
        for route in request.app.router.routes:
            if isinstance(route, Mount) and isinstance(route.app, StaticFiles) and method not in ("GET", "HEAD"):
                continue  # a mount matches every method; static files are only read
            if route.matches(probe)[0] == Match.FULL:
                allowed.append(method)
                break
    return ", ".join([*allowed, "OPTIONS"])


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def request_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(_validation_error(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # No route declares OPTIONS, so every OPTIONS of a known path lands here: answer it per HTTP.
            headers["Allow"] = allowed_methods(request)
            if request.method == "OPTIONS":
                return Response(status_code=204, headers=headers)
            err = ApiError(405, INVALID_REQUEST, "method_not_allowed",
                           f"Method not allowed on this route; it allows {headers['Allow']}.")
        elif exc.status_code == 404:
            err = ApiError(404, NOT_FOUND, "route_not_found", "No such route.")
        else:
            kind = INVALID_REQUEST if exc.status_code < 500 else API_ERROR
            err = ApiError(exc.status_code, kind, "http_error", str(exc.detail))
        err.headers = headers or None
        return error_response(err)

    async def database_error(_request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, DataError):
            # A value the database refused (a NUL byte, a number out of a column's range): the request's fault.
            # The schemas should have refused it first, so it is logged as the missing check it is.
            log.warning("input refused by the database: %s", exc.orig)
            return error_response(invalid("A value in the request is out of range or contains a character that "
                                          "cannot be stored.", code="invalid_value"))
        log.exception("database error", exc_info=exc)
        if isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError):  # down, unreachable or saturated
            return error_response(ApiError(503, UNAVAILABLE, "database_unavailable", "The database is unavailable.",
                                           headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)}))
        return error_response(ApiError(500, API_ERROR, "internal_error", "Internal server error."))

    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(ApiError(500, API_ERROR, "internal_error", "Internal server error."))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(Exception, unexpected)

