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
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

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
                   "unknown_parameter": "unknown_field"}


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = []
    for err in exc.errors():
        loc = err.get("loc", ())
        # A JSON syntax error's loc ends in a character offset, not a field.
        param = None if err.get("type") == "json_invalid" else param_from_loc(loc)
        errors.append(
            {
                "param": param,
                "code": _PYDANTIC_CODES.get(str(err.get("type")), "invalid_value"),
                "message": str(err.get("msg", "invalid value")),
            }
        )
    first = errors[0] if errors else {"param": None, "code": "invalid_value", "message": "invalid request"}
    message = f"{first['param']}: {first['message']}" if first["param"] else str(first["message"])
    return invalid(message, param=first["param"], code=str(first["code"]), errors=errors)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def request_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(_validation_error(exc))

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err = ApiError(404, NOT_FOUND, "route_not_found", "No such route.")
        elif exc.status_code == 405:
            err = ApiError(405, INVALID_REQUEST, "method_not_allowed", "Method not allowed on this route.")
        else:
            kind = INVALID_REQUEST if exc.status_code < 500 else API_ERROR
            err = ApiError(exc.status_code, kind, "http_error", str(exc.detail))
        err.headers = dict(exc.headers or {}) or None
        return error_response(err)

    async def database_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("database error", exc_info=exc)
        if isinstance(exc, OperationalError | InterfaceError):  # the server is down or unreachable
            return error_response(ApiError(503, UNAVAILABLE, "database_unavailable", "The database is unavailable."))
        return error_response(ApiError(500, API_ERROR, "internal_error", "Internal server error."))

    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(ApiError(500, API_ERROR, "internal_error", "Internal server error."))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(Exception, unexpected)

