"""OpenAI-compatible request/response schemas (pydantic) and the OpenAI error object.

Ranges follow OpenAI's documentation; extensions follow vLLM's spelling (``ignore_eos``,
``return_token_ids``, ``top_k``) plus ours (``speculation``, ``metadata.workload``).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 4


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="Model alias, see GET /v1/models.")
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, description="vLLM extension; 0 or -1 = off.")
    n: int = Field(default=1, ge=1, le=1, description="Only n = 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**62)
    ignore_eos: bool = False
    return_token_ids: bool = False
    speculation: Literal["auto", "off"] = Field(default="auto", description="off opts this request out.")
    metadata: dict[str, str] | None = Field(default=None, description="metadata.workload names the segment.")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_values(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not isinstance(stop, str) or stop == "" for stop in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def workload(self) -> str | None:
        return (self.metadata or {}).get("workload")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="Text, or token ids.")
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """Per-request speculation figures, vLLM's names, plus the policy's reasons: the last round's, and how many of
    the request's rounds each reason decided (``prefill``, ``adaptive``, ``low_acceptance``, ``measured_slower``,
    ``pressure``, ``probe``, ... — see ``raysd.policy``), which says why a request did or did not speculate."""

    num_draft_tokens: int
    num_accepted_draft_tokens: int
    draft_acceptance_rate: float | None
    mean_acceptance_length: float | None
    num_spec_steps: int
    num_rounds: int
    policy_reason: str
    rounds_by_reason: dict[str, int] = Field(default_factory=dict)
    segment: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatChoiceMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatChoiceMessage
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: SpeculationStats | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationStats | None = None


def render_chat(messages: list[ChatMessage], tokenizer) -> str:
    """The tokenizer's chat template when it has one; otherwise a documented plain default:
    ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([m.model_dump() for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"
