"""The router's edge of the OpenAI API (`serve_app.openai_api`): a body becomes vLLM's own request
model, or a 400 naming the field; no engines. What vLLM checks only later (sampling ranges, the
context window) is answered by vLLM's serving classes and covered live (test_conformance.py)."""

import json

import pytest

pytest.importorskip("vllm")

from serve_app.openai_api import ApiError, check_media_type, parse_openai, prompt_sizes  # noqa: E402

CHAT = [{"role": "user", "content": "x"}]


def parse(body, kind="completion"):
    return parse_openai(json.dumps(body).encode(), kind)


@pytest.mark.parametrize("body, kind, param", [
    ({"model": "m"}, "completion", "prompt"),
    ({"model": "m", "prompt": 5}, "completion", "prompt"),
    ({"model": "m", "prompt": ""}, "completion", "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "completion", "prompt"),
    ({"model": "m", "prompt": "x", "seed": 2**64}, "completion", "seed"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "completion", "stream_options"),
    ({"model": "m", "prompt": "x", "top_k": 1.5}, "completion", "top_k"),
    ({"model": "m", "messages": CHAT, "top_logprobs": 2}, "chat", "top_logprobs"),
    ({"model": "m", "messages": CHAT, "kv_transfer_params": {"do_remote_prefill": True}}, "chat",
     "kv_transfer_params"),
])
def test_bad_fields_are_named(body, kind, param):
    with pytest.raises(ApiError) as e:
        parse(body, kind)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["param"] == param


@pytest.mark.parametrize("raw, param", [(b"{", None), (b"\xff\xfe", None), (b'{"model": "m", "top_p": NaN}', None),
                                        (b"[" * 100_000 + b"]" * 100_000, None), (b"[1, 2]", "body"), (b"null", "body")])
def test_malformed_bodies_are_400s(raw, param):
    """Not JSON: no field to name; JSON but not an object: the body, as vLLM names it."""
    with pytest.raises(ApiError) as e:
        parse_openai(raw, "completion")
    assert e.value.status == 400 and e.value.param == param


def test_vllms_surface_is_taken_whole():
    """Content parts, n, tools, list prompts, vLLM's own fields and unknown message fields: all
    parse (vLLM's models accept them), with vLLM's defaults."""
    chat = parse({"model": "m", "n": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "bc"}], "extra": 1}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required", "structured_outputs": None, "include_stop_str_in_output": True}, "chat")
    assert chat.n == 3 and chat.tool_choice == "required" and prompt_sizes(chat, True) == [(3, False)]
    cmpl = parse({"model": "m", "prompt": ["ab", "cde"], "echo": True, "prompt_logprobs": 1,
                  "allowed_token_ids": [1, 2], "bad_words": ["x"]})
    assert cmpl.echo and prompt_sizes(cmpl, False) == [(2, False), (3, False)]
    assert parse({"model": "m", "prompt": "x"}).max_tokens == 16  # OpenAI's and vLLM's default
    assert prompt_sizes(parse({"model": "m", "prompt": [[1, 2, 3], [4]]}), False) == [(3, True), (1, True)]


@pytest.mark.parametrize("content_type, ok", [("application/json", True), ("application/json; charset=utf-8", True),
                                               ("text/plain", False), (None, False)])
def test_only_json_bodies_are_served(content_type, ok):
    if ok:
        check_media_type(content_type)
        return
    with pytest.raises(ApiError) as e:
        check_media_type(content_type)
    assert e.value.status == 400 and e.value.param == "Content-Type"


def test_the_openai_options_are_checked_with_the_config():
    """`model.openai` takes `vllm serve`'s flags; auto tool choice without a parser is refused there,
    naming the field, as `vllm serve` refuses it."""
    from factories import shipped_args
    from serve_app.config import ConfigError, parse_args

    args = shipped_args()
    assert parse_args(args, prefix=("args",)).model.openai.tool_call_parser == "hermes"
    args["model"]["openai"] = {"enable_auto_tool_choice": True}
    with pytest.raises(ConfigError) as e:
        parse_args(args, prefix=("args",))
    assert "args.model.openai" in str(e.value) and "tool_call_parser" in str(e.value)
