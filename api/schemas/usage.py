"""Usage: what a tenant's tasks took (GPU seconds, tokens), how its trials ended, what it stores."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.schemas.common import UtcDateTime


class UsageOut(BaseModel):
    object: Literal["usage"] = "usage"
    tenant_id: str
    start: UtcDateTime | None = Field(description="The window's start (`from`), null: since the beginning.")
    end: UtcDateTime = Field(description="The window's end (`to`, or now).")
    gpu_seconds: float = Field(description="The GPU time of the packs that trained the tenant's trials inside the "
                               "window, a pack's time shared among its trials by the tokens each trained there.")
    tokens: int = Field(description="Real (non-padding) tokens the tenant's trials trained, reported in the window.")
    trials: dict[str, int] = Field(description="Trials of the tasks that ended in the window, by final state.")
    storage_bytes: int = Field(description="Bytes the tenant stores now (not windowed): its uploaded files and its "
                               "trials' kept checkpoints, what its storage quota bounds.")
    checkpoint_bytes: int = Field(default=0, description="Of `storage_bytes`, its trials' kept checkpoints'.")
    sampling_tokens: int = Field(default=0, description="Prompt and answer tokens of the tenant's sampling requests "
                                 "(completions, chat completions) answered in the window.")


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[UsageOut]
