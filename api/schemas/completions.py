"""Sampling request bodies (issue 35): a trial's (or a task's best trial's) completion, and OpenAI's chat completions.

The answers are OpenAI's shapes (`chat.completion`, `text_completion`, and their stream chunks), built as plain JSON
in api/services/completions.py, with a `loraplane` object added (the trial, and the wait: queued, loading)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt, StringConstraints, model_validator

from api.schemas.common import ID_MAX_LENGTH, INT32_MAX, FiniteFloat, RequestModel

MAX_PROMPT_CHARS = 200_000  # a prompt or a message's content; the model's context is checked on the worker
MAX_TOKENS = 4096
NO_NUL = r"^[^\x00]*$"  # line breaks and tabs are a prompt's own; NUL is never text

PromptText = Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS, pattern=NO_NUL)]
StopText = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant"]
    content: PromptText


class SamplingParameters(RequestModel):
    """How an answer is sampled, as OpenAI's chat completions name them."""

    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS, description="New tokens at most.")
    temperature: FiniteFloat = Field(default=1.0, ge=0, le=2, description="0: greedy.")
    top_p: FiniteFloat = Field(default=1.0, gt=0, le=1, description="The nucleus' probability mass.")
    seed: int | None = Field(default=None, ge=0, le=INT32_MAX,
                             description="The same seed, prompt and adapter give the same answer; none: a random one.")
    stop: StopText | list[StopText] | None = Field(default=None, description="Up to 4 strings that end the answer "
                                                   "(left out of it).")
    stream: bool = Field(default=False, description="Server-sent events, OpenAI's chunks, then `data: [DONE]`.")
    n: Literal[1] = Field(default=1, description="Answers per request: 1.")

    @model_validator(mode="after")
    def _few_stops(self) -> SamplingParameters:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 strings")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingParameters):
    """`POST /v1/tasks/{id}[/trials/{trial_id}]/completions`: chat `messages` (rendered with the model's chat
    template, as training renders them) or a `prompt` (encoded as a prompt/completion row's prompt)."""

    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=256)
    prompt: PromptText | None = None
    checkpoint: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = Field(
        default=None, description="Sample the trial's kept checkpoint at this step (GET .../checkpoints) rather than "
                                  "its adapter; it may still be training.")

    @model_validator(mode="after")
    def _one_input(self) -> CompletionRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self


class ChatCompletionRequest(SamplingParameters):
    """`POST /v1/chat/completions`, OpenAI's: ``model`` is a task id (its best trial), ``<task id>:<trial id>``,
    ``<task id>:<trial id>:<step>`` (a kept checkpoint), or a registered base model's name (the base alone, to compare
    with)."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=2 * ID_MAX_LENGTH + 12, pattern=NO_NUL)]
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
