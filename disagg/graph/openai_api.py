"""OpenAI-compatible request validation and response shapes (pure: no Ray, no vLLM).

Every malformed request becomes an `ApiError` with HTTP 400 and an OpenAI-style body naming the
offending field, before anything reaches an engine:
``{"error": {"message": ..., "type": "invalid_request_error", "param": "max_tokens", "code": null}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class _Sampling(BaseModel):
    # Unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored, as vLLM's server does.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    ignore_eos: bool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list) and (len(v) > 4 or not all(isinstance(s, str) and s for s in v)):
            raise ValueError("stop must be a string or a list of up to 4 non-empty strings")
        return v

    def sampling(self, default_max_tokens: int) -> dict:
        s = {"max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
             "top_p": self.top_p, "ignore_eos": self.ignore_eos}
        if self.stop is not None:
            s["stop"] = self.stop
        if self.seed is not None:
            s["seed"] = self.seed
        return s

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and (not v or not all(isinstance(t, int) and t >= 0 for t in v)):
            raise ValueError("a token-id prompt must be a non-empty list of non-negative integers")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def parse_request(raw: bytes, kind: Literal["completion", "chat"]) -> CompletionRequest | ChatRequest:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}", param=None) from None
    if not isinstance(data, dict):
        raise ApiError("request body must be a JSON object", param=None)
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p)) or None
        return_msg = f"{param}: {first['msg']}" if param else first["msg"]
        raise ApiError(return_msg, param=param) from None


def _is_union_tag(loc_part) -> bool:
    """pydantic puts the union member tried ('str', 'list[int]') in error locations: not a field."""
    return isinstance(loc_part, str) and (loc_part in {"str", "int", "float", "bool"} or "[" in loc_part)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_body(rid: str, model: str, text: str, finish: str | None, usage: dict, chat: bool) -> dict:
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}


def stream_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False,
                 usage: dict | None = None) -> bytes:
    created = int(time.time())
    if usage is not None:
        body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model, "choices": [], "usage": usage}
    elif chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    else:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


STREAM_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
