"""Request validation of the OpenAI layer: every bad field becomes a 400 naming it (pure, no engines)."""

import json

import pytest

from serve_app.openai_api import ApiError, completion_body, parse_request, stream_chunk, usage


def parse(body, kind="completion"):
    return parse_request(json.dumps(body).encode(), kind)


@pytest.mark.parametrize("body, kind, param", [
    ({"model": "m"}, "completion", "prompt"),
    ({"model": "m", "prompt": 5}, "completion", "prompt"),
    ({"model": "m", "prompt": ""}, "completion", "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "completion", "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "completion", "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "completion", "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "completion", "top_p"),
    ({"model": "m", "prompt": "x", "n": 3}, "completion", "n"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "completion", "stop"),
    ({"prompt": "x"}, "completion", "model"),
    ({"model": "m", "messages": []}, "chat", "messages"),
    ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "chat", "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "chat", "messages.0.content"),
])
def test_bad_fields_are_named(body, kind, param):
    with pytest.raises(ApiError) as e:
        parse(body, kind)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["param"] == param


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff\xfe", b"null"])
def test_malformed_bodies(raw):
    with pytest.raises(ApiError) as e:
        parse_request(raw, "completion")
    assert e.value.status == 400 and e.value.param is None


def test_valid_requests_give_engine_sampling():
    req = parse({"model": "m", "prompt": "x", "max_tokens": 7, "temperature": 0, "seed": 3, "stop": "\n",
                 "ignore_eos": True, "user": "ignored"})
    assert req.sampling(default_max_tokens=100) == {"max_tokens": 7, "temperature": 0.0, "top_p": 1.0,
                                                    "ignore_eos": True, "stop": "\n", "seed": 3}
    assert parse({"model": "m", "prompt": "x"}).sampling(default_max_tokens=100)["max_tokens"] == 100


def test_stream_chunks_are_sse_json():
    chunk = stream_chunk("id1", "m", "hi", None, chat=True, first=True)
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    body = json.loads(chunk[6:])
    assert body["choices"][0]["delta"] == {"content": "hi", "role": "assistant"}
    u = json.loads(stream_chunk("id1", "m", "", None, chat=False, usage=usage(3, 4))[6:])
    assert u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7} and u["choices"] == []



def test_token_ids_go_where_vllm_puts_them():
    """completions: both in the choice; chat: the prompt's at the top; streamed: the prompt's once."""
    ids = ([5, 6], [7, 8, 9])
    c = completion_body("id1", "m", "abc", "length", usage(2, 3), chat=False, token_ids=ids)
    assert (c["choices"][0]["prompt_token_ids"], c["choices"][0]["token_ids"]) == ([5, 6], [7, 8, 9])
    ch = completion_body("id1", "m", "abc", "length", usage(2, 3), chat=True, token_ids=ids)
    assert (ch["prompt_token_ids"], ch["choices"][0]["token_ids"]) == ([5, 6], [7, 8, 9])
    assert "prompt_token_ids" not in ch["choices"][0]
    plain = completion_body("id1", "m", "abc", "length", usage(2, 3), chat=False)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    first = json.loads(stream_chunk("id1", "m", "a", None, chat=False, first=True, token_ids=([5, 6], (7,)))[6:])
    assert (first["choices"][0]["prompt_token_ids"], first["choices"][0]["token_ids"]) == ([5, 6], [7])
    later = json.loads(stream_chunk("id1", "m", "b", None, chat=True, token_ids=(None, (8, 9)))[6:])
    assert later["choices"][0]["token_ids"] == [8, 9] and "prompt_token_ids" not in later
    first_chat = json.loads(stream_chunk("id1", "m", "a", None, chat=True, first=True, token_ids=([5], (7,)))[6:])
    assert first_chat["prompt_token_ids"] == [5] and "prompt_token_ids" not in first_chat["choices"][0]


def test_return_token_ids_is_a_bool_and_not_an_engine_setting():
    req = parse({"model": "m", "prompt": "x", "return_token_ids": True})
    assert req.return_token_ids is True and "return_token_ids" not in req.sampling(default_max_tokens=4)
    with pytest.raises(ApiError) as e:
        parse({"model": "m", "prompt": "x", "return_token_ids": "yes"})
    assert e.value.status == 400 and e.value.param == "return_token_ids"

@pytest.mark.parametrize("body, kind, param", [
    ({"model": "m", "prompt": "x", "tools": []}, "completion", "tools"),
    ({"model": "m", "prompt": "x", "echo": True}, "completion", "echo"),
    ({"model": "m", "prompt": "x", "top_k": 1.5}, "completion", "top_k"),
    ({"model": "m", "prompt": "x", "frequency_penalty": -2.5}, "completion", "frequency_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "completion", "logit_bias"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "completion", "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat", "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "chat", "logprobs"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}}, "completion", "response_format"),
])
def test_the_wider_surface_is_validated(body, kind, param):
    with pytest.raises(ApiError) as e:
        parse(body, kind)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("raw", [b'{"model": "m", "prompt": "x", "top_p": NaN}', b"[" * 100_000 + b"]" * 100_000])
def test_pathological_json_is_a_400(raw):
    with pytest.raises(ApiError) as e:
        parse_request(raw, "completion")
    assert e.value.status == 400 and e.value.param is None


def test_no_op_fields_are_accepted_and_not_passed_on():
    req = parse({"model": "m", "prompt": "x", "user": "u", "metadata": {"k": "v"}, "store": True,
                 "service_tier": "auto"})
    assert set(req.sampling(default_max_tokens=5)) == {"max_tokens", "temperature", "top_p", "ignore_eos"}
