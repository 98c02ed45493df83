"""vLLM's OpenAI API, case by case: what the router must answer because vLLM 0.32 answers it.

Every case replays one of vLLM's own tests under tests/entrypoints/openai/ (its `source`) against the
live stack: the openai SDK for the endpoints, raw HTTP for the errors. The served model is the tiny
random-weight Qwen2 (ChatML template, 2,048-token vocabulary and context), so its text is gibberish and
the checks are structural (shapes, counts, indexes, finish reasons, usage arithmetic) and exact wherever
vLLM forces the output: greedy decoding, seeds, logit biases, allowed and banned tokens, stop strings
and token ids, structured outputs, and the token ids of the prompt vLLM renders (the tokenizer and chat
template are loaded here to compute them).

What each group pins:

- chat, basics: the response's ids and objects, the chat template applied to string content, text
  parts (joined with a newline), custom roles, history and unknown message fields; max_completion_tokens
  over max_tokens; min_tokens holding back EOS; a greedy stream equal to the whole answer.
- chat, sampling: logit_bias (forcing and banning), allowed_token_ids, bad_words, stop strings with and
  without include_stop_str_in_output, stop_token_ids, seeds.
- chat, logprobs: `logprobs`/`top_logprobs` shapes streamed and not, prompt_logprobs,
  return_tokens_as_token_ids (`token_id:N` strings), return_token_ids (prompt ids once, output ids per
  choice or chunk).
- chat, n and stream_options: n choices indexed 0..n-1 with the usage summed over them, a seed giving
  the same n answers again; usage only in the trailing chunk, or in every chunk with
  continuous_usage_stats.
- chat, structured outputs: `structured_outputs` choice / regex / grammar / json and `response_format`
  json_object / json_schema / text; the output matches (an answer cut by max_tokens must be a prefix
  of a valid document).
- chat, tools: `required` and a named function are forced through vLLM's grammar into valid calls
  (the CPU profile configures the hermes tool parser, as vLLM's own test does), `auto` and `none`
  are served; tool-call history renders through the template.
- chat, template and echo: add_generation_prompt / continue_final_message and `echo` (vLLM has it on
  chat too: the final message is prepended when its role is the answer's), prompt truncation.
- completions: text, token-id and batched prompts (choices indexed over prompts, then n), the default
  max_tokens of 16, echo (with logprobs, with max_tokens 0), logprobs shapes and text offsets,
  prompt_logprobs, stream_options, stop strings, structured outputs, beam search, token ids, truncation.
- models: the served card in /v1/models and by id; an unknown id is a 404.
- errors: the status and `{"error": {"message", "type", "param", "code"}}` vLLM answers (code is the
  status; type "BadRequestError" for vLLM's own checks, "Bad Request" for FastAPI's request validation,
  "NotFoundError" for unknown models); `param` and message fragments only where vLLM's code sets them.

Where the router answers differently from vLLM, on purpose (each case says so in its `note`): it names
the request's field where vLLM's `param` is null or internal (`NAMES_THE_FIELD`), and it answers a
request refused by an engine with its status before streaming, where vLLM's server sends a 200 and an
error event.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

MODEL = "tiny-qwen2"
MAX_MODEL_LEN = 2048
EOS = 2  # <|im_end|>, the tiny model's end of sequence

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

BAD = "BadRequestError"  # vLLM's own checks (VLLMValidationError, ValueError)
BAD_REQUEST = "Bad Request"  # FastAPI's request validation: pydantic, JSON, content type
NOT_FOUND = "NotFoundError"
UNCHECKED = object()

GREEDY = {"temperature": 0.0}
EXACT = {"ignore_eos": True}
IDS = {"return_token_ids": True}

# vLLM's tests the cases come from
T_CHAT = "tests/entrypoints/openai/chat_completion/test_chat.py"
T_CHAT_COMPLETION = "tests/entrypoints/openai/chat_completion/test_chat_completion.py"
T_CHAT_ERROR = "tests/entrypoints/openai/chat_completion/test_chat_error.py"
T_SERVING_CHAT = "tests/entrypoints/openai/chat_completion/test_serving_chat.py"
T_FUNCTIONS = "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py"
T_TOOL_NULL = "tests/entrypoints/openai/chat_completion/test_tool_choice_null.py"
T_NON_OBJECT = "tests/entrypoints/openai/chat_completion/test_non_object_body_validation.py"
T_STOP_IDS = "tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py"
T_CMPL = "tests/entrypoints/openai/completion/test_completion.py"
T_CMPL_OLD = "tests/entrypoints/openai/test_completion.py"
T_CMPL_ERROR = "tests/entrypoints/openai/completion/test_completion_error.py"
T_TEXT_OFFSET = "tests/entrypoints/openai/completion/test_completion_text_offset.py"
T_PROMPT_VALIDATION = "tests/entrypoints/openai/completion/test_prompt_validation.py"
T_EMPTY_PROMPT_LIST = "tests/entrypoints/openai/completion/test_empty_prompt_list.py"
T_LORA_RESOLVERS = "tests/entrypoints/openai/completion/test_lora_resolvers.py"
T_BASIC = "tests/entrypoints/openai/basic/test_basic.py"
T_ECHO = "tests/entrypoints/openai/basic/test_chat_echo.py"
T_LOGIT_BIAS = "tests/entrypoints/openai/basic/test_chat_logit_bias_validation.py"
T_TOKEN_IDS = "tests/entrypoints/openai/basic/test_return_token_ids.py"
T_TEMPLATE = "tests/entrypoints/openai/basic/test_chat_template.py"
T_TOKENS_AS_IDS = "tests/entrypoints/openai/test_return_tokens_as_ids.py"
T_MODELS = "tests/entrypoints/openai/models/test_models.py"

NAMES_THE_FIELD = ("Where vLLM's answer names no field (param null) or an internal one (`body.seed`, "
                   "`input_tokens`, `logprobs` for a chat's `top_logprobs`), the router names the request's "
                   "field; status, type and message are vLLM's")
TOOL_NOTE = ("served with model.openai.tool_call_parser hermes (deployments/local.yaml), as vLLM's own test; "
             "strict enum-only tools and a logit bias against whitespace tokens let the random-weight model "
             "finish the forced call within max_tokens")

# --- request material (vLLM's test fixtures where they fit the tiny model) -------------------------------

SYSTEM = {"role": "system", "content": "you are a helpful assistant"}
QUESTION = {"role": "user", "content": "what is the fastest route for a request?"}
MESSAGES = [SYSTEM, QUESTION]
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]
HELLO = "Hello, my name is"
PROMPTS = ["A robot may not injure another robot", "My name is"]
LANGUAGES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
SQL_GRAMMAR = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
SQL = re.compile(r"SELECT(col_1|col_2)from(table_1|table_2)where(col_1|col_2)=(1|2)")
# every string an enum: the valid documents are few, and none has whitespace inside a value
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
WEATHER_DOCUMENTS = {  # compact, in either key order
    json.dumps({k: {"unit": unit, "days": days}[k] for k in order}, separators=(",", ":"))
    for order in itertools.permutations(["unit", "days"])
    for unit, days in itertools.product(["celsius", "fahrenheit"], [1, 2, 3])
}
WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["country", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Get the weather forecast for a given location",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["days", "unit"]}}},
]
STRICT_TOOLS = [{"type": "function", "function": {"name": name, "strict": True, "parameters": WEATHER_SCHEMA}}
                for name in ("get_current_weather", "get_forecast")]
STRICT_NAMES = {t["function"]["name"] for t in STRICT_TOOLS}
WEATHER_MESSAGES = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {"role": "user", "content": "Can you tell me what the current weather is in Berlin, in fahrenheit?"},
]
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_current_weather", "arguments": '{"country": "Germany", "unit": "celsius"}'}}
SAYING = "Here is a common saying about apple. An apple a day, keeps"
INVALID_SQL_GRAMMAR = """
    root ::= select_statementinvalidsyntax

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""
INVALID_CAR_SCHEMA = {
    "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}},
    "properties": {"brand": {"title": "Brand", "type": "string"}, "model": {"title": "Model", "type": "string"},
                   "car_type": {"$ref": "#/$defs/CarType"}, "foo": "bar"},
    "required": ["brand", "model", "car_type"],
    "title": "CarDescription",
    "type": "object",
}


# --- the live stack and the table ------------------------------------------------------------------------

@lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """The served tiny model's tokenizer and chat template (the model is built once, offline)."""
    from transformers import AutoTokenizer

    from serve_app.tiny_model import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model())


@lru_cache(maxsize=1)
def no_whitespace_bias() -> dict[str, int]:
    """logit_bias against every token with whitespace in it."""
    tok = tiny_tokenizer()
    return {str(i): -100 for i in range(len(tok)) if any(ch.isspace() for ch in tok.decode([i]))}


@dataclass
class Live:
    """One topology of the running stack, as the cases see it."""

    sdk: Any  # openai.OpenAI on the stack's /v1
    http: Any  # httpx.Client on the stack's base URL
    topology: str  # "disaggregated" or "colocated"
    policy: str  # the routing policy that gives that topology
    model: str = MODEL

    @property
    def tokenizer(self) -> Any:
        return tiny_tokenizer()

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def ids(self, text: str) -> list[int]:
        """A completion prompt's token ids, as vLLM tokenizes it."""
        return self.tokenizer.encode(text)

    def single_token(self, text: str) -> int:
        ids = self.ids(text)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    def chat_ids(self, messages: list[dict], **template: Any) -> list[int]:
        """The prompt's token ids vLLM renders for `messages` (the chat template, then the tokenizer
        without special tokens); add_generation_prompt defaults to vLLM's True."""
        template.setdefault("add_generation_prompt", not template.get("continue_final_message", False))
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **template)
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class Case:
    name: str  # unique, used as the pytest id
    source: str  # the vLLM test it comes from
    run: Callable[[Live], None]  # does the calls and the asserts
    note: str = ""


CASES: list[Case] = []


def case(source: str, note: str = "") -> Callable[[Callable[[Live], None]], Callable[[Live], None]]:
    def register(run: Callable[[Live], None]) -> Callable[[Live], None]:
        CASES.append(Case(run.__name__, source, run, note))
        return run
    return register


# --- calls ---------------------------------------------------------------------------------------------

def chat(live: Live, **kw: Any) -> tuple[Any, Any]:
    """A chat completion through the SDK: (the parsed answer, the response headers)."""
    raw = live.sdk.chat.completions.with_raw_response.create(model=live.model, **kw)
    return raw.parse(), raw.headers


def chat_stream(live: Live, **kw: Any) -> tuple[list, Any]:
    raw = live.sdk.chat.completions.with_raw_response.create(model=live.model, stream=True, **kw)
    return list(raw.parse()), raw.headers


def cmpl(live: Live, **kw: Any) -> tuple[Any, Any]:
    raw = live.sdk.completions.with_raw_response.create(model=live.model, **kw)
    return raw.parse(), raw.headers


def cmpl_stream(live: Live, **kw: Any) -> tuple[list, Any]:
    raw = live.sdk.completions.with_raw_response.create(model=live.model, stream=True, **kw)
    return list(raw.parse()), raw.headers


def route(headers: Any) -> dict[str, str]:
    """x-disagg-route → {key: value}."""
    return dict(part.split("=", 1) for part in headers["x-disagg-route"].split("; "))


def check_route(live: Live, headers: Any) -> None:
    """The request went the topology's way: prefill and decode on two engines (KV over NIXL), or one."""
    rt = route(headers)
    assert rt["policy"] == live.policy, rt
    if live.topology == "disaggregated":
        assert rt["served_prefill"] != rt["served_decode"], rt
    else:
        assert rt["served_prefill"] == rt["served_decode"], rt


# --- shared checks ---------------------------------------------------------------------------------------

def check_usage(usage: Any, prompt: int | None = None, completion: int | None = None) -> None:
    u = usage if isinstance(usage, dict) else usage.model_dump()
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] >= 0, u
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    if prompt is not None:
        assert u["prompt_tokens"] == prompt, (u, prompt)
    if completion is not None:
        assert u["completion_tokens"] == completion, (u, completion)


def chat_choices(live: Live, chunks: list) -> dict[int, dict]:
    """A chat stream per choice index (text, roles, finish reasons, token ids, logprob entries), after
    checking what every chunk shares: one id, the chunk object, the model, at most one choice."""
    assert chunks and len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    out: dict[int, dict] = {}
    for ch in chunks:
        assert ch.object == "chat.completion.chunk" and ch.model == live.model, ch
        assert len(ch.choices) <= 1, ch
        for c in ch.choices:
            o = out.setdefault(c.index, {"text": "", "roles": [], "finish": [], "token_ids": [], "logprobs": []})
            if c.delta.role:
                o["roles"].append(c.delta.role)
            o["text"] += c.delta.content or ""
            if c.finish_reason:
                o["finish"].append(c.finish_reason)
            o["token_ids"] += getattr(c, "token_ids", None) or []
            if c.logprobs is not None and c.logprobs.content:
                o["logprobs"] += c.logprobs.content
    return out


def cmpl_choices(live: Live, chunks: list) -> dict[int, dict]:
    """A completion stream per choice index (text, finish reasons, token ids, prompt ids, logprob tokens
    and offsets), after checking one id, the object and model, and at most one choice per chunk."""
    assert chunks and len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    out: dict[int, dict] = {}
    for ch in chunks:
        assert ch.object == "text_completion" and ch.model == live.model, ch
        assert len(ch.choices) <= 1, ch
        for c in ch.choices:
            o = out.setdefault(c.index, {"text": "", "finish": [], "token_ids": [], "prompt_token_ids": [],
                                         "tokens": [], "offsets": []})
            o["text"] += c.text
            if c.finish_reason:
                o["finish"].append(c.finish_reason)
            o["token_ids"] += getattr(c, "token_ids", None) or []
            if getattr(c, "prompt_token_ids", None) is not None:
                o["prompt_token_ids"].append(c.prompt_token_ids)
            if c.logprobs is not None:
                o["tokens"] += c.logprobs.tokens
                o["offsets"] += c.logprobs.text_offset
    return out


def check_text_offsets(logprobs: Any, start: int = 0) -> None:
    """vLLM's text_offset: the first at `start`, each next one after the previous token's string."""
    offsets, tokens = logprobs.text_offset, logprobs.tokens
    assert len(offsets) == len(tokens) and offsets[0] == start, logprobs
    assert all(offsets[j + 1] == offsets[j] + len(tokens[j]) for j in range(len(tokens) - 1)), logprobs


def check_prompt_logprobs(entries: list, prompt_ids: list[int], k: int) -> None:
    """One entry per prompt token, none for the first; each holds the prompt's own token (by id) and up
    to k others, as {id: {"logprob", "rank", "decoded_token"}}."""
    assert len(entries) == len(prompt_ids) and entries[0] is None, (len(entries), len(prompt_ids))
    for tid, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(tid) in entry and max(k, 1) <= len(entry) <= k + 1, (tid, entry)
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str)
                   for v in entry.values()), entry


def check_json_answer(text: str, finish_reason: str, completion_tokens: int, max_tokens: int) -> None:
    """A WEATHER_SCHEMA answer: whole and valid when it stopped, else cut by max_tokens from one."""
    compact = "".join(text.split())
    if finish_reason == "stop":
        assert compact in WEATHER_DOCUMENTS, text
        assert json.loads(text) == json.loads(compact), text
    else:
        assert finish_reason == "length" and completion_tokens == max_tokens, (finish_reason, completion_tokens)
        assert any(doc.startswith(compact) for doc in WEATHER_DOCUMENTS), text


def check_json_object(text: str, finish_reason: str, completion_tokens: int, max_tokens: int) -> None:
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish_reason == "length" and completion_tokens == max_tokens, (finish_reason, completion_tokens)
        assert text.strip() == "" or text.lstrip().startswith("{"), text


def pick_stop(text: str) -> tuple[int, str]:
    """Two letters of `text`, not at its start, at their first occurrence: (where, the letters)."""
    for at in range(1, len(text) - 1):
        s = text[at:at + 2]
        if s.isascii() and s.isalnum() and text.find(s) == at:
            return at, s
    raise AssertionError(f"no two-letter stop string to cut {text!r} at")


def token_id(token: str) -> int:
    """A `token_id:N` string (return_tokens_as_token_ids) → N."""
    m = re.fullmatch(r"token_id:(\d+)", token)
    assert m, token
    return int(m.group(1))


# --- errors ----------------------------------------------------------------------------------------------

def check_error(payload: dict, status: int, err_type: str | None = BAD, param: Any = UNCHECKED,
                contains: tuple[str, ...] = ()) -> dict:
    """vLLM's ErrorResponse: exactly {"error": {"message", "type", "param", "code"}}, code the status."""
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], err
    if err_type is not None:
        assert err["type"] == err_type, err
    if param is not UNCHECKED:
        assert err["param"] == param, err
    for fragment in contains:
        assert fragment in err["message"], (fragment, err)
    return err


def error(live: Live, path: str, body: dict | None = None, *, status: int = 400, err_type: str | None = BAD,
          param: Any = UNCHECKED, contains: tuple[str, ...] = (), content: bytes | None = None,
          content_type: str = "application/json", method: str = "POST") -> dict:
    """A raw HTTP request that vLLM refuses: the status and the error shape."""
    if method == "GET":
        r = live.http.get(path)
    elif content is not None:
        r = live.http.post(path, content=content, headers={"Content-Type": content_type})
    else:
        r = live.http.post(path, json=body)
    assert r.status_code == status, (r.status_code, r.text[:500])
    return check_error(r.json(), status, err_type, param, contains)


def streamed_error(live: Live, path: str, body: dict, param: Any, contains: tuple[str, ...]) -> None:
    """A streamed request an engine refuses. vLLM's API server has already answered 200 when its engine
    client raises, so the error comes as one SSE event before [DONE]; a server that waits for the first
    token answers the same error as a 400. Either way the error is vLLM's."""
    with live.http.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            assert r.status_code == 400, (r.status_code, r.text[:500])
            check_error(r.json(), 400, BAD, param, contains)
            return
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    errors = [e for e in map(json.loads, events[:-1]) if "error" in e]
    assert len(errors) == 1, events
    check_error(errors[0], 400, BAD, param, contains)


def chat_body(live: Live, **kw: Any) -> dict:
    return {"model": live.model, "messages": [QUESTION], "max_completion_tokens": 4, **kw}


def cmpl_body(live: Live, **kw: Any) -> dict:
    return {"model": live.model, "prompt": HELLO, "max_tokens": 4, **kw}


# =========================================================================================================
# chat, basics
# =========================================================================================================

@case(f"{T_CHAT}::test_single_chat_session")
def chat_single_session(live: Live) -> None:
    r, headers = chat(live, messages=MESSAGES, max_completion_tokens=5, **GREEDY, extra_body={**EXACT, **IDS})
    check_route(live, headers)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == live.model
    assert isinstance(r.created, int) and r.created > 0
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and c.message.role == "assistant", c
    assert isinstance(c.message.content, str) and c.logprobs is None and not c.message.tool_calls, c
    expected = live.chat_ids(MESSAGES)
    assert r.prompt_token_ids == expected and len(c.token_ids) == 5
    check_usage(r.usage, prompt=len(expected), completion=5)
    turn = [*MESSAGES, {"role": "assistant", "content": c.message.content},
            {"role": "user", "content": "express your result in json"}]
    r2, _ = chat(live, messages=turn, max_completion_tokens=5, **GREEDY, extra_body=IDS)
    assert r2.prompt_token_ids == live.chat_ids(turn)
    check_usage(r2.usage, prompt=len(r2.prompt_token_ids))


@case(f"{T_CHAT}::test_chat_streaming")
def chat_stream_equals_whole(live: Live) -> None:
    kw = dict(messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    whole, _ = chat(live, **kw)
    chunks, headers = chat_stream(live, **kw)
    check_route(live, headers)
    per = chat_choices(live, chunks)
    assert set(per) == {0} and chunks[0].choices[0].delta.role == "assistant"
    s = per[0]
    assert s["roles"] == ["assistant"] and s["finish"] == [whole.choices[0].finish_reason], s
    assert s["text"] == whole.choices[0].message.content
    assert all(ch.usage is None for ch in chunks)


@case(f"{T_CHAT}::test_custom_role", note="a single text part renders as the same string")
def chat_content_text_part(live: Live) -> None:
    text = "what is 1+1? please provide the result without any other text."
    as_string, _ = chat(live, messages=[{"role": "user", "content": text}], max_completion_tokens=6, **GREEDY,
                        extra_body=IDS)
    as_part, _ = chat(live, messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
                      max_completion_tokens=6, **GREEDY, extra_body=IDS)
    assert as_part.prompt_token_ids == as_string.prompt_token_ids == live.chat_ids([{"role": "user", "content": text}])
    assert as_part.choices[0].message.content == as_string.choices[0].message.content


@case(f"{T_CHAT}::test_complex_message_content",
      note="several text parts: vLLM joins them with a newline (the template's content format is 'string')")
def chat_content_several_parts(live: Live) -> None:
    parts = [{"type": "text", "text": "what is 1+1?"}, {"type": "text", "text": "answer in one word"}]
    r, _ = chat(live, messages=[SYSTEM, {"role": "user", "content": parts}], max_completion_tokens=3, **GREEDY,
                extra_body=IDS)
    joined = [SYSTEM, {"role": "user", "content": "what is 1+1?\nanswer in one word"}]
    assert r.prompt_token_ids == live.chat_ids(joined)
    check_usage(r.usage, prompt=len(r.prompt_token_ids))


@case(f"{T_CHAT}::test_custom_role")
def chat_custom_role(live: Live) -> None:
    as_string, _ = chat(live, messages=[{"role": "my-custom-role", "content": "what is 1+1?"}],
                        max_completion_tokens=6, **GREEDY, extra_body=IDS)
    parts = [{"type": "text", "text": "what is 1+1?"}]
    as_part, _ = chat(live, messages=[{"role": "my-custom-role", "content": parts}], max_completion_tokens=6,
                      **GREEDY, extra_body=IDS)
    assert as_string.prompt_token_ids == live.chat_ids([{"role": "my-custom-role", "content": "what is 1+1?"}])
    assert as_part.choices[0].message.content == as_string.choices[0].message.content


@case(f"{T_CHAT}::test_prompt_logprobs_chat", note="the conversation of that test, rendered")
def chat_history(live: Live) -> None:
    r, headers = chat(live, messages=HISTORY, max_completion_tokens=4, **GREEDY, extra_body={**EXACT, **IDS})
    check_route(live, headers)
    assert r.prompt_token_ids == live.chat_ids(HISTORY)
    check_usage(r.usage, prompt=len(r.prompt_token_ids), completion=4)


@case(f"{T_CHAT}::test_extra_fields_allowed")
def chat_extra_field_in_message(live: Live) -> None:
    r, _ = chat(live, messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
                max_completion_tokens=4, temperature=0, seed=0, extra_body=IDS)
    assert r.prompt_token_ids == live.chat_ids([{"role": "user", "content": "what is 1+1?"}])
    assert isinstance(r.choices[0].message.content, str)


@case(f"{T_CHAT}::test_single_chat_session",
      note="max_completion_tokens, the deprecated max_tokens, and the first when both are sent (vLLM's serving)")
def chat_max_completion_tokens(live: Live) -> None:
    for limits, n in ((dict(max_completion_tokens=7), 7), (dict(max_tokens=4), 4),
                      (dict(max_completion_tokens=3, max_tokens=9), 3)):
        r, _ = chat(live, messages=MESSAGES, **limits, **GREEDY, extra_body=EXACT)
        assert r.choices[0].finish_reason == "length", (limits, r.choices[0])
        check_usage(r.usage, completion=n)


@case(f"{T_CHAT}::test_chat_completion_stream_options",
      note="min_tokens holds back an EOS that a +100 logit bias makes the only choice; after it, EOS ends the "
           "answer at once")
def chat_min_tokens(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=8, **GREEDY, logit_bias={str(EOS): 100})
    held, _ = chat(live, **body, extra_body={"min_tokens": 8, **IDS})
    assert held.choices[0].finish_reason == "length" and EOS not in held.choices[0].token_ids
    check_usage(held.usage, completion=8)
    released, _ = chat(live, **body, extra_body={"min_tokens": 3, **IDS})
    c = released.choices[0]
    assert c.finish_reason == "stop" and c.token_ids[:3] == held.choices[0].token_ids[:3], c
    assert c.token_ids[3:] == [EOS], c.token_ids
    check_usage(released.usage, completion=4)


# =========================================================================================================
# chat, sampling
# =========================================================================================================

@case(f"{T_LOGIT_BIAS}::test_chat_logit_bias_valid", note="a +100 bias forces its token under greedy decoding")
def chat_logit_bias(live: Live) -> None:
    forced = live.single_token(" router")
    r, headers = chat(live, messages=MESSAGES, max_completion_tokens=5, **GREEDY, logit_bias={str(forced): 100},
                      extra_body=IDS)
    check_route(live, headers)
    assert r.choices[0].token_ids == [forced] * 5 and r.choices[0].finish_reason == "length"


@case(f"{T_CMPL_OLD}::test_logits_bias", note="the ban half of that test, on chat: a -100 bias on every token of "
      "the greedy answer keeps them all out")
def chat_logit_bias_ban(live: Live) -> None:
    first, _ = chat(live, messages=MESSAGES, max_completion_tokens=5, **GREEDY, extra_body={**EXACT, **IDS})
    banned = set(first.choices[0].token_ids)
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=5, **GREEDY,
                logit_bias={str(t): -100 for t in banned}, extra_body={**EXACT, **IDS})
    assert not banned & set(r.choices[0].token_ids), (banned, r.choices[0].token_ids)


@case(f"{T_CMPL_OLD}::test_allowed_token_ids", note="on chat, six tokens")
def chat_allowed_token_ids(live: Live) -> None:
    allowed = [live.single_token(w) for w in (" router", " model", " token")]
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=6, **GREEDY,
                extra_body={"allowed_token_ids": allowed, **IDS})
    c = r.choices[0]
    assert len(c.token_ids) == 6 and set(c.token_ids) <= set(allowed), c.token_ids
    assert c.finish_reason == "length"


@case(f"{T_CMPL_OLD}::test_logits_bias", note="bad_words, the string form of a ban: vLLM bans the word's token "
      "with and without a leading space, and the ban beats a +100 bias towards it")
def chat_bad_words(live: Live) -> None:
    word = "router"
    spaced = live.single_token(" " + word)
    banned = {live.single_token(word), spaced}
    body = dict(messages=MESSAGES, max_completion_tokens=5, **GREEDY, logit_bias={str(spaced): 100})
    pushed, _ = chat(live, **body, extra_body={**EXACT, **IDS})
    assert pushed.choices[0].token_ids == [spaced] * 5
    r, _ = chat(live, **body, extra_body={**EXACT, **IDS, "bad_words": [word]})
    assert len(r.choices[0].token_ids) == 5 and not banned & set(r.choices[0].token_ids), r.choices[0].token_ids


@case(f"{T_TEXT_OFFSET}::test_stream_text_offset_matches_non_stream_with_stop_holdback",
      note="a stop string cut from the greedy answer itself ends it there, the string left out")
def chat_stop_string(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=12, **GREEDY, extra_body=EXACT)
    text = chat(live, **body)[0].choices[0].message.content
    at, stop = pick_stop(text)
    r, _ = chat(live, **body, stop=[stop])
    c = r.choices[0]
    assert c.message.content == text[:at] and c.finish_reason == "stop" and c.stop_reason == stop, (text, stop, c)


@case(f"{T_TEXT_OFFSET}::test_stream_text_offset_matches_non_stream_with_stop_holdback",
      note="include_stop_str_in_output keeps the stop string; streamed, the text is the same")
def chat_stop_string_included(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=12, **GREEDY)
    text = chat(live, **body, extra_body=EXACT)[0].choices[0].message.content
    at, stop = pick_stop(text)
    extra = {**EXACT, "include_stop_str_in_output": True}
    r, _ = chat(live, **body, stop=stop, extra_body=extra)
    c = r.choices[0]
    assert c.message.content == text[:at + len(stop)] and c.finish_reason == "stop", (text, stop, c)
    s = chat_choices(live, chat_stream(live, **body, stop=stop, extra_body=extra)[0])[0]
    assert s["text"] == c.message.content and s["finish"] == ["stop"], s


@case(f"{T_STOP_IDS}::test_chat_stop_token_ids_valid",
      note="a token of the greedy answer as the stop token: the answer ends with it, stop_reason naming it")
def chat_stop_token_ids(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=8, **GREEDY)
    ids = chat(live, **body, extra_body={**EXACT, **IDS})[0].choices[0].token_ids
    stop = ids[3]
    r, _ = chat(live, **body, extra_body={**EXACT, **IDS, "stop_token_ids": [stop]})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop, c
    assert c.token_ids == ids[:ids.index(stop) + 1], (ids, c.token_ids)


@case(f"{T_CHAT}::test_chat_completion_n_with_seed",
      note="n=1: a seeded sample is the same streamed and not, and the same again")
def chat_seed(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=8, temperature=1.0, seed=123, extra_body={**EXACT, **IDS})
    first, headers = chat(live, **body)
    check_route(live, headers)
    again, _ = chat(live, **body)
    streamed = chat_choices(live, chat_stream(live, **body)[0])[0]
    assert len(first.choices[0].token_ids) == 8
    assert again.choices[0].token_ids == first.choices[0].token_ids == streamed["token_ids"]


# =========================================================================================================
# chat, logprobs and token ids
# =========================================================================================================

@case(f"{T_CHAT}::test_no_logprobs_chat")
def chat_no_logprobs(live: Live) -> None:
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=5, **GREEDY, logprobs=False)
    assert r.choices[0].logprobs is None


@case(f"{T_CHAT}::test_zero_logprobs_chat")
def chat_zero_top_logprobs(live: Live) -> None:
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=5, **GREEDY, logprobs=True, top_logprobs=0,
                extra_body=EXACT)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content), content


@case(f"{T_CHAT}::test_some_logprobs_chat", note="greedy: the sampled token leads its top_logprobs, at the top")
def chat_some_logprobs(live: Live) -> None:
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=6, **GREEDY, logprobs=True, top_logprobs=5,
                extra_body=EXACT)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 5 and e.top_logprobs[0].token == e.token, e
        assert e.top_logprobs[0].logprob == e.logprob <= 0, e
        assert all(t.logprob <= e.logprob for t in e.top_logprobs) and isinstance(e.bytes, list), e


@case(f"{T_CHAT}::test_some_logprobs_chat", note="streamed: the entries arrive with their tokens, the same as whole")
def chat_logprobs_streamed(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=6, **GREEDY, logprobs=True, top_logprobs=3, extra_body=EXACT)
    whole, _ = chat(live, **body)
    chunks, _ = chat_stream(live, **body, stream_options={"include_usage": True})
    entries = chat_choices(live, chunks)[0]["logprobs"]
    assert len(entries) == 6 == chunks[-1].usage.completion_tokens
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 3 for e in entries)


@case(f"{T_CHAT}::test_more_than_one_prompt_logprobs_chat",
      note="the tiny model's prompt tokens are rarely its own top choices: k or k+1 entries per position")
def chat_prompt_logprobs(live: Live) -> None:
    r, _ = chat(live, messages=HISTORY, max_completion_tokens=3, **GREEDY, extra_body={"prompt_logprobs": 2, **IDS})
    assert r.prompt_token_ids == live.chat_ids(HISTORY)
    check_prompt_logprobs(r.prompt_logprobs, r.prompt_token_ids, 2)
    none, _ = chat(live, messages=HISTORY, max_completion_tokens=3, **GREEDY)
    assert getattr(none, "prompt_logprobs", None) is None


@case(f"{T_CHAT}::test_prompt_logprobs_chat", note="prompt_logprobs=0: each entry is the prompt token alone")
def chat_prompt_logprobs_zero(live: Live) -> None:
    r, _ = chat(live, messages=HISTORY, max_completion_tokens=3, **GREEDY, extra_body={"prompt_logprobs": 0, **IDS})
    entries = r.prompt_logprobs
    assert len(entries) == len(r.prompt_token_ids) and entries[0] is None
    assert all(list(e) == [str(t)] for t, e in zip(r.prompt_token_ids[1:], entries[1:])), entries


@case(f"{T_TOKENS_AS_IDS}::test_chat_return_tokens_as_token_ids_completion")
def chat_return_tokens_as_token_ids(live: Live) -> None:
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=8, **GREEDY, logprobs=True, top_logprobs=2,
                extra_body={**EXACT, **IDS, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    assert [token_id(e.token) for e in c.logprobs.content] == c.token_ids and len(c.token_ids) == 8
    for e in c.logprobs.content:
        assert [t.token for t in e.top_logprobs][0] == e.token and all(token_id(t.token) >= 0 for t in e.top_logprobs)


@case(f"{T_TOKEN_IDS}::test_chat_completion_with_emoji_and_token_ids", note="not streamed")
def chat_return_token_ids(live: Live) -> None:
    messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    r, headers = chat(live, messages=messages, max_completion_tokens=6, **GREEDY, logprobs=True, extra_body=IDS)
    check_route(live, headers)
    assert r.prompt_token_ids == live.chat_ids(messages)
    assert len(r.choices[0].token_ids) == r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    assert "I love cats 🐱" in live.tokenizer.decode(r.prompt_token_ids)
    plain, _ = chat(live, messages=messages, max_completion_tokens=6, **GREEDY, extra_body={"return_token_ids": False})
    assert getattr(plain, "prompt_token_ids", None) is None and getattr(plain.choices[0], "token_ids", None) is None


@case(f"{T_TOKEN_IDS}::test_chat_completion_with_emoji_and_token_ids",
      note="streamed: the prompt's ids on the first chunk only, the output's on the chunks that carry them")
def chat_return_token_ids_streamed(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=8, **GREEDY, extra_body={**EXACT, **IDS})
    whole, _ = chat(live, **body)
    chunks, headers = chat_stream(live, **body)
    check_route(live, headers)
    assert chunks[0].prompt_token_ids == live.chat_ids(MESSAGES)
    assert all(getattr(ch, "prompt_token_ids", None) is None for ch in chunks[1:])
    assert chat_choices(live, chunks)[0]["token_ids"] == whole.choices[0].token_ids


# =========================================================================================================
# chat, n and stream_options
# =========================================================================================================

@case(f"{T_CHAT}::test_chat_completion_n_parameter_non_streaming",
      note="seeded: the n samples differ (vLLM seeds choice i with seed + i)")
def chat_n(live: Live) -> None:
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=6, temperature=0.7, seed=7, n=3,
                extra_body={**EXACT, **IDS})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in r.choices)
    assert len({tuple(c.token_ids) for c in r.choices}) == 3
    check_usage(r.usage, completion=sum(len(c.token_ids) for c in r.choices))
    assert r.usage.completion_tokens == 18


@case(f"{T_CHAT}::test_chat_completion_n_parameter_streaming")
def chat_n_streamed(live: Live) -> None:
    chunks, _ = chat_stream(live, messages=MESSAGES, max_completion_tokens=6, temperature=0.7, seed=7, n=3,
                            stream_options={"include_usage": True}, extra_body={**EXACT, **IDS})
    per = chat_choices(live, chunks)
    assert set(per) == {0, 1, 2}
    for s in per.values():
        assert s["roles"] == ["assistant"] and s["finish"] == ["length"] and len(s["token_ids"]) == 6, s
    usage = chunks[-1]
    assert usage.choices == [] and all(ch.choices for ch in chunks[:-1])
    check_usage(usage.usage, completion=18)


@case(f"{T_CHAT}::test_chat_completion_n_with_seed", note="the same seed gives the same n answers again")
def chat_n_seed(live: Live) -> None:
    body = dict(messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=8, temperature=0.8, n=2,
                seed=42, extra_body={**EXACT, **IDS})
    first, _ = chat(live, **body)
    again, _ = chat(live, **body)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in first.choices]
    assert first.choices[0].token_ids != first.choices[1].token_ids


@case(f"{T_CHAT}::test_chat_completion_stream_options", note="include_usage false, then true")
def chat_stream_options(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=6, **GREEDY, extra_body=EXACT)
    chunks, _ = chat_stream(live, **body, stream_options={"include_usage": False})
    assert all(ch.usage is None for ch in chunks)
    chunks, _ = chat_stream(live, **body, stream_options={"include_usage": True, "continuous_usage_stats": False})
    *answer, last = chunks
    assert all(ch.usage is None and ch.choices for ch in answer)
    assert last.choices == [] and last.usage is not None
    check_usage(last.usage, prompt=len(live.chat_ids(MESSAGES)), completion=6)


@case(f"{T_CHAT}::test_chat_completion_stream_options", note="continuous_usage_stats, with min_tokens=10")
def chat_stream_continuous_usage(live: Live) -> None:
    chunks, _ = chat_stream(live, messages=MESSAGES, max_completion_tokens=10, **GREEDY,
                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                            extra_body={"min_tokens": 10})
    last = 0
    for ch in chunks:
        assert ch.usage is not None, ch
        check_usage(ch.usage)
        ct = ch.usage.completion_tokens
        assert last == 0 or ct > last or (not ch.choices and ct == last), (last, ch)
        last = ct
    assert last == 10 and chunks[-1].choices == []


# =========================================================================================================
# chat, structured outputs
# =========================================================================================================

@case(f"{T_CHAT}::test_structured_outputs_choice_chat")
def chat_structured_choice(live: Live) -> None:
    messages = [SYSTEM, {"role": "user", "content": "The best language for type-safe systems programming is "}]
    r, headers = chat(live, messages=messages, max_completion_tokens=16, temperature=0.7,
                      extra_body={"structured_outputs": {"choice": LANGUAGES}})
    check_route(live, headers)
    c = r.choices[0]
    assert c.message.content in LANGUAGES and c.finish_reason == "stop", c


@case(f"{T_CHAT}::test_structured_outputs_choice_chat_logprobs")
def chat_structured_choice_logprobs(live: Live) -> None:
    messages = [SYSTEM, {"role": "user", "content": "The best language for type-safe systems programming is "}]
    r, _ = chat(live, messages=messages, max_completion_tokens=16, logprobs=True, top_logprobs=5,
                extra_body={"structured_outputs": {"choice": LANGUAGES}})
    c = r.choices[0]
    assert c.message.content in LANGUAGES and len(c.logprobs.content) == r.usage.completion_tokens
    assert all(t.logprob >= -9999.0 for e in c.logprobs.content for t in e.top_logprobs)


@case(f"{T_CHAT}::test_structured_outputs_regex_chat")
def chat_structured_regex(live: Live) -> None:
    messages = [SYSTEM, {"role": "user", "content": f"Give an example IP address with this regex: {IPV4}"}]
    r, _ = chat(live, messages=messages, max_completion_tokens=16, extra_body={"structured_outputs": {"regex": IPV4}})
    c = r.choices[0]
    assert re.fullmatch(IPV4, c.message.content) and c.finish_reason == "stop", c


@case(f"{T_CMPL_OLD}::test_guided_grammar", note="vLLM's SQL grammar on chat through `structured_outputs`")
def chat_structured_grammar(live: Live) -> None:
    messages = [{"role": "user", "content": "Generate a sql state that select col_1 from table_1 where it is 1"}]
    r, _ = chat(live, messages=messages, max_completion_tokens=48, temperature=1.0,
                extra_body={"structured_outputs": {"grammar": SQL_GRAMMAR}})
    c = r.choices[0]
    assert SQL.fullmatch(c.message.content.strip()) and c.finish_reason == "stop", c


@case(f"{T_CHAT}::test_structured_outputs_json_chat", note="a schema of enums the tiny model can finish")
def chat_structured_json(live: Live) -> None:
    messages = [SYSTEM, {"role": "user", "content": f"Give an example JSON that fits this schema: {WEATHER_SCHEMA}"}]
    r, _ = chat(live, messages=messages, max_completion_tokens=48, **GREEDY,
                extra_body={"structured_outputs": {"json": WEATHER_SCHEMA}})
    c = r.choices[0]
    check_json_answer(c.message.content, c.finish_reason, r.usage.completion_tokens, 48)


@case(f"{T_CHAT}::test_response_format_json_object")
def chat_response_format_json_object(live: Live) -> None:
    messages = [{"role": "user",
                 "content": 'what is 1+1? please respond with a JSON object, the format is {"result": 2}'}]
    r, _ = chat(live, messages=messages, max_completion_tokens=48, **GREEDY, response_format={"type": "json_object"})
    c = r.choices[0]
    check_json_object(c.message.content, c.finish_reason, r.usage.completion_tokens, 48)


@case(f"{T_CHAT}::test_response_format_json_schema")
def chat_response_format_json_schema(live: Live) -> None:
    r, _ = chat(live, messages=[{"role": "user", "content": "the weather for the next days?"}],
                max_completion_tokens=48, **GREEDY,
                response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}})
    c = r.choices[0]
    check_json_answer(c.message.content, c.finish_reason, r.usage.completion_tokens, 48)


@case(f"{T_CHAT}::test_response_format_text", note="type text constrains nothing: the greedy answer is unchanged")
def chat_response_format_text(live: Live) -> None:
    body = dict(messages=[{"role": "user", "content": "what is 1+1?"}], max_completion_tokens=10, **GREEDY)
    plain, _ = chat(live, **body)
    r, _ = chat(live, **body, response_format={"type": "text"})
    assert r.choices[0].message.content == plain.choices[0].message.content


# =========================================================================================================
# chat, tools
# =========================================================================================================

def check_tool_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    """Every (name, arguments) is one of the tools, with arguments its schema allows."""
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names, (name, names)
        assert json.dumps(json.loads(arguments), separators=(",", ":")) in WEATHER_DOCUMENTS, arguments


def tool_request(choice: Any, **kw: Any) -> dict:
    """A tool request the tiny model can finish: strict enum-only tools (vLLM forces the call through
    a grammar) and no whitespace tokens (a random-weight model would pad the JSON with them forever)."""
    return {"messages": WEATHER_MESSAGES, "tools": STRICT_TOOLS, "tool_choice": choice, "max_completion_tokens": 200,
            "seed": 2, "logit_bias": no_whitespace_bias(), **kw}


@case(f"{T_FUNCTIONS}::test_function_tool_use", note=TOOL_NOTE)
def chat_tool_choice_required(live: Live) -> None:
    r, headers = chat(live, **tool_request("required", parallel_tool_calls=False))
    check_route(live, headers)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content, c
    check_tool_calls([(t.function.name, t.function.arguments) for t in c.message.tool_calls], STRICT_NAMES)
    assert all(t.id and t.type == "function" for t in c.message.tool_calls)


@case(f"{T_FUNCTIONS}::test_function_tool_use", note="streamed: the argument deltas assemble into the call. "
      + TOOL_NOTE)
def chat_tool_choice_required_streamed(live: Live) -> None:
    chunks, headers = chat_stream(live, **tool_request("required", parallel_tool_calls=False))
    check_route(live, headers)
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for c in ch.choices:
            for t in c.delta.tool_calls or ():
                name, args = calls.setdefault(t.index, ["", ""])
                calls[t.index] = [name + ((t.function.name or "") if t.function else ""),
                                  args + ((t.function.arguments or "") if t.function else "")]
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finish == ["tool_calls"], finish
    check_tool_calls([tuple(v) for v in calls.values()], STRICT_NAMES)


@case(f"{T_FUNCTIONS}::test_named_tool_use", note=TOOL_NOTE)
def chat_tool_choice_named(live: Live) -> None:
    named = {"type": "function", "function": {"name": "get_forecast"}}
    r, headers = chat(live, **tool_request(named))
    check_route(live, headers)
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.content, c  # vLLM's finish for a named call
    check_tool_calls([(t.function.name, t.function.arguments) for t in c.message.tool_calls], {"get_forecast"})


@case(f"{T_FUNCTIONS}::test_function_tool_use", note="tool_choice auto: the model may or may not call; "
      "whatever it answers is a served answer whose calls, if any, parse")
def chat_tool_choice_auto(live: Live) -> None:
    r, headers = chat(live, **tool_request("auto", max_completion_tokens=16))
    check_route(live, headers)
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop", "tool_calls"), c
    assert isinstance(c.message.content, str) or c.message.tool_calls, c


@case(f"{T_TOOL_NULL}::test_null_tool_choice_defaults_to_auto_like_an_absent_one",
      note="the absent half: tools without tool_choice mean auto")
def chat_tools_default_to_auto(live: Live) -> None:
    body = tool_request("auto", max_completion_tokens=16)
    del body["tool_choice"]
    r, headers = chat(live, **body)
    check_route(live, headers)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls"), r


@case(f"{T_SERVING_CHAT}::TestGPTOSSChat::test_gpt_oss_tool_choice_none",
      note="the template does not render tools, so the prompt is the messages alone")
def chat_tool_choice_none(live: Live) -> None:
    r, headers = chat(live, messages=WEATHER_MESSAGES, tools=WEATHER_TOOLS, tool_choice="none",
                      max_completion_tokens=6, **GREEDY, extra_body={**EXACT, **IDS})
    check_route(live, headers)
    c = r.choices[0]
    assert not c.message.tool_calls and isinstance(c.message.content, str) and c.finish_reason == "length", c
    assert r.prompt_token_ids == live.chat_ids(WEATHER_MESSAGES)


@case(f"{T_FUNCTIONS}::test_no_args_tool_call",
      note="its second turn: an assistant message with tool_calls (no content) and the tool's answer")
def chat_tool_call_history(live: Live) -> None:
    messages = [*WEATHER_MESSAGES, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 degrees"}]
    r, _ = chat(live, messages=messages, max_completion_tokens=6, **GREEDY, extra_body={**EXACT, **IDS})
    rendered = [*WEATHER_MESSAGES, {"role": "assistant", "content": ""},
                {"role": "tool", "content": "sunny, 22 degrees"}]
    assert r.prompt_token_ids == live.chat_ids(rendered)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


@case(f"{T_SERVING_CHAT}::TestGPTOSSChat::test_gpt_oss_tool_message_array_content",
      note="a tool message's text parts are joined with a newline")
def chat_tool_message_parts(live: Live) -> None:
    parts = [{"type": "text", "text": "Weather data: "}, {"type": "text", "text": "Austin, TX - Partly cloudy"}]
    messages = [{"role": "user", "content": "Search for information"},
                {"role": "assistant", "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": parts}]
    r, _ = chat(live, messages=messages, max_completion_tokens=4, **GREEDY, extra_body=IDS)
    rendered = [{"role": "user", "content": "Search for information"}, {"role": "assistant", "content": ""},
                {"role": "tool", "content": "Weather data: \nAustin, TX - Partly cloudy"}]
    assert r.prompt_token_ids == live.chat_ids(rendered)


@case(f"{T_FUNCTIONS}::test_inconsistent_tool_choice_and_tools", note="a named function none of the tools has")
def chat_tool_choice_unknown_function(live: Live) -> None:
    named = {"type": "function", "function": {"name": "nondefined_function_name"}}
    error(live, CHAT, chat_body(live, tools=WEATHER_TOOLS, tool_choice=named), param="tool_choice",
          contains=("does not match any of the specified `tools`",))


@case(f"{T_FUNCTIONS}::test_inconsistent_tool_choice_and_tools", note="a named tool_choice without tools")
def chat_tool_choice_without_tools(live: Live) -> None:
    named = {"type": "function", "function": {"name": "get_current_weather"}}
    error(live, CHAT, chat_body(live, tool_choice=named), param="tool_choice",
          contains=("When using `tool_choice`, `tools` must be set.",))


@case(f"{T_FUNCTIONS}::test_inconsistent_tool_choice_and_tools", note="tool_choice {}")
def chat_tool_choice_empty_object(live: Live) -> None:
    error(live, CHAT, chat_body(live, tools=WEATHER_TOOLS, tool_choice={}), param="tool_choice.function",
          contains=("Invalid value for `function`",))


@case(f"{T_TOOL_NULL}::test_null_tool_choice_does_not_conflict_with_structured_outputs",
      note="the conflict that test guards against, asked for on purpose: a named tool and a regex")
def chat_tools_and_structured_outputs(live: Live) -> None:
    named = {"type": "function", "function": {"name": "get_current_weather"}}
    error(live, CHAT, chat_body(live, tools=WEATHER_TOOLS, tool_choice=named,
                                structured_outputs={"regex": "[a-z]+"}),
          param=None, contains=("use constraints for structured outputs or tools, not both",))


# =========================================================================================================
# chat, template, echo, truncation
# =========================================================================================================

@case(f"{T_ECHO}::test_chat_session_with_echo_and_continue_final_message", note="echo false")
def chat_continue_final_message(live: Live) -> None:
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": SAYING}]
    r, _ = chat(live, messages=messages, max_completion_tokens=6, **GREEDY,
                extra_body={"echo": False, "continue_final_message": True, "add_generation_prompt": False,
                            **EXACT, **IDS})
    c = r.choices[0]
    assert r.prompt_token_ids == live.chat_ids(messages, continue_final_message=True, add_generation_prompt=False)
    assert c.message.role == "assistant" and c.finish_reason == "length" and SAYING not in c.message.content, c


@case(f"{T_ECHO}::test_chat_session_with_echo_and_continue_final_message",
      note="echo true: the final message, of the answer's role, comes before the continuation")
def chat_echo_continue_final_message(live: Live) -> None:
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": SAYING}]
    body = dict(messages=messages, max_completion_tokens=6, **GREEDY)
    template = {"continue_final_message": True, "add_generation_prompt": False, **EXACT}
    plain, _ = chat(live, **body, extra_body={"echo": False, **template})
    echoed, _ = chat(live, **body, extra_body={"echo": True, **template})
    assert echoed.choices[0].message.content == SAYING + plain.choices[0].message.content
    streamed = chat_choices(live, chat_stream(live, **body, extra_body={"echo": True, **template})[0])[0]
    assert streamed["text"] == echoed.choices[0].message.content


@case(f"{T_ECHO}::test_chat_session_with_echo_and_continue_final_message",
      note="echo with the generation prompt: the last message is the user's, not the answer's role, so "
           "nothing is prepended")
def chat_echo_other_role(live: Live) -> None:
    body = dict(messages=MESSAGES, max_completion_tokens=6, **GREEDY)
    plain, _ = chat(live, **body, extra_body=EXACT)
    echoed, _ = chat(live, **body, extra_body={"echo": True, **EXACT})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


@case(f"{T_TEMPLATE}::test_get_gen_prompt",
      note="without the generation prompt the answer takes the last message's role (vLLM's serving)")
def chat_no_generation_prompt(live: Live) -> None:
    r, _ = chat(live, messages=MESSAGES, max_completion_tokens=4, **GREEDY,
                extra_body={"add_generation_prompt": False, **IDS})
    assert r.prompt_token_ids == live.chat_ids(MESSAGES, add_generation_prompt=False)
    assert r.choices[0].message.role == "user"


@case(f"{T_TEMPLATE}::test_get_gen_prompt", note="both at once is vLLM's validation error")
def chat_continue_and_generation_prompt(live: Live) -> None:
    error(live, CHAT, chat_body(live, continue_final_message=True, add_generation_prompt=True), param=None,
          contains=("Cannot set both `continue_final_message` and `add_generation_prompt`",))


@case(f"{T_CHAT_COMPLETION}::test_chat_completion_truncation_side_controls_prompt_truncation")
def chat_truncate_prompt_tokens(live: Live) -> None:
    full = live.chat_ids(MESSAGES)
    for side, kept in (("right", full[:4]), ("left", full[-4:])):
        r, _ = chat(live, messages=MESSAGES, max_completion_tokens=1, **GREEDY,
                    extra_body={"truncate_prompt_tokens": 4, "truncation_side": side, **IDS})
        assert r.prompt_token_ids == kept, (side, r.prompt_token_ids)
        check_usage(r.usage, prompt=4)


# =========================================================================================================
# completions
# =========================================================================================================

@case(f"{T_CMPL}::test_single_completion", note="ignore_eos: exactly max_tokens")
def cmpl_single(live: Live) -> None:
    r, headers = cmpl(live, prompt=HELLO, max_tokens=5, **GREEDY, extra_body=EXACT)
    check_route(live, headers)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == live.model
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None, c
    assert getattr(c, "prompt_logprobs", None) is None
    check_usage(r.usage, prompt=len(live.ids(HELLO)), completion=5)
    by_ids, _ = cmpl(live, prompt=live.ids(HELLO), max_tokens=5, **GREEDY, extra_body=EXACT)
    assert by_ids.choices[0].text == c.text and getattr(by_ids.choices[0], "prompt_logprobs", None) is None
    check_usage(by_ids.usage, prompt=len(live.ids(HELLO)), completion=5)


@case(f"{T_CMPL}::test_prompt_logprobs_completion",
      note="that test sends no max_tokens: vLLM's CompletionRequest defaults it to 16, like OpenAI")
def cmpl_default_max_tokens(live: Live) -> None:
    r, _ = cmpl(live, prompt=HELLO, **GREEDY, extra_body=EXACT)
    assert r.choices[0].finish_reason == "length"
    check_usage(r.usage, completion=16)


@case(f"{T_CMPL}::test_completion_streaming")
def cmpl_stream_equals_whole(live: Live) -> None:
    whole, _ = cmpl(live, prompt="What is an LLM?", max_tokens=5, **GREEDY, extra_body=EXACT)
    chunks, headers = cmpl_stream(live, prompt="What is an LLM?", max_tokens=5, **GREEDY, extra_body=EXACT)
    check_route(live, headers)
    per = cmpl_choices(live, chunks)
    assert set(per) == {0} and per[0]["finish"] == ["length"] and chunks[-1].choices[0].finish_reason == "length"
    assert per[0]["text"] == whole.choices[0].text


@case(f"{T_CMPL}::test_batch_completions", note="a list of prompts: one choice per prompt, in order")
def cmpl_batch_prompts(live: Live) -> None:
    same, _ = cmpl(live, prompt=[HELLO, HELLO], max_tokens=5, **GREEDY)
    assert [c.index for c in same.choices] == [0, 1] and same.choices[0].text == same.choices[1].text
    r, _ = cmpl(live, prompt=PROMPTS, max_tokens=4, **GREEDY, extra_body={**EXACT, **IDS})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.prompt_token_ids for c in r.choices] == [live.ids(p) for p in PROMPTS]
    check_usage(r.usage, prompt=sum(len(live.ids(p)) for p in PROMPTS), completion=8)


@case(f"{T_CMPL}::test_batch_completions", note="streamed: each chunk one choice, indexed by prompt")
def cmpl_batch_prompts_streamed(live: Live) -> None:
    whole, _ = cmpl(live, prompt=PROMPTS, max_tokens=5, **GREEDY, extra_body=EXACT)
    chunks, _ = cmpl_stream(live, prompt=PROMPTS, max_tokens=5, **GREEDY, extra_body=EXACT)
    per = cmpl_choices(live, chunks)
    assert set(per) == {0, 1} and all(s["finish"] == ["length"] for s in per.values())
    assert [per[i]["text"] for i in (0, 1)] == [c.text for c in whole.choices]


@case(f"{T_CMPL}::test_batch_completions", note="the token-id half: a list of token-id prompts")
def cmpl_batch_token_prompts(live: Live) -> None:
    ids = live.ids(HELLO)
    r, _ = cmpl(live, prompt=[ids, ids], max_tokens=5, **GREEDY, extra_body=EXACT)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    check_usage(r.usage, prompt=2 * len(ids), completion=10)


@case(f"{T_CMPL}::test_batch_completions",
      note="n=2 over two prompts, sampled with a seed (vLLM's test uses beam search for its n): four choices, "
           "the first two the first prompt's")
def cmpl_n_over_prompts(live: Live) -> None:
    r, _ = cmpl(live, prompt=PROMPTS, n=2, max_tokens=4, temperature=1.0, seed=3, extra_body={**EXACT, **IDS})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in r.choices] == [live.ids(p) for p in PROMPTS for _ in range(2)]
    assert all(len(c.token_ids) == 4 for c in r.choices)
    check_usage(r.usage, prompt=sum(len(live.ids(p)) for p in PROMPTS), completion=16)


@case(f"{T_CMPL}::test_batch_completions", note="its beam-search part: use_beam_search with n=2 over two copies of "
      "one prompt (ignore_eos so no beam ends early)")
def cmpl_beam_search(live: Live) -> None:
    r, _ = cmpl(live, prompt=[HELLO, HELLO], n=2, max_tokens=4, **GREEDY, extra_body={"use_beam_search": True, **EXACT})
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert texts[0] != texts[1] and texts[0] == texts[2] and texts[1] == texts[3], texts


@case(f"{T_CMPL}::test_parallel_no_streaming", note="ignore_eos, so every choice is max_tokens long")
def cmpl_parallel_sampling(live: Live) -> None:
    r, _ = cmpl(live, prompt="What is an LLM?", n=3, max_tokens=8, temperature=1.0, seed=42, logprobs=0,
                extra_body=EXACT)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 8 for c in r.choices)
    assert len({c.text for c in r.choices}) == 3
    check_usage(r.usage, completion=24)


@case(f"{T_CMPL}::test_parallel_streaming",
      note="the streamed choices are the seeded whole ones, flattened into one stream by index")
def cmpl_parallel_streamed(live: Live) -> None:
    body = dict(prompt="What is an LLM?", n=3, max_tokens=8, temperature=1.0, seed=42, extra_body={**EXACT, **IDS})
    whole, _ = cmpl(live, **body)
    chunks, _ = cmpl_stream(live, **body, stream_options={"include_usage": True})
    per = cmpl_choices(live, chunks)
    assert set(per) == {0, 1, 2} and all(s["finish"] == ["length"] and len(s["token_ids"]) == 8 for s in per.values())
    assert [per[i]["token_ids"] for i in range(3)] == [c.token_ids for c in whole.choices]
    assert chunks[-1].choices == []
    check_usage(chunks[-1].usage, completion=24)


@case(f"{T_CMPL_OLD}::test_echo_stream_completion", note="echo, not streamed: the prompt, then the answer")
def cmpl_echo(live: Live) -> None:
    plain, _ = cmpl(live, prompt=HELLO, max_tokens=6, **GREEDY, extra_body=EXACT)
    r, _ = cmpl(live, prompt=HELLO, max_tokens=6, **GREEDY, echo=True, extra_body=EXACT)
    assert HELLO not in plain.choices[0].text
    assert r.choices[0].text == HELLO + plain.choices[0].text and r.choices[0].finish_reason == "length"
    check_usage(r.usage, prompt=len(live.ids(HELLO)), completion=6)


@case(f"{T_CMPL_OLD}::test_echo_stream_completion", note="echo, streamed")
def cmpl_echo_streamed(live: Live) -> None:
    plain, _ = cmpl(live, prompt=HELLO, max_tokens=6, **GREEDY, extra_body=EXACT)
    chunks, _ = cmpl_stream(live, prompt=HELLO, max_tokens=6, **GREEDY, echo=True, extra_body=EXACT)
    s = cmpl_choices(live, chunks)[0]
    assert s["text"] == HELLO + plain.choices[0].text and s["finish"] == ["length"]


@case(f"{T_CMPL}::test_echo_logprob_completion", note="logprobs 1 and 0, a text and a token-id prompt")
def cmpl_echo_logprobs(live: Live) -> None:
    n_prompt = len(live.ids(HELLO))
    for k, prompt in itertools.product((1, 0), (HELLO, live.ids(HELLO))):
        r, _ = cmpl(live, prompt=prompt, max_tokens=5, **GREEDY, echo=True, logprobs=k, extra_body=EXACT)
        c = r.choices[0]
        assert c.text.startswith(HELLO), (k, c.text)
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(max(k, 1) <= len(top) <= k + 1 for top in lp.top_logprobs[1:]), lp.top_logprobs
        check_text_offsets(lp)


@case(f"{T_CMPL}::test_echo_logprob_completion",
      note="echo with max_tokens=0 (vLLM generates one token and answers the prompt alone, counting that token "
           "in usage: CompletionRequest.to_sampling_params, request_output_to_completion_response)")
def cmpl_echo_max_tokens_zero(live: Live) -> None:
    r, _ = cmpl(live, prompt=HELLO, max_tokens=0, echo=True, logprobs=1, **GREEDY, extra_body=EXACT)
    c = r.choices[0]
    n_prompt = len(live.ids(HELLO))
    assert c.text == HELLO and c.finish_reason == "length", c
    assert len(c.logprobs.tokens) == n_prompt and c.logprobs.token_logprobs[0] is None
    check_usage(r.usage, prompt=n_prompt, completion=1)


@case(f"{T_CMPL}::test_no_logprobs")
def cmpl_no_logprobs(live: Live) -> None:
    r, _ = cmpl(live, prompt=live.ids(HELLO), max_tokens=5, **GREEDY, logprobs=None)
    assert r.choices[0].logprobs is None


@case(f"{T_CMPL}::test_zero_logprobs", note="logprobs=0: the sampled token alone, under its own string")
def cmpl_zero_logprobs(live: Live) -> None:
    r, _ = cmpl(live, prompt=live.ids(HELLO), max_tokens=5, **GREEDY, logprobs=0, extra_body=EXACT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5
    assert all(top == {tok: value} for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)), lp


@case(f"{T_CMPL}::test_some_logprobs",
      note="with return_tokens_as_token_ids: the tiny vocabulary's 128 lone high bytes all decode to U+FFFD, so "
           "string keys of top_logprobs can merge; `token_id:N` keys cannot")
def cmpl_some_logprobs(live: Live) -> None:
    r, _ = cmpl(live, prompt=live.ids(HELLO), max_tokens=5, **GREEDY, logprobs=5,
                extra_body={**EXACT, **IDS, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert [token_id(t) for t in lp.tokens] == c.token_ids and len(c.token_ids) == 5
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 5 <= len(top) <= 6 and next(iter(top)) == tok and top[tok] == value == max(top.values()), top


@case(f"{T_CMPL}::test_some_logprobs", note="string tokens: counts, greedy maxima and text offsets")
def cmpl_logprobs_shapes(live: Live) -> None:
    r, _ = cmpl(live, prompt=HELLO, max_tokens=6, **GREEDY, logprobs=3, extra_body=EXACT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 == r.usage.completion_tokens
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and tok in top and value <= 0, (tok, top)
        assert all(v <= value + 1e-6 for v in top.values()), (tok, value, top)
    check_text_offsets(lp)


@case(f"{T_TEXT_OFFSET}::test_stream_text_offset_matches_non_stream_with_stop_holdback")
def cmpl_logprobs_streamed_offsets(live: Live) -> None:
    body = dict(prompt="Hi", max_tokens=8, **GREEDY, logprobs=0, stop=["\n\n"], extra_body=EXACT)
    whole, _ = cmpl(live, **body)
    s = cmpl_choices(live, cmpl_stream(live, **body)[0])[0]
    assert s["tokens"] == whole.choices[0].logprobs.tokens
    assert s["offsets"] == whole.choices[0].logprobs.text_offset
    check_text_offsets(whole.choices[0].logprobs)


@case(f"{T_CMPL}::test_prompt_logprobs_completion", note="prompt_logprobs=1 over two prompts")
def cmpl_prompt_logprobs(live: Live) -> None:
    r, _ = cmpl(live, prompt=PROMPTS, max_tokens=2, **GREEDY, extra_body={"prompt_logprobs": 1, **IDS})
    for c, prompt in zip(r.choices, PROMPTS):
        assert c.prompt_token_ids == live.ids(prompt)
        check_prompt_logprobs(c.prompt_logprobs, c.prompt_token_ids, 1)


@case(f"{T_CMPL}::test_prompt_logprobs_completion", note="prompt_logprobs=0: each entry the prompt token alone")
def cmpl_prompt_logprobs_zero(live: Live) -> None:
    r, _ = cmpl(live, prompt=PROMPTS, max_tokens=2, **GREEDY, extra_body={"prompt_logprobs": 0, **IDS})
    for c in r.choices:
        entries = c.prompt_logprobs
        assert len(entries) == len(c.prompt_token_ids) and entries[0] is None
        assert all(list(e) == [str(t)] for t, e in zip(c.prompt_token_ids[1:], entries[1:])), entries


@case(f"{T_CMPL}::test_completion_stream_options")
def cmpl_stream_options(live: Live) -> None:
    body = dict(prompt="What is the capital of France?", max_tokens=5, **GREEDY, extra_body=EXACT)
    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        chunks, _ = cmpl_stream(live, **body, stream_options=options)
        assert all(ch.usage is None for ch in chunks), options
    chunks, _ = cmpl_stream(live, **body, stream_options={"include_usage": True, "continuous_usage_stats": False})
    *answer, last = chunks
    assert all(ch.usage is None and ch.choices for ch in answer) and last.choices == []
    check_usage(last.usage, prompt=len(live.ids("What is the capital of France?")), completion=5)
    chunks, _ = cmpl_stream(live, **body, stream_options={"include_usage": True, "continuous_usage_stats": True})
    for ch in chunks:
        assert ch.usage is not None and ch.usage.completion_tokens > 0, ch
        check_usage(ch.usage)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


@case(f"{T_TEXT_OFFSET}::test_stream_text_offset_matches_non_stream_with_stop_holdback",
      note="a stop string cut from the greedy answer ends it there, streamed and not")
def cmpl_stop_string(live: Live) -> None:
    body = dict(prompt=HELLO, max_tokens=12, **GREEDY, extra_body=EXACT)
    text = cmpl(live, **body)[0].choices[0].text
    at, stop = pick_stop(text)
    r, _ = cmpl(live, **body, stop=[stop])
    c = r.choices[0]
    assert c.text == text[:at] and c.finish_reason == "stop" and c.stop_reason == stop, (text, stop, c)
    s = cmpl_choices(live, cmpl_stream(live, **body, stop=[stop])[0])[0]
    assert s["text"] == text[:at] and s["finish"] == ["stop"], s


@case(f"{T_TEXT_OFFSET}::test_stream_text_offset_matches_non_stream_with_stop_holdback",
      note="include_stop_str_in_output keeps the stop string")
def cmpl_stop_string_included(live: Live) -> None:
    text = cmpl(live, prompt=HELLO, max_tokens=12, **GREEDY, extra_body=EXACT)[0].choices[0].text
    at, stop = pick_stop(text)
    r, _ = cmpl(live, prompt=HELLO, max_tokens=12, **GREEDY, stop=stop,
                extra_body={**EXACT, "include_stop_str_in_output": True})
    assert r.choices[0].text == text[:at + len(stop)] and r.choices[0].finish_reason == "stop", (text, stop)


@case(f"{T_CMPL}::test_single_completion", note="ignore_eos: exactly max_tokens tokens, finish reason length")
def cmpl_ignore_eos(live: Live) -> None:
    r, headers = cmpl(live, prompt="count", max_tokens=13, **GREEDY, logit_bias={str(EOS): 100},
                      extra_body={**EXACT, **IDS})
    check_route(live, headers)
    c = r.choices[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 13 and c.token_ids == [EOS] * 13, c
    check_usage(r.usage, completion=13)


@case(f"{T_CMPL_OLD}::test_guided_choice_completion", note="n=2, each choice one of the options")
def cmpl_structured_choice(live: Live) -> None:
    r, _ = cmpl(live, prompt="The best language for type-safe systems programming is ", n=2, temperature=1.0,
                max_tokens=16, extra_body={"structured_outputs": {"choice": LANGUAGES}})
    assert len(r.choices) == 2 and all(c.text in LANGUAGES and c.finish_reason == "stop" for c in r.choices), r


@case(f"{T_CMPL_OLD}::test_guided_regex_completion", note="n=3")
def cmpl_structured_regex(live: Live) -> None:
    r, _ = cmpl(live, prompt=f"Give an example IPv4 address with this regex: {IPV4}", n=3, temperature=1.0,
                max_tokens=16, extra_body={"structured_outputs": {"regex": IPV4}})
    assert len(r.choices) == 3 and all(re.fullmatch(IPV4, c.text) for c in r.choices), [c.text for c in r.choices]


@case(f"{T_CMPL_OLD}::test_guided_grammar")
def cmpl_structured_grammar(live: Live) -> None:
    r, _ = cmpl(live, prompt="Generate a sql state that select col_1 from table_1 where it is equals to 1",
                temperature=1.0, max_tokens=48, extra_body={"structured_outputs": {"grammar": SQL_GRAMMAR}})
    c = r.choices[0]
    assert SQL.fullmatch(c.text.strip()) and c.finish_reason == "stop", c


@case(f"{T_CMPL_OLD}::test_guided_json_completion", note="n=2, a schema of enums")
def cmpl_structured_json(live: Live) -> None:
    r, _ = cmpl(live, prompt=f"Give an example JSON that fits this schema: {WEATHER_SCHEMA}", n=2, temperature=1.0,
                max_tokens=48, extra_body={"structured_outputs": {"json": WEATHER_SCHEMA}, **IDS})
    assert len(r.choices) == 2
    for c in r.choices:
        check_json_answer(c.text, c.finish_reason, len(c.token_ids), 48)


@case(f"{T_CMPL_OLD}::test_logits_bias", note="its exclusive-selection half")
def cmpl_logit_bias(live: Live) -> None:
    forced = live.single_token(" model")
    r, _ = cmpl(live, prompt=HELLO, max_tokens=5, **GREEDY, logit_bias={str(forced): 100}, seed=42, extra_body=IDS)
    assert r.choices[0].token_ids == [forced] * 5


@case(f"{T_CMPL_OLD}::test_allowed_token_ids")
def cmpl_allowed_token_ids(live: Live) -> None:
    allowed = [live.single_token(w) for w in (" cache", " request", " the")]
    r, _ = cmpl(live, prompt=HELLO, max_tokens=1, **GREEDY, seed=42, logprobs=1,
                extra_body={"allowed_token_ids": allowed, **IDS})
    c = r.choices[0]
    assert len(c.logprobs.tokens) == 1 and len(c.token_ids) == 1 and c.token_ids[0] in allowed, c


@case(f"{T_TOKEN_IDS}::test_basic_completion_with_emoji")
def cmpl_return_token_ids(live: Live) -> None:
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    r, _ = cmpl(live, prompt=prompt, max_tokens=10, **GREEDY, logprobs=1, extra_body=IDS)
    c = r.choices[0]
    assert c.prompt_token_ids == live.ids(prompt)
    assert len(c.token_ids) == r.usage.completion_tokens == len(c.logprobs.tokens) > 0
    plain, _ = cmpl(live, prompt=prompt, max_tokens=10, **GREEDY, logprobs=1, extra_body={"return_token_ids": False})
    assert getattr(plain.choices[0], "token_ids", None) is None
    assert getattr(plain.choices[0], "prompt_token_ids", None) is None


@case(f"{T_TOKENS_AS_IDS}::test_completion_return_tokens_as_token_ids_completion",
      note="with return_token_ids as well, to check the ids against the prompt's and the output's")
def cmpl_return_tokens_as_token_ids(live: Live) -> None:
    r, _ = cmpl(live, prompt="Say 'Hello, world! 🎉'", max_tokens=6, **GREEDY, echo=True, logprobs=1,
                extra_body={**EXACT, **IDS, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    tokens = c.logprobs.tokens
    assert [token_id(t) for t in tokens] == c.prompt_token_ids + c.token_ids
    assert c.prompt_token_ids == live.ids("Say 'Hello, world! 🎉'") and len(c.token_ids) == 6
    assert c.logprobs.top_logprobs[0] is None
    assert [next(iter(top)) for top in c.logprobs.top_logprobs[1:]] == tokens[1:]


@case(f"{T_TOKEN_IDS}::test_comparison_with_prompt_logprobs_and_logprobs", note="its streaming part")
def cmpl_token_ids_streamed(live: Live) -> None:
    prompt = "Tell me a short fact about Python:"
    chunks, headers = cmpl_stream(live, prompt=prompt, max_tokens=8, **GREEDY, logprobs=1,
                                  extra_body={**EXACT, **IDS, "return_tokens_as_token_ids": True})
    check_route(live, headers)
    s = cmpl_choices(live, chunks)[0]
    assert s["prompt_token_ids"] == [live.ids(prompt)]
    assert s["token_ids"] == [token_id(t) for t in s["tokens"]] and len(s["token_ids"]) == 8


@case(f"{T_CMPL}::test_completion_truncation_side_controls_prompt_truncation")
def cmpl_truncate_prompt_tokens(live: Live) -> None:
    prompt = list(range(8))
    for side, kept in (("right", prompt[:4]), ("left", prompt[-4:])):
        r, _ = cmpl(live, prompt=prompt, max_tokens=1, **GREEDY,
                    extra_body={"truncate_prompt_tokens": 4, "truncation_side": side, **IDS})
        assert r.choices[0].prompt_token_ids == kept, (side, r.choices[0].prompt_token_ids)
        check_usage(r.usage, prompt=4)


# =========================================================================================================
# models
# =========================================================================================================

@case(f"{T_MODELS}::test_check_models", note="root is the model vLLM loads: the tiny model's folder")
def models_list(live: Live) -> None:
    from serve_app.tiny_model import resolve_model

    page = live.sdk.models.list()
    (card,) = page.data
    assert card.id == live.model and card.object == "model" and card.owned_by == "vllm", card
    assert isinstance(card.created, int) and card.created > 0
    assert card.max_model_len == MAX_MODEL_LEN and card.root == resolve_model("tiny:tiny") and card.parent is None
    assert [p["object"] for p in card.permission] == ["model_permission"]
    assert live.http.get("/v1/models").json()["object"] == "list"


@case(f"{T_MODELS}::test_retrieve_base_model",
      note="GET /v1/models/{id} is in vLLM after 0.32 (that test); vLLM 0.32's api_server has /v1/models only")
def models_retrieve(live: Live) -> None:
    card = live.sdk.models.retrieve(live.model)
    listed = live.sdk.models.list().data[0]
    assert card.id == live.model and card.object == "model" and card.owned_by == listed.owned_by
    assert card.max_model_len == MAX_MODEL_LEN and card.root == listed.root


@case(f"{T_MODELS}::test_retrieve_unknown_model", note="raw HTTP: the 404 in the error shape")
def models_retrieve_unknown(live: Live) -> None:
    error(live, "/v1/models/this-model-does-not-exist", method="GET", status=404, err_type=None,
          contains=("does not exist",))


# =========================================================================================================
# errors (raw HTTP)
# =========================================================================================================

@case(f"{T_LORA_RESOLVERS}::test_serving_completion_resolver_not_found",
      note="vLLM's _check_model: 404 NotFoundError naming the model, param model")
def err_unknown_model_completion(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, model="non-existent-lora-adapter"), status=404, err_type=NOT_FOUND,
          param="model", contains=("The model `non-existent-lora-adapter` does not exist",))


@case(f"{T_LORA_RESOLVERS}::test_serving_completion_resolver_not_found", note="the same on chat")
def err_unknown_model_chat(live: Live) -> None:
    error(live, CHAT, chat_body(live, model="gpt-9"), status=404, err_type=NOT_FOUND, param="model",
          contains=("The model `gpt-9` does not exist",))


@case(f"{T_CMPL}::test_single_completion",
      note="max_tokens below 1 (SamplingParams._verify_args); no vLLM test sends one")
def err_max_tokens_negative(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, max_tokens=-1), param="max_tokens",
          contains=("max_tokens must be at least 1, got -1",))
    error(live, CHAT, chat_body(live, max_completion_tokens=-1), param="max_tokens",
          contains=("max_tokens must be at least 1, got -1",))


@case(f"{T_CMPL}::test_single_completion", note="max_tokens=0 without echo (SamplingParams._verify_args)")
def err_max_tokens_zero(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, max_tokens=0), param="max_tokens",
          contains=("max_tokens must be at least 1, got 0",))


@case(f"{T_SERVING_CHAT}::test_serving_chat_should_set_correct_max_tokens",
      note="more output than the context window is vLLM's TokenizeParams error, naming the field sent")
def err_max_tokens_above_context(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, max_tokens=5000), param="max_tokens",
          contains=("max_tokens=5000 cannot be greater than max_model_len=2048",))
    error(live, CHAT, chat_body(live, max_completion_tokens=5000), param="max_completion_tokens",
          contains=("max_completion_tokens=5000 cannot be greater than max_model_len=2048",))


@case(f"{T_SERVING_CHAT}::test_serving_chat_could_load_correct_generation_config",
      note="temperature outside [0, 2] (SamplingParams._verify_args); no vLLM test sends one")
def err_temperature_out_of_range(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, temperature=3.0), param="temperature",
          contains=("temperature must be in [0, 2], got 3.0",))
    error(live, CHAT, chat_body(live, temperature=-0.5), param="temperature",
          contains=("temperature must be non-negative, got -0.5",))


@case(f"{T_CHAT}::test_zero_logprobs_chat", note="top_logprobs without logprobs (ChatCompletionRequest.check_logprobs)")
def err_top_logprobs_without_logprobs(live: Live) -> None:
    error(live, CHAT, chat_body(live, top_logprobs=2), param="top_logprobs",
          contains=("when using `top_logprobs`, `logprobs` must be set to true",))


@case(f"{T_CHAT}::test_too_many_chat_logprobs", note="vLLM's max_logprobs is 20")
def err_too_many_chat_logprobs(live: Live) -> None:
    for k in (21, 30):
        error(live, CHAT, chat_body(live, logprobs=True, top_logprobs=k), param="top_logprobs",
              contains=(f"Requested sample logprobs of {k}, which is greater than max allowed: 20",))
    assert chat(live, messages=MESSAGES, max_completion_tokens=3)[0].choices[0].message.content is not None


@case(f"{T_CHAT}::test_too_many_chat_logprobs", note="streamed (see streamed_error)")
def err_too_many_chat_logprobs_streamed(live: Live) -> None:
    streamed_error(live, CHAT, chat_body(live, logprobs=True, top_logprobs=21), param="top_logprobs",
                   contains=("greater than max allowed: 20",))


@case(f"{T_CMPL}::test_too_many_completion_logprobs")
def err_too_many_completion_logprobs(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, prompt=[0, 0, 0, 0, 0], logprobs=21), param="logprobs",
          contains=("Requested sample logprobs of 21, which is greater than max allowed: 20",))
    streamed_error(live, COMPLETIONS, cmpl_body(live, prompt=[0, 0, 0, 0, 0], logprobs=30), param="logprobs",
                   contains=("greater than max allowed: 20",))
    assert cmpl(live, prompt=[0, 0, 0, 0, 0], max_tokens=5, **GREEDY)[0].choices[0].text is not None


@case(f"{T_CMPL}::test_some_logprobs", note="a negative logprobs (CompletionRequest.check_logprobs)")
def err_negative_logprobs(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, logprobs=-2), param="logprobs",
          contains=("`logprobs` must be a positive value or -1",))


@case(f"{T_CMPL}::test_prompt_logprobs_completion",
      note="-2 is the protocol's error; -1 asks for the whole vocabulary, over max_logprobs")
def err_prompt_logprobs_negative(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, prompt=PROMPTS, prompt_logprobs=-2), param="prompt_logprobs",
          contains=("`prompt_logprobs` must be a positive value or -1",))
    error(live, COMPLETIONS, cmpl_body(live, prompt=PROMPTS, prompt_logprobs=-1), param="prompt_logprobs",
          contains=("Requested prompt logprobs of",))
    error(live, CHAT, chat_body(live, messages=HISTORY, prompt_logprobs=-1), param="prompt_logprobs",
          contains=("Requested prompt logprobs of",))


@case(f"{T_CMPL}::test_prompt_logprobs_completion", note="prompt_logprobs cannot be streamed")
def err_prompt_logprobs_streamed(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, prompt_logprobs=1, stream=True), param="prompt_logprobs",
          contains=("`prompt_logprobs` are not available when `stream=True`",))
    error(live, CHAT, chat_body(live, prompt_logprobs=1, stream=True), param="prompt_logprobs",
          contains=("`prompt_logprobs` are not available when `stream=True`",))


@case(f"{T_CHAT}::test_long_seed", note="seeds beyond 64 bits: FastAPI's request validation. " + NAMES_THE_FIELD)
def err_seed_beyond_int64(live: Live) -> None:
    for seed, kind in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):
        error(live, CHAT, chat_body(live, messages=[SYSTEM], temperature=0, seed=seed), err_type=BAD_REQUEST,
              param="seed", contains=(kind,))


@case(f"{T_CHAT}::test_chat_completion_stream_options", note="stream_options with stream false")
def err_stream_options_without_stream_chat(live: Live) -> None:
    for options in ({"include_usage": None}, {"include_usage": True}):
        error(live, CHAT, chat_body(live, stream=False, stream_options=options), param="stream_options",
              contains=("Stream options can only be defined when `stream=True`",))


@case(f"{T_CMPL}::test_completion_stream_options", note="stream_options with stream false")
def err_stream_options_without_stream_completion(live: Live) -> None:
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        error(live, COMPLETIONS, cmpl_body(live, stream=False, stream_options=options), param="stream_options",
              contains=("Stream options can only be defined when `stream=True`",))


@case(f"{T_NON_OBJECT}::test_chat_completion_request_rejects_non_object_body",
      note="FastAPI's validation: a JSON decode error, or a body that is not an object")
def err_body_not_json(live: Live) -> None:
    error(live, CHAT, content=b"this is not valid json{{{", err_type=BAD_REQUEST, contains=("JSON decode error",))
    for raw in (b'["not", "an", "object"]', b"42", b"null"):
        error(live, CHAT, content=raw, err_type=BAD_REQUEST, param="body")


@case(f"{T_BASIC}::test_request_wrong_content_type",
      note="vLLM's validate_json_request: any media type but application/json. " + NAMES_THE_FIELD)
def err_not_json_content_type(live: Live) -> None:
    body = json.dumps(chat_body(live)).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        error(live, CHAT, content=body, content_type=content_type, err_type=BAD_REQUEST, param="Content-Type",
              contains=("Unsupported Media Type: Only 'application/json' is allowed",))


@case(f"{T_CHAT_ERROR}::test_system_message_accepts_text",
      note="no messages: vLLM's chat template step refuses an empty conversation. " + NAMES_THE_FIELD)
def err_empty_messages(live: Live) -> None:
    error(live, CHAT, chat_body(live, messages=[]), param="messages",
          contains=("Cannot apply chat template to an empty conversation",))


@case(f"{T_PROMPT_VALIDATION}::test_out_of_vocab_token_ids",
      note="a token-id prompt longer than max_model_len: the renderer's length check. " + NAMES_THE_FIELD)
def err_prompt_too_long(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, prompt=[100] * 2100), param="prompt",
          contains=("maximum context length is 2048 tokens", "contains 2100 input tokens"))


@case(f"{T_SERVING_CHAT}::test_serving_chat_mistral_token_ids_prompt_too_long_is_rejected",
      note="a chat prompt longer than max_model_len (the tokenizer stops at 2049)")
def err_chat_prompt_too_long(live: Live) -> None:
    error(live, CHAT, chat_body(live, messages=[{"role": "user", "content": "word " * 3000}]), param="messages",
          contains=("maximum context length is 2048 tokens",))


@case(f"{T_CHAT}::test_chat_completion_request_n_parameter_various_values",
      note="n=0 (SamplingParams). " + NAMES_THE_FIELD)
def err_n_zero(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, n=0), param="n", contains=("n must be at least 1, got 0",))
    error(live, CHAT, chat_body(live, n=0), param="n", contains=("n must be at least 1, got 0",))


@case(f"{T_CMPL}::test_batch_completions", note="n > 1 with greedy sampling (why that test needs beam search)")
def err_n_greedy(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, n=2, temperature=0), param="n",
          contains=("n must be 1 when using greedy sampling, got 2",))


@case(f"{T_TEXT_OFFSET}::test_stream_text_offset_matches_non_stream_with_stop_holdback",
      note="an empty stop string (SamplingParams._verify_args)")
def err_empty_stop_string(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, stop=[""]), param="stop", contains=("stop cannot contain an empty string",))


@case(f"{T_CHAT}::test_chat_completion_stream_options", note="min_tokens above max_tokens (SamplingParams)")
def err_min_tokens_above_max_tokens(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, max_tokens=2, min_tokens=5), param="min_tokens",
          contains=("min_tokens must be less than or equal to max_tokens=2, got 5",))


@case(f"{T_LOGIT_BIAS}::test_chat_logit_bias_invalid")
def err_logit_bias_out_of_vocab(live: Live) -> None:
    bad = live.vocab_size + 1
    error(live, CHAT, chat_body(live, logit_bias={str(bad): 1.0}), param="logit_bias",
          contains=(str(bad), f"Vocabulary size: {live.vocab_size}"))


@case(f"{T_STOP_IDS}::test_chat_stop_token_ids_out_of_vocab", note="and test_chat_stop_token_ids_negative")
def err_stop_token_ids_out_of_vocab(live: Live) -> None:
    bad = live.vocab_size + 1
    error(live, CHAT, chat_body(live, stop_token_ids=[bad]), param="stop_token_ids",
          contains=(str(bad), f"Vocabulary size: {live.vocab_size}"))
    error(live, CHAT, chat_body(live, stop_token_ids=[-1]), param="stop_token_ids")


@case(f"{T_CMPL_OLD}::test_allowed_token_ids", note="out of the vocabulary, or empty (SamplingParams.verify)")
def err_allowed_token_ids(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, allowed_token_ids=[live.vocab_size + 1]), param="allowed_token_ids",
          contains=("allowed_token_ids contains out-of-vocab token id",))
    error(live, COMPLETIONS, cmpl_body(live, allowed_token_ids=[]), param="allowed_token_ids",
          contains=("allowed_token_ids is not None and empty",))


@case(f"{T_PROMPT_VALIDATION}::test_out_of_vocab_token_ids",
      note="vLLM's engine checks it; the router, which has the vocabulary, before routing. " + NAMES_THE_FIELD)
def err_prompt_out_of_vocab(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, prompt=[999999]), param="prompt",
          contains=("Token id 999999 is out of vocabulary",))


@case(f"{T_CMPL_ERROR}::test_negative_prompt_token_ids_flat", note="and the nested form; FastAPI's validation")
def err_negative_prompt_token(live: Live) -> None:
    for prompt in ([-1], [[-1]]):
        error(live, COMPLETIONS, cmpl_body(live, prompt=prompt), err_type=BAD_REQUEST,
              contains=("greater than or equal to 0",))


@case(f"{T_PROMPT_VALIDATION}::test_empty_prompt", note="an empty string, a missing prompt")
def err_empty_prompt(live: Live) -> None:
    for body in (cmpl_body(live, prompt=""), {"model": live.model, "max_tokens": 4}):
        error(live, COMPLETIONS, body, param="prompt",
              contains=("Either prompt or prompt_embeds must be provided and non-empty.",))


@case(f"{T_EMPTY_PROMPT_LIST}::test_empty_prompt_list_rejected",
      note="vLLM 0.32 refuses [] in its renderer (a ValueError, param null), not yet in the protocol as that "
           "later test expects")
def err_empty_prompt_list(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, prompt=[]), param="prompt", contains=("at least one prompt",))


@case(f"{T_CMPL}::test_single_completion",
      note="suffix needs FIM rendering, which only some renderers have (vllm/renderers/online_renderer.py, "
           "render_completion); no test under tests/entrypoints/openai covers suffix")
def err_suffix(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, suffix="and that is all"), param="suffix",
          contains=("suffix is only supported for models with FIM completion rendering",))


@case(f"{T_CHAT_ERROR}::test_json_schema_response_format_missing_schema")
def err_json_schema_missing_chat(live: Live) -> None:
    error(live, CHAT, chat_body(live, response_format={"type": "json_schema"}), param="response_format",
          contains=("the 'json_schema' field must be provided",))


@case(f"{T_CMPL_ERROR}::test_json_schema_response_format_missing_schema")
def err_json_schema_missing_completion(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, response_format={"type": "json_schema"}), param="response_format",
          contains=("the 'json_schema' field must be provided",))


@case(f"{T_CMPL_OLD}::test_guided_decoding_type_error", note="two kinds of constraint at once")
def err_two_structured_outputs(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, structured_outputs={"regex": IPV4, "json": WEATHER_SCHEMA}),
          param="structured_outputs", contains=("You can only use one kind of constraints",))


@case(f"{T_CHAT}::test_structured_outputs_type_error", note="a regex that is not a string: FastAPI's validation")
def err_structured_outputs_type(live: Live) -> None:
    error(live, CHAT, chat_body(live, structured_outputs={"regex": {"1": "Python", "2": "C++"}}),
          err_type=BAD_REQUEST, param="structured_outputs.regex")


@case(f"{T_CMPL}::test_invalid_regex",
      note="refused by the engine's structured-output validation (xgrammar, then guidance: the backend is auto)")
def err_invalid_regex(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, structured_outputs={"regex": r"[.*"}, stop=["\n"]))


@case(f"{T_CMPL}::test_invalid_grammar", note="as err_invalid_regex")
def err_invalid_grammar(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, structured_outputs={"grammar": INVALID_SQL_GRAMMAR}))


@case(f"{T_CMPL}::test_invalid_json_schema", note="as err_invalid_regex; and test_chat_completion.py's, on chat")
def err_invalid_json_schema(live: Live) -> None:
    error(live, COMPLETIONS, cmpl_body(live, structured_outputs={"json": INVALID_CAR_SCHEMA}))
    error(live, CHAT, chat_body(live, structured_outputs={"json": INVALID_CAR_SCHEMA}))


@case(f"{T_CHAT_COMPLETION}::test_empty_grammar", note="SamplingParams._validate_structured_outputs, param null")
def err_empty_grammar(live: Live) -> None:
    error(live, CHAT, chat_body(live, structured_outputs={"grammar": ""}), param="structured_outputs",
          contains=("structured_outputs.grammar cannot be an empty string",))


assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
