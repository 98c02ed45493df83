"""OpenAI-compatible request validation and response shapes (pure: no Ray, no vLLM).

Every malformed request becomes an `ApiError` with HTTP 400 and an OpenAI-style body naming the
offending field, before anything reaches an engine:
``{"error": {"message": ..., "type": "invalid_request_error", "param": "max_tokens", "code": null}}``.

The surface (README "HTTP API" lists the same):
- passed to the engine, validated as vLLM and OpenAI do: `max_tokens` (chat also
  `max_completion_tokens`), `temperature`, `top_p`, `top_k`, `min_p`, `frequency_penalty`,
  `presence_penalty`, `repetition_penalty`, `logit_bias`, `min_tokens`, `stop`, `stop_token_ids`,
  `seed`, `ignore_eos`, `logprobs` (completions: an int, the number of top alternatives; chat: a bool
  with `top_logprobs`), `response_format` (`text`, `json_object`, `json_schema`: vLLM's structured
  outputs), `stream`, `stream_options.include_usage`, `n` (1 only);
- answered by the router: `return_token_ids` (vLLM's): the answer carries the prompt's and the
  output's token ids (completions: `prompt_token_ids` and `token_ids` in the choice; chat:
  `prompt_token_ids` at the top, `token_ids` in the choice; streamed: the prompt's in the first
  chunk, each chunk's own output tokens in it);
- accepted and ignored because they do not change the output (`NO_OP_FIELDS`): `user`, `metadata`,
  `store`, `service_tier`; a message's `name`;
- anything else (`tools`, `functions`, `echo`, `best_of`, `suffix`, ...) is a 400 naming the field:
  a request is never served with part of it silently dropped.
Token-id checks that need the vocabulary (`logit_bias`, `stop_token_ids`) are the served model's
(`served_model.ServedModel.sampling`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_LOGPROBS = 20  # vLLM's default `max_logprobs` per token, and OpenAI's `top_logprobs` limit
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_SCHEMA_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: deeper schemas are refused there
LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf (JSON has no infinity)
NO_OP_FIELDS = ("user", "metadata", "store", "service_tier")  # accepted; they never change the output
# errors inside these name the field, not the key or the position: their entries are values, not fields
VALUE_COLLECTIONS = frozenset({"logit_bias", "metadata", "stop", "stop_token_ids", "prompt"})
# sampling-dict keys (the engine seam) → the OpenAI field a client set them with
_SEAM_TO_FIELD = {"structured_outputs": "response_format", "max_tokens": "max_tokens"}


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def openai_param(seam_key: str | None, chat: bool) -> str | None:
    """The OpenAI field behind an engine-side sampling key (an engine's validation error names the key)."""
    if seam_key == "logprobs" and chat:
        return "top_logprobs"
    return _SEAM_TO_FIELD.get(seam_key, seam_key) if seam_key else None


def _encodable(s: str, what: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can take: refuse them here."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate)") from None
    return s


def _nesting(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (iterative: the depth is what we are checking)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


class _Strict(BaseModel):
    # strict: no "3" → 3 or true → 1 coercions; forbid: an unknown field is a 400 naming it
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchema(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # vLLM's grammars always enforce the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        if self.json_schema is not None and _nesting(self.json_schema.schema_) > MAX_SCHEMA_NESTING:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_NESTING} levels")
        return self

    def structured_outputs(self) -> dict | None:
        """vLLM's StructuredOutputsParams fields, or None for plain text."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; usage in every chunk is not offered: refused if true

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, v):
        if v:
            raise ValueError("continuous usage stats are not supported")
        return v


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generators take
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    return_token_ids: bool | None = None
    # documented no-ops (NO_OP_FIELDS): validated for type, never passed on
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        strings = [v] if isinstance(v, str) else v or []
        if len(strings) > MAX_STOP or not all(s for s in strings):
            raise ValueError(f"stop must be a non-empty string or a list of up to {MAX_STOP} non-empty strings")
        for s in strings:
            _encodable(s, "stop")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is supported (one completion per request), got {v}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative integers")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _min_within_max(self):
        # ApiError, not ValueError: pydantic would report a model-level error without a field
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ApiError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}", param="min_tokens")
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        """How many alternatives per token the client asked for (0: the sampled token's only); None: none."""
        return None

    def sampling(self, default_max_tokens: int) -> dict:
        """The engine seam's sampling dict (`engine.SAMPLING_KEYS`); defaults are left out, so a
        plain request costs the engine nothing extra (e.g. no logprobs computed)."""
        s = {"max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
             "top_p": self.top_p, "ignore_eos": self.ignore_eos}
        optional = {"stop": self.stop, "seed": self.seed, "top_k": self.top_k or None,
                    "min_p": self.min_p or None, "frequency_penalty": self.frequency_penalty or None,
                    "presence_penalty": self.presence_penalty or None,
                    "repetition_penalty": None if self.repetition_penalty == 1.0 else self.repetition_penalty,
                    "min_tokens": self.min_tokens or None, "stop_token_ids": self.stop_token_ids or None,
                    "logprobs": self.top_logprobs_count,
                    "structured_outputs": self.response_format.structured_outputs() if self.response_format else None}
        s.update({k: v for k, v in optional.items() if v is not None})
        if self.logit_bias:
            s["logit_bias"] = {int(k): b for k, b in self.logit_bias.items()}
        return s

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and (not v or not all(isinstance(t, int) and t >= 0 for t in v)):
            raise ValueError("a token-id prompt must be a non-empty list of non-negative integers")
        if isinstance(v, str):
            _encodable(v, "prompt")
        return v

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_chars(self) -> int:
        """The prompt's size before tokenizing: characters, or token ids for a token-id prompt."""
        return len(self.prompt)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None  # a documented no-op: the chat template does not see it

    @field_validator("content")
    @classmethod
    def _unicode(cls, v):
        return _encodable(v, "content")


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs requires logprobs: true", param="top_logprobs")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError("max_tokens and max_completion_tokens differ: give one", param="max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
            if self.min_tokens > self.max_tokens:
                raise ApiError(f"min_tokens {self.min_tokens} exceeds max_completion_tokens {self.max_tokens}",
                               param="min_tokens")
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_chars(self) -> int:
        return sum(len(m.content) for m in self.messages)



def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # Python's json accepts NaN and Infinity; OpenAI does not


def parse_request(raw: bytes, kind: Literal["completion", "chat"]) -> CompletionRequest | ChatRequest:
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(f"request body is not valid JSON: {e}", param=None) from None
    except RecursionError:
        raise ApiError("request body is not valid JSON: nested too deeply", param=None) from None
    if not isinstance(data, dict):
        raise ApiError("request body must be a JSON object", param=None)
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        parts = [str(p) for p in first["loc"] if not _is_union_tag(p)]
        if parts and parts[0] in VALUE_COLLECTIONS:
            parts = parts[:1]
        param = ".".join(parts) if parts else None  # an unknown field may be named "" and is still named
        msg = first["msg"]
        if first["type"] == "extra_forbidden":
            msg = "unsupported field (not part of the OpenAI API this server implements); see the README"
        raise ApiError(f"{param or repr(param)}: {msg}" if param is not None else msg, param=param) from None
    except RecursionError:  # a pathological value pydantic could not walk
        raise ApiError("request body is nested too deeply", param=None) from None


def _is_union_tag(loc_part) -> bool:
    """pydantic puts the union member tried ('str', 'list[int]') in error locations: not a field."""
    return isinstance(loc_part, str) and (loc_part in {"str", "int", "float", "bool"} or "[" in loc_part)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# --- logprobs in the OpenAI shapes ----------------------------------------------------------------
# The engine gives, per output token, `(token, logprob, top)` with `top` the alternatives by rank as
# `(token, logprob)` pairs (a `messages.TokenLogprob`); these render them.

def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR) if not math.isnan(x) else LOGPROB_FLOOR


def completion_logprobs(entries, text_offset: int = 0) -> dict:
    """Completions' `logprobs`: parallel lists; `text_offset` counts from the completion's start."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        logprobs.append(_lp(e.logprob))
        tops.append({t: _lp(lp) for t, lp in e.top})
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries) -> dict:
    """Chat's `logprobs`: one record per token, each with its `top_logprobs`."""
    return {"content": [{**_chat_token(e.token, e.logprob), "top_logprobs": [_chat_token(t, lp) for t, lp in e.top]}
                        for e in entries]}


def choice_logprobs(entries, chat: bool, text_offset: int = 0) -> dict | None:
    """A choice's `logprobs` value: None when the request asked for none (`entries` is None)."""
    if entries is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries, text_offset)


def completion_body(rid: str, model: str, text: str, finish: str | None, usage: dict, chat: bool,
                    logprobs: dict | None = None, token_ids: tuple[list[int], list[int]] | None = None) -> dict:
    """A whole answer; `token_ids` (prompt, output), when the request asked for them, go where
    vLLM puts them (completions: in the choice; chat: the prompt's at the top)."""
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}
    if token_ids is not None:
        _put_token_ids(body, choice, chat, *token_ids)
    return body


def _put_token_ids(body: dict, choice: dict, chat: bool, prompt_ids, output_ids) -> None:
    """Token ids where vLLM puts them: the output's in the choice; the prompt's (None: not in this
    chunk) in the choice for completions, at the top for chat."""
    if prompt_ids is not None:
        (body if chat else choice)["prompt_token_ids"] = list(prompt_ids)
    choice["token_ids"] = list(output_ids)


def stream_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False,
                 usage: dict | None = None, logprobs: dict | None = None,
                 token_ids: tuple[list[int] | None, list[int]] | None = None) -> bytes:
    """One server-sent event; `token_ids` (the prompt's, on the first chunk only, else None; this
    chunk's output tokens) when the request asked for them."""
    created = int(time.time())
    if usage is not None:
        body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model, "choices": [], "usage": usage}
    elif chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if token_ids is not None and usage is None:
        _put_token_ids(body, choice, chat, *token_ids)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


STREAM_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
