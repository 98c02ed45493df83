"""Output text the router makes itself, where vLLM's would be wrong (pure: a tokenizer's `decode`,
no Ray, no vLLM).

vLLM primes its detokenizer with the prompt, and when the prompt ends inside a multi-byte
character, the first text it emits repeats the whole prompt (measured with vLLM alone: the
token-id prompt "Say it: caf" + the first byte of "é" gives "Say it: caf�36 object..."). Two
prompts can end so:
- a client's token-id prompt;
- a migrated decode's: the new instance gets prompt + the tokens already sent. There, text the
  failed engine held back is in nobody's output as well: the first bytes of a character not yet
  complete, and, for a request with stop strings, the last characters that could begin one.
In both the router detokenizes the output itself, as vLLM's incremental detokenizer does (after a
migration from the tokens already sent on, sending what the failed stream held back), and applies
the stop strings: the engines are given none, their text is not used.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Sequence

PROMPT_CONTEXT = 6  # prompt tokens decoded before the output: what a token's leading space depends on
REPLACEMENT = "\ufffd"  # what a decode gives for the bytes of a character not yet complete


def ends_inside_character(decode: Callable[[list[int]], str], prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt's last tokens end inside a multi-byte character (vLLM's text would be wrong)."""
    return decode(list(prompt_ids[-PROMPT_CONTEXT:])).endswith(REPLACEMENT)


class RouterText:
    """Detokenizes a request's output and applies its stop strings.

    `decode(ids)` is the served model's tokenizer (special tokens skipped); `output_ids` are the
    output tokens already sent (after a migration; else none), `text_sent` their text as the
    client got it.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int], output_ids: Sequence[int],
                 text_sent: str = "", stop: str | list[str] | None = None,
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix, self._read = 0, len(self._ids)  # vLLM's offsets: the text so far is decode(ids[prefix:read])
        self.stop = [stop] if isinstance(stop, str) else list(stop or ())
        self._hold = max(map(len, self.stop)) - 1 if self.stop else 0  # what could begin a stop string
        self.min_tokens = min_tokens
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the stop string ends the text
        self.stopped_by: str | None = None  # the stop string that ended the answer
        self.tokens = 0  # output tokens, before the migration included
        self.text = ""  # the output text, as vLLM would have made it
        for t in output_ids:
            self.text += self._step(t)
        self.tokens = len(output_ids)
        # what the client has: when its text is not a prefix of ours, no text of before is sent
        # again (a lost character is the lesser harm than a repeated one)
        self.sent = len(text_sent) if self.text.startswith(text_sent) else len(self.text)

    def _step(self, token: int) -> str:
        """The text `token` completes (vLLM's incremental detokenization with `decode`)."""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""  # a character not yet complete: its bytes wait for the next token

    def feed(self, token_ids: Sequence[int], finished: bool, token_stopped: bool = False) -> tuple[str, int | None]:
        """The text to send for the next `token_ids`, and, when a stop string ends the answer in
        them, how many of them to keep (None: no stop string). `finished`: the engine ended the
        answer with them; `token_stopped`: by a stop token (EOS, `stop_token_ids`), whose text vLLM
        leaves out."""
        before = self.tokens
        offsets = [len(self.text)]
        for t in token_ids[:-1] if token_stopped else token_ids:
            self.text += self._step(t)
            offsets.append(len(self.text))
        if token_stopped:
            offsets.append(len(self.text))
        self.tokens += len(token_ids)
        kept = None
        if self.stop and self.tokens > self.min_tokens:
            checked_from = offsets[max(self.min_tokens - before, 0)]
            hit = self._earliest_stop(checked_from)
            if hit is not None:
                start, end = hit
                kept = bisect_left(offsets, end, lo=1)  # the token that completed the stop string is kept
                self.tokens = before + kept
                self.stopped_by = self.text[start:end]
                self.text = self.text[:end] if self.include_stop else self.text[:start]
                finished = True
        end = len(self.text) if finished else len(self.text) - self._hold
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, kept

    def _earliest_stop(self, new_from: int) -> tuple[int, int] | None:
        """(start, end) of the stop string that ends first among those that end after `new_from`."""
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i + len(s) < best[1]):
                best = (i, i + len(s))
        return best
