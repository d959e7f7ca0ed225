"""The few calls of MLflow's REST API a tracker's sync makes (https://mlflow.org/docs/latest/rest-api.html), sent
through the egress check every tenant-given URL goes through (common/egress.py).

Why not MLflow's own client: it resolves the tracking URI's host and connects on its own, so a name that passed the
check at submission could be made to point inward later (DNS rebinding) and the scheduler would follow it. Here every
request goes to an address checked just before it (`pinned_request`, as the webhook sender's), without proxies from
the environment, redirects or kept-alive connections, and reads at most `MAX_ANSWER_BYTES` of an answer.
"""

from __future__ import annotations

import json
import logging
import ssl
from typing import Any
from urllib.parse import quote

import httpx

from common.egress import NOT_ALLOWED, Egress, EgressRefused
from scheduler.service.webhooks import pinned_request

log = logging.getLogger(__name__)

TIMEOUT_S = 30.0  # one call's limit (an artifact upload of a large adapter included)
MAX_ANSWER_BYTES = 1 << 20
ARTIFACTS_SCHEME = "mlflow-artifacts:"


class TrackerError(Exception):
    """A call that failed; its message is what the tenant is shown (`tracker_runs.last_error`): the kind of failure
    or the server's own error code, never the addresses its name resolved to."""


def artifact_path(artifact_uri: str | None) -> str | None:
    """Where a run's artifacts go through the server's artifact proxy: the path of an ``mlflow-artifacts:`` URI
    (``mlflow-artifacts:/1/<run>/artifacts`` or with an authority, ``mlflow-artifacts://host:port/1/...``); None for
    any other store (s3://, a local path), which the server does not take uploads for."""
    if not artifact_uri or not artifact_uri.startswith(ARTIFACTS_SCHEME):
        return None
    rest = artifact_uri[len(ARTIFACTS_SCHEME):]
    if rest.startswith("//"):
        rest = rest[2:].partition("/")[2]
    return rest.strip("/") or None


class MlflowRest:
    """One tracking server: ``tracking_uri``, with ``token`` sent as a bearer token if any."""

    def __init__(self, tracking_uri: str, token: str | None, egress: Egress, *,
                 verify: ssl.SSLContext | bool = True, timeout_s: float = TIMEOUT_S) -> None:
        self.base = tracking_uri.rstrip("/")
        self.token = token
        self.egress = egress
        transport = httpx.HTTPTransport(verify=verify, limits=httpx.Limits(max_keepalive_connections=0))
        self.http = httpx.Client(transport=transport, timeout=timeout_s, follow_redirects=False, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: Any = None, *, content: bytes | None = None,
             missing_ok: bool = False) -> dict[str, Any] | None:
        """The JSON answer of ``method path`` (``body`` sent as JSON, or ``content`` as bytes); None for a 404 when
        ``missing_ok``. Raises TrackerError for anything but a 2xx."""
        url = self.base + path
        try:
            target = self.egress.target(url)
        except EgressRefused as exc:
            log.warning("tracker request to %s refused before connecting: %s", url, exc)
            raise TrackerError("address not allowed" if exc.code == NOT_ALLOWED
                               else "host name does not resolve") from None
        headers = {"Content-Type": "application/json" if content is None else "application/octet-stream"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if content is None and body is not None else (content or b"")
        for address in target.addresses:
            request = pinned_request(self.http, target, address, content=data, headers=headers, method=method)
            try:
                response = self.http.send(request, stream=True)
            except httpx.ConnectError:
                continue  # the next checked address, if any
            except httpx.TimeoutException:
                raise TrackerError("timeout") from None
            except httpx.HTTPError:
                raise TrackerError("could not connect") from None
            try:
                answer = self._read(response)
            finally:
                response.close()
            if response.status_code == 404 and missing_ok:
                return None
            if not 200 <= response.status_code < 300:
                code = answer.get("error_code") if isinstance(answer, dict) else None
                raise TrackerError(f"HTTP {response.status_code}" + (f" {code}" if isinstance(code, str) else ""))
            return answer if isinstance(answer, dict) else {}
        raise TrackerError("could not connect")

    @staticmethod
    def _read(response: httpx.Response) -> Any:
        raw = b""
        for chunk in response.iter_bytes():
            raw += chunk
            if len(raw) > MAX_ANSWER_BYTES:
                raise TrackerError("answer too large")
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return None

    # -- the calls ----------------------------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        """The experiment's id, created if it does not exist."""
        found = self.call("GET", f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={quote(name, safe='')}",
                          missing_ok=True)
        if found and "experiment" in found:
            return str(found["experiment"]["experiment_id"])
        try:
            created = self.call("POST", "/api/2.0/mlflow/experiments/create", {"name": name}) or {}
        except TrackerError as exc:  # created meanwhile by another task's sync
            if "RESOURCE_ALREADY_EXISTS" not in str(exc):
                raise
            return self.experiment_id(name)
        return str(created["experiment_id"])

    def find_run(self, experiment_id: str, tag: str, value: str) -> tuple[str, str | None] | None:
        """(run id, artifact URI) of a run of the experiment tagged ``tag`` = ``value``, if any: a run created
        before a crash took away the record of it is found again rather than created twice."""
        answer = self.call("POST", "/api/2.0/mlflow/runs/search", {
            "experiment_ids": [experiment_id], "filter": f"tags.`{tag}` = '{value}'", "max_results": 1})
        runs = (answer or {}).get("runs") or []
        if not runs:
            return None
        info = runs[0]["info"]
        return str(info["run_id"]), info.get("artifact_uri")

    def create_run(self, experiment_id: str, name: str, start_ms: int, tags: dict[str, str]) -> tuple[str, str | None]:
        answer = self.call("POST", "/api/2.0/mlflow/runs/create", {
            "experiment_id": experiment_id, "run_name": name, "start_time": start_ms,
            "tags": [{"key": k, "value": v} for k, v in tags.items()]})
        info = (answer or {})["run"]["info"]
        return str(info["run_id"]), info.get("artifact_uri")

    def log_batch(self, run_id: str, *, metrics: list[dict[str, Any]] | None = None,
                  params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
        self.call("POST", "/api/2.0/mlflow/runs/log-batch", {
            "run_id": run_id, "metrics": metrics or [],
            "params": [{"key": k, "value": v} for k, v in (params or {}).items()],
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]})

    def upload_artifact(self, artifacts_at: str, name: str, data: bytes) -> None:
        """``data`` as the artifact ``name`` of a run whose artifacts are at ``artifacts_at`` (`artifact_path`)."""
        self.call("PUT", f"/api/2.0/mlflow-artifacts/artifacts/{quote(artifacts_at)}/{quote(name)}", content=data)

    def finish_run(self, run_id: str, status: str, end_ms: int) -> None:
        self.call("POST", "/api/2.0/mlflow/runs/update", {"run_id": run_id, "status": status, "end_time": end_ms})
