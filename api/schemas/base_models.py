"""Base models of the registry: what tenants see, and what operators register and edit."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints

from api.schemas.common import RequestModel, Text, UtcDateTime
from common.architectures import target_modules_for
from common.tables import BaseModelEntry

# Hub-style ids are allowed ("org/model"), but no empty segment (no leading, trailing or doubled slash).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$"
RESTORE_ACTION = "/restore"  # POST /v1/admin/models/{name}/restore (api/routes/admin_models.py)


def _not_an_action(name: str) -> str:
    """A name ending in /restore could not be read at /v1/admin/models/{name}: that path is the restore action's."""
    if name.endswith(RESTORE_ACTION):
        raise ValueError(f"A model name may not end in '{RESTORE_ACTION}' (the restore action's path).")
    return name


ModelName = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=MODEL_NAME_PATTERN),
                      AfterValidator(_not_an_action)]
ModelPath = Annotated[Text, StringConstraints(min_length=1, max_length=500)]
Description = Annotated[Text, StringConstraints(strip_whitespace=True, max_length=2000)]
GgufFile = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")]
TenantId = Annotated[Text, StringConstraints(min_length=1, max_length=40)]
TenantIds = Annotated[list[TenantId], Field(max_length=1000)]


TARGET_MODULES_DESCRIPTION = ("The names a search space's target_modules may list; \"all-linear\" is all of them "
                              "(every linear layer of the decoder except lm_head). Null: not known.")
MAX_CONTEXT_DESCRIPTION = "The longest max_seq_len a task may ask for. Null: not known."
QUANTIZATION_DESCRIPTION = ("\"nf4\": workers hold the base's linear layers in 4 bits (NormalFloat4, QLoRA: about a "
                            "quarter of bf16's memory, so larger bases fit a GPU); adapters train in the base's dtype "
                            "and merged exports merge into the de-quantised weights they were trained on. Null: as "
                            "loaded. Register the same model twice (with and without) to offer both.")
CHAT_TEMPLATE_DESCRIPTION = ("Whether the tokenizer has a chat template: without one, tasks on chat-format files "
                             "(messages) are refused. Null: not known.")


def _targets(m: BaseModelEntry) -> list[str] | None:
    """The model's LoRA target names, from its architecture (None: not known)."""
    targets = target_modules_for(m.architecture)
    return list(targets) if targets is not None else None


class ModelOut(BaseModel):
    """A model as a tenant sees it. architecture, max_context, target_modules and chat_template are null where
    unknown."""

    id: str
    object: Literal["model"] = "model"
    kind: str
    description: str
    parameters: int | None
    architecture: str | None
    max_context: int | None = Field(description=MAX_CONTEXT_DESCRIPTION)
    target_modules: list[str] | None = Field(description=TARGET_MODULES_DESCRIPTION)
    chat_template: bool | None = Field(description=CHAT_TEMPLATE_DESCRIPTION)
    quantization: Literal["nf4"] | None = Field(default=None, description=QUANTIZATION_DESCRIPTION)

    @classmethod
    def of(cls, m: BaseModelEntry) -> ModelOut:
        return cls(id=m.name, kind=m.kind, description=m.description, parameters=m.parameters,
                   architecture=m.architecture, max_context=m.max_context, target_modules=_targets(m),
                   chat_template=m.chat_template,
                   quantization=m.quantization)  # type: ignore[arg-type]  # stored only from ModelCreate's Literal


class ModelCreate(RequestModel):
    name: ModelName
    path: ModelPath = Field(description="The model directory as the workers see it.")
    description: Description = ""
    kind: Literal["hf", "gguf"] = "hf"
    file: GgufFile | None = Field(default=None, description="The GGUF file inside `path` (kind gguf only).")
    tenants: TenantIds | None = Field(default=None, description="The tenant ids that may use it; null: every tenant.")
    quantization: Literal["nf4"] | None = Field(default=None, description=QUANTIZATION_DESCRIPTION)


class ModelUpdate(RequestModel):
    """Also re-reads the model's files (architecture, max_context, chat_template), so `{}` refreshes them."""

    description: Description | None = None
    tenants: TenantIds | None = Field(default=None, description="null opens the model to every tenant.")


class AdminModelOut(BaseModel):
    """A registry entry as the operator sees it: where it lives and who may use it."""

    name: str
    object: Literal["model"] = "model"
    kind: str
    path: str | None
    file: str | None
    description: str
    parameters: int | None
    architecture: str | None
    max_context: int | None = Field(description=MAX_CONTEXT_DESCRIPTION)
    target_modules: list[str] | None = Field(description=TARGET_MODULES_DESCRIPTION)
    chat_template: bool | None = Field(description=CHAT_TEMPLATE_DESCRIPTION)
    quantization: Literal["nf4"] | None = Field(description=QUANTIZATION_DESCRIPTION)
    tenants: list[str] | None
    created_at: UtcDateTime
    updated_at: UtcDateTime | None
    deleted_at: UtcDateTime | None = Field(description="When DELETE retired it (listed with include_deleted=true).")

    @classmethod
    def of(cls, m: BaseModelEntry) -> AdminModelOut:
        return cls(
            name=m.name, kind=m.kind, path=m.path, file=m.gguf_file, description=m.description,
            parameters=m.parameters, architecture=m.architecture, max_context=m.max_context,
            target_modules=_targets(m), chat_template=m.chat_template,
            quantization=m.quantization,  # type: ignore[arg-type]  # stored only from ModelCreate's Literal
            tenants=list(m.tenants) if m.tenants is not None else None, created_at=m.created_at,
            updated_at=m.updated_at, deleted_at=m.deleted_at,
        )
