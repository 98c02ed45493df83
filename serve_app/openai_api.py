"""The router's edge of the OpenAI API: reading a request into vLLM's own request models, and the
OpenAI error shape of what the router refuses itself.

vLLM's protocol classes (`ChatCompletionRequest`, `CompletionRequest`) define the surface: every
field `vllm serve` takes is taken here, with its validation and defaults. A malformed request
becomes an `ApiError`, HTTP 400, whose body names the field, before anything reaches an engine:
``{"error": {"message": ..., "type": "Bad Request", "param": "max_tokens", "code": 400}}``, with the
types vLLM's server gives: "Bad Request" for a body that does not validate, "BadRequestError" for
what vLLM's own checks refuse. The router's own refusals (413, 429, 503, the admin API) keep
OpenAI's type names.
The router adds two refusals of its own: a body that is not `application/json` (as vLLM refuses
it), and `kv_transfer_params`, which on the disaggregated path the router sets itself.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import ValidationError

# the request bodies whose errors name the field itself, not a key or position inside its value
VALUE_COLLECTIONS = frozenset({"logit_bias", "metadata", "stop", "stop_token_ids", "prompt"})
ROUTER_SET_FIELDS = ("kv_transfer_params",)  # the P/D path's own: a client's would bypass the router
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON spells half of a surrogate pair


REQUEST_INVALID = "Bad Request"  # vLLM's type for a body that does not validate (FastAPI's 400)
VLLM_REFUSED = "BadRequestError"  # ... and for what its own checks refuse


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict:
        # the status as the code, as vLLM's own error responses have it
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # Python's json accepts NaN and Infinity; OpenAI does not


def check_media_type(content_type: str | None) -> None:
    """vLLM serves `application/json` bodies only; anything else is a 400 naming the header."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(f"Unsupported Media Type: Only 'application/json' is allowed, got {media or 'none'!r}",
                       param="Content-Type", kind=REQUEST_INVALID)


def parse_openai(raw: bytes, kind: Literal["chat", "completion"]) -> Any:
    """`raw` as vLLM's request model of `kind`; ApiError (400 naming the field) when it is not one."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(f"JSON decode error: {e}", param=None, kind=REQUEST_INVALID) from None
    except RecursionError:
        raise ApiError("request body is not valid JSON: nested too deeply", param=None, kind=REQUEST_INVALID) from None
    if not isinstance(data, dict):
        raise ApiError("request body must be a JSON object", param="body", kind=REQUEST_INVALID)  # vLLM's name
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(data)) is not None:
        raise ApiError(f"{where}: not valid Unicode (a lone surrogate), which no tokenizer takes", param=where,
                       kind=REQUEST_INVALID)
    for name in ROUTER_SET_FIELDS:
        if data.get(name) is not None:
            raise ApiError(f"{name}: set by the router on the disaggregated path, not by clients", param=name,
                           kind=REQUEST_INVALID)
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise field_error(e) from None
    except VLLMValidationError as e:  # vLLM's own checks across fields, raised as they are
        raise ApiError(str(e.args[0]) if e.args else str(e), param=e.parameter, kind=VLLM_REFUSED) from None
    except RecursionError:  # a pathological value pydantic could not walk
        raise ApiError("request body is nested too deeply", param=None, kind=REQUEST_INVALID) from None


def _lone_surrogate(data: Any) -> str | None:
    """The path of the first string in `data` that is not valid Unicode (JSON may carry a lone
    surrogate, "\\ud800"); None when every one is. A collection of values is named whole."""
    todo: list[tuple[Any, tuple]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path[0] if path and path[0] in VALUE_COLLECTIONS else ".".join(map(str, path))
        elif isinstance(value, dict):
            todo.extend((v, (*path, k)) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((v, (*path, i)) for i, v in enumerate(value))
    return None


def field_error(e: ValidationError) -> ApiError:
    """The first error as a 400 naming its field (vLLM's own cleaning of pydantic's locations)."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
    from vllm.exceptions import VLLMValidationError

    first = e.errors()[0]
    named = first.get("ctx", {}).get("error")
    if isinstance(named, VLLMValidationError) and named.parameter:
        param = named.parameter
    else:
        parts = clean_loc_for_param(tuple(first["loc"])).split(".") if first["loc"] else []
        parts = [p for p in parts if not p[:1].isupper()]  # a union member's class name, not a field
        if parts and parts[0] in VALUE_COLLECTIONS:
            parts = parts[:1]
        param = ".".join(parts) or None
    # every distinct message, as vLLM's server lists them: a union's first branch may not be the one meant
    msg = "; ".join(dict.fromkeys(f"{err['msg'].removeprefix('Value error, ')} ({err['type']})"
                                  for err in e.errors()[:10]))
    return ApiError(f"{param}: {msg}" if param else msg, param=param, kind=REQUEST_INVALID)


PROMPT_PARAMS = ("input_text", "input_tokens")  # what vLLM's context-window check calls the prompt


def name_the_field(error: Any, req: Any, prompt_field: str) -> None:
    """Name the field of a vLLM error response that names none, when its message begins with one of
    the request's fields ("min_p must be in [0, 1], got 2.0."), or mentions exactly one of those the
    request set ("You must pass at least one prompt"): vLLM's checks say which field in words. What
    vLLM calls the prompt (`input_text`) is named as the request names it (`prompt_field`)."""
    if error.error.param in PROMPT_PARAMS:
        error.error.param = prompt_field
    if error.error.param is not None or error.error.code >= 500:
        return
    message = error.error.message
    head = message.split(" ", 1)[0].rstrip(":")
    if head in type(req).model_fields:
        error.error.param = head
        return
    words = set(re.findall(r"[a-z_]+", message))  # else the one field it mentions of those the request set
    named = [f for f in req.model_fields_set if f in words or f.endswith("s") and f[:-1] in words]
    if len(named) == 1:
        error.error.param = named[0]


def prompt_sizes(req: Any, chat: bool) -> list[tuple[int, bool]]:
    """Each prompt's size before rendering, as (size, in_tokens): characters of text, or token ids.
    Chat: one prompt, the characters of every message's text. What `ServedModel.too_long` bounds."""
    if chat:
        return [(sum(_text_chars(m.get("content") if isinstance(m, dict) else None) for m in req.messages), False)]
    prompt = req.prompt
    if isinstance(prompt, str):
        return [(len(prompt), False)]
    if not prompt:
        return []
    if isinstance(prompt[0], int):
        return [(len(prompt), True)]
    return [(len(p), not isinstance(p, str)) for p in prompt]


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(t) for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
    return 0
