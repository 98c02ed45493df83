"""The text the router makes (serve_app/router_text.py), with the served tiny model's real
tokenizer. What a failed stream sent is made as vLLM makes it: a `tokenizers` DecodeStream primed
with the prompt, then vLLM's stop-string hold-back."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from factories import tiny_tokenizer, vllm_text  # noqa: E402
from serve_app.router_text import RouterText, ends_inside_character  # noqa: E402

ANSWER = " café ☕ 中文 naïve, done. Then more"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def decoder(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def continued(tok, prompt, output, k, stop=None, hold=0, chunk=3, min_tokens=0):
    """The client's text when the stream fails after output[:k] and the rest arrives in chunks."""
    sent = vllm_text(tok, prompt, output[:k])
    sent = sent[:len(sent) - hold] if hold else sent
    text = RouterText(decoder(tok), prompt, output[:k], sent, stop, min_tokens)
    kept_total, rest = k, output[k:]
    for i in range(0, len(rest), chunk):
        ids = rest[i:i + chunk]
        out, kept = text.feed(ids, finished=i + chunk >= len(rest))
        sent += out
        if kept is not None:
            return sent, kept_total + kept
        kept_total += len(ids)
    return sent, kept_total


def test_vllm_itself_repeats_the_prompt_when_it_ends_inside_a_character(tok):
    """Why the router makes the text: the new instance's own text would be wrong at a split character."""
    prompt, output = tok.encode("Say it:"), tok.encode(ANSWER)
    split = next(k for k in range(1, len(output)) if tok.decode(output[:k]).endswith("\ufffd"))
    assert vllm_text(tok, prompt + output[:split], output[split:]).startswith("Say it:")


def test_the_text_is_whole_wherever_the_stream_failed(tok):
    prompt, output = tok.encode("Say it:"), tok.encode(ANSWER)
    whole = vllm_text(tok, prompt, output)
    assert whole == ANSWER
    splits = 0
    for k in range(1, len(output)):
        splits += tok.decode(output[:k]).endswith("\ufffd")
        for chunk in (1, 3):
            assert continued(tok, prompt, output, k, chunk=chunk) == (whole, len(output)), (k, chunk)
    assert splits >= 4  # the answer's characters of 2, 3 and 4 bytes were split


def test_text_held_back_for_a_stop_string_is_sent_and_stop_strings_span_the_seam(tok):
    prompt, output = tok.encode("Say it:"), tok.encode(ANSWER)
    whole = vllm_text(tok, prompt, output)
    cut = whole.index(". Then")
    for k in range(1, len(output)):
        # vLLM held back len(stop) - 1 = 5 characters that could begin ". Then"
        text, kept = continued(tok, prompt, output, k, stop=[". Then", "zzz"], hold=5)
        if len(vllm_text(tok, prompt, output[:k])) > cut + 5:
            continue  # the failed engine would have stopped already
        assert text == whole[:cut], k
        assert tok.decode(output[:kept]).startswith(whole[:cut] + ". Then")  # the token that completed it is kept
        assert not tok.decode(output[:kept - 1]).startswith(whole[:cut] + ". Then")


def test_min_tokens_defers_the_stop_strings(tok):
    prompt, output = tok.encode("Say it:"), tok.encode(" a. b. c.")  # " a" "." " b" "." " c" "."
    text, kept = continued(tok, prompt, output, 1, stop=".")
    assert text == " a" and kept == 2
    text, kept = continued(tok, prompt, output, 1, stop=".", min_tokens=3)  # the 4th token's "." stops it
    assert text == " a. b" and kept == 4
    text, kept = continued(tok, prompt, output, 1, stop=".", min_tokens=4)  # as vLLM: from the 5th token on
    assert text == " a. b. c" and kept == 6


def test_a_stop_token_adds_no_text_and_a_client_text_we_cannot_place_is_not_sent_again(tok):
    prompt, output = tok.encode("Say it:"), tok.encode(" one two three")
    text = RouterText(decoder(tok), prompt, output[:1], vllm_text(tok, prompt, output[:1]), None)
    out, kept = text.feed(output[1:], finished=True, token_stopped=True)
    assert out == vllm_text(tok, prompt + output[:1], output[1:-1]) and kept is None
    strange = RouterText(decoder(tok), prompt, output[:2], "something else", None)
    assert strange.feed(output[2:], finished=True) == (vllm_text(tok, prompt + output[:2], output[2:]), None)


def test_a_prompt_that_ends_inside_a_character_gets_its_output_text_alone(tok):
    prompt, output = tok.encode("Say it: café"), tok.encode(" and more")
    cut = next(k for k in range(1, len(prompt)) if tok.decode(prompt[:k]).endswith("\ufffd"))
    assert ends_inside_character(decoder(tok), prompt[:cut]) and not ends_inside_character(decoder(tok), prompt)
    assert vllm_text(tok, prompt[:cut], prompt[cut:] + output).startswith("Say it:")  # vLLM's: the prompt again
    text = RouterText(decoder(tok), prompt[:cut], [])
    out, kept = text.feed(prompt[cut:] + output, finished=True)
    assert (out, kept) == (" and more", None)  # the character the prompt began ends in the prompt's text
