"""What the client raises. Every failure is a `LoraplaneError`; branch on the subclass.

    APIError            the API answered with an error (4xx or 5xx); carries its error body and status
    APIConnectionError  the API could not be reached, or the connection broke (DNS, refused, timeout)
    ConfigurationError  the client lacks something to make the call (no API key, no admin token)
    WaitTimeout         `tasks.wait` / `tasks.iter_events` ran past their `timeout`
"""

from __future__ import annotations

from typing import Any

import httpx


class LoraplaneError(Exception):
    """Base of every error the client raises."""


class ConfigurationError(LoraplaneError):
    """Nothing was sent: a required setting (API key, admin token) is missing."""


class APIConnectionError(LoraplaneError):
    """The request did not get an answer: the server is unreachable, or the connection broke or timed out."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url


class WaitTimeout(LoraplaneError, TimeoutError):
    """A wait for a task ran past its `timeout`; the task goes on."""


class APIError(LoraplaneError):
    """The API's error answer: `{"error": {"type", "code", "message", "param", ...extra}}` and the HTTP status.

    Attributes:
        status_code: the HTTP status (400-599).
        type: the broad class (`invalid_request_error`, `not_found_error`, `conflict_error`, ...).
        code: the precise reason (`invalid_value`, `task_not_found`, `adapter_not_ready`, ...).
        message: the human-readable sentence.
        param: the offending request field as a dotted path (`search_space.learning_rate[0]`), or None.
        error: the whole `error` object, extra keys included (an upload's row `errors`, say).
        body: the whole response body as parsed JSON (`{"error": {...}}`).
    """

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        found = body.get("error")
        error: dict[str, Any] = found if isinstance(found, dict) else {}
        self.status_code = status_code
        self.body = body
        self.error: dict[str, Any] = dict(error)
        self.type = str(error.get("type") or ("api_error" if status_code >= 500 else "invalid_request_error"))
        self.code = str(error.get("code") or f"http_{status_code}")
        self.message = str(error.get("message") or f"HTTP {status_code}")
        param = error.get("param")
        self.param = None if param is None else str(param)
        super().__init__(self.describe())

    @property
    def is_server_error(self) -> bool:
        return self.status_code >= 500

    def describe(self) -> str:
        """One line: the message, the offending param (unless the message starts with it), status and code."""
        where = f" [param: {self.param}]" if self.param and not self.message.startswith(self.param) else ""
        return f"{self.message}{where} (HTTP {self.status_code}, {self.code})"

    @classmethod
    def from_response(cls, response: httpx.Response) -> APIError:
        """From a read response. A body that is not our error shape (a proxy's HTML page) becomes one."""
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            text = " ".join(response.text.split())[:200] or response.reason_phrase
            kind = "api_error" if response.status_code >= 500 else "invalid_request_error"
            body = {"error": {"type": kind, "code": f"http_{response.status_code}", "message": text, "param": None}}
        return cls(response.status_code, body)
