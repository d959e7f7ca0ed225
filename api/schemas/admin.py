"""Admin resources: tenants, their API keys, the worker fleet, and the audit log."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from api.schemas.common import RequestModel, Text, UtcDateTime
from common.settings import get_settings
from common.tables import ApiKey, AuditEntry, Tenant, Worker, as_utc, utcnow

TenantName = Annotated[Text, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
Weight = Annotated[float, Field(gt=0, le=1000)]
Count = Annotated[int, Field(ge=1, le=1_000_000)]
Bytes = Annotated[int, Field(ge=1, le=1 << 40)]


class TenantCreate(RequestModel):
    name: TenantName
    weight: Weight = 1.0
    # None: the deployment's default (settings.default_*).
    max_concurrent_trials: Count | None = None
    max_trials_per_task: Count | None = None
    max_file_bytes: Bytes | None = None
    max_storage_bytes: Bytes | None = None  # the bytes and the number of its live files the tenant may store
    max_files: Count | None = None


class TenantUpdate(RequestModel):
    name: TenantName | None = None
    weight: Weight | None = None
    max_concurrent_trials: Count | None = None
    max_trials_per_task: Count | None = None
    max_file_bytes: Bytes | None = None
    max_storage_bytes: Bytes | None = None
    max_files: Count | None = None


class TenantOut(BaseModel):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    weight: float
    max_concurrent_trials: int
    max_trials_per_task: int
    max_file_bytes: int
    max_storage_bytes: int
    max_files: int
    created_at: UtcDateTime
    deleted_at: UtcDateTime | None = Field(default=None, description="Set once an operator deleted the tenant.")

    @classmethod
    def of(cls, t: Tenant) -> TenantOut:
        return cls(
            id=t.id, name=t.name, weight=t.weight, max_concurrent_trials=t.max_concurrent_trials,
            max_trials_per_task=t.max_trials_per_task, max_file_bytes=t.max_file_bytes,
            max_storage_bytes=t.max_storage_bytes, max_files=t.max_files, created_at=t.created_at,
            deleted_at=t.deleted_at,
        )


class ApiKeyCreate(RequestModel):
    name: Annotated[Text, StringConstraints(strip_whitespace=True, max_length=200)] = ""


class ApiKeyOut(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    prefix: str
    name: str
    created_at: UtcDateTime
    revoked_at: UtcDateTime | None = None

    @classmethod
    def of(cls, k: ApiKey) -> ApiKeyOut:
        return cls(
            id=k.id, tenant_id=k.tenant_id, prefix=k.prefix, name=k.name, created_at=k.created_at,
            revoked_at=k.revoked_at,
        )


class ApiKeyCreated(ApiKeyOut):
    key: str = Field(description="The secret. Shown only in this response; only its sha256 is stored.")


class WarmModelOut(BaseModel):
    name: str = Field(description="The registry name of a base model the worker holds loaded.")
    revision: str = Field(description="Which files it was loaded from (a fingerprint of their sizes and times).")
    bytes: int = Field(description="Its parameters and buffers on the worker's device.")
    last_used_at: UtcDateTime = Field(description="When a pack (or the preload) last took it.")


class WorkerOut(BaseModel):
    id: str
    object: Literal["worker"] = "worker"
    queue: str
    device: str
    memory_bytes: int | None = Field(description="One of its GPUs' memory (the host's for a worker on the CPU).")
    gpus: int = Field(default=1, description="GPUs of one host it owns: each of its packs runs over all of them, "
                                             "the base model sharded.")
    max_slots: int
    max_packs: int = Field(default=1, description="How many packs it runs at once (LORAPLANE_WORKER_MAX_PACKS), each "
                                                  "of another base model, within its memory.")
    free_memory_bytes: int | None = Field(
        default=None, description="Its memory less what its live packs reserved, as its newest heartbeat says: room "
                                  "for another pack beside them. Null: it does not say.")
    state: str
    current_pack_id: str | None
    models: list[str] | None = Field(
        default=None, description="The registered models its newest heartbeat says it can load (path present, "
                                  "config readable); null: it does not say, and is taken as able to load every one.")
    warm_models: list[WarmModelOut] | None = Field(
        default=None, description="The base models it holds loaded between packs, most recently used first (its "
                                  "newest heartbeat says; LORAPLANE_WORKER_MODEL_CACHE_BYTES bounds them): a pack of "
                                  "one of them starts without loading it, and the planner prefers such a worker, "
                                  "all else equal. Null: it does not say.")
    last_heartbeat: UtcDateTime
    registered_at: UtcDateTime
    quarantined_until: UtcDateTime | None = Field(
        default=None, description="It lost packs repeatedly (LORAPLANE_WORKER_QUARANTINE_LOSSES within "
                                  "LORAPLANE_WORKER_QUARANTINE_WINDOW_S): the scheduler gives it no pack until this "
                                  "time. Null: it is not quarantined.")
    recent_lost_packs: int = Field(default=0, description="Packs it lost (its process died or restarted, its "
                                                          "heartbeat stopped, a pack failed as a whole) within the "
                                                          "quarantine window before now.")

    @classmethod
    def of(cls, w: Worker) -> WorkerOut:
        now = utcnow()
        until = as_utc(w.quarantined_until) if w.quarantined_until is not None else None
        window_s = get_settings().worker_quarantine_window_s
        recent = sum(1 for t in w.lost_packs or () if now.timestamp() - window_s < float(t))
        return cls(
            id=w.id, queue=w.queue, device=w.device, memory_bytes=w.memory_bytes, gpus=w.gpus, max_slots=w.max_slots,
            max_packs=w.max_packs, free_memory_bytes=w.free_memory_bytes, state=w.state,
            current_pack_id=w.current_pack_id, models=w.models, warm_models=_warm_models(w),
            last_heartbeat=w.last_heartbeat,
            registered_at=w.registered_at, quarantined_until=until if until is not None and until > now else None,
            recent_lost_packs=recent,
        )


def _warm_models(w: Worker) -> list[WarmModelOut] | None:
    """The worker's warm models as stored from its heartbeat (ingest keeps only well-formed entries)."""
    if w.warm_models is None:
        return None
    return [WarmModelOut(name=m["name"], revision=m["revision"], bytes=m["bytes"],
                         last_used_at=datetime.fromtimestamp(float(m["last_used_at"]), UTC)) for m in w.warm_models]


class AuditEntryOut(BaseModel):
    """One read of a tenant's data by the operator (api/services/audit.py)."""

    id: str
    object: Literal["audit_entry"] = "audit_entry"
    actor: str = Field(description="'admin:' and the first 12 hex digits of the admin token's SHA-256.")
    method: str
    route: str = Field(description="The route's template, e.g. /v1/tasks/{task_id}.")
    tenant_id: str | None = Field(description="The tenant whose data was read; null for a list of every tenant's.")
    resource_id: str | None = Field(description="The last id in the route's path (a trial's, else a task's); null "
                                                "for a list.")
    created_at: UtcDateTime

    @classmethod
    def of(cls, e: AuditEntry) -> AuditEntryOut:
        return cls(id=e.id, actor=e.actor, method=e.method, route=e.route, tenant_id=e.tenant_id,
                   resource_id=e.resource_id, created_at=e.created_at)
