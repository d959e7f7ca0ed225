"""Base models of the registry."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from common.models import BaseModelEntry


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    kind: str
    description: str
    parameters: int | None

    @classmethod
    def of(cls, m: BaseModelEntry) -> ModelOut:
        return cls(id=m.name, kind=m.kind, description=m.description, parameters=m.parameters)
