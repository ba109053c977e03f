"""Incremental detokenization and stop strings.

Decoding a growing list of ids one token at a time is wrong for byte-level and SentencePiece
tokenizers (a character may span tokens; a word's leading space depends on its neighbour), and
decoding everything each step is quadratic. We keep two offsets into the ids (the classic
prefix/read scheme): text is emitted only once it no longer ends in an incomplete character.
"""
from __future__ import annotations

from typing import Any

from pagedllm.engine.token_decode import Decode, decode_function

# Prompt tokens kept as left context so the first output token decodes with its leading space.
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, decode: Decode | None = None) -> None:
        self.min_tokens = min_tokens  # stop strings do not count before this many output tokens
        self.num_output_tokens = 0
        self.tokenizer = tokenizer
        # ``decode``: the tokenizer's decode call, chosen once per tokenizer (engine/token_decode.py).
        self._decode = decode or decode_function(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # While stop strings may still match, hold back this many characters of a stream.
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1 if self.stop else 0
        context = self._left_context(self._decode, prompt_token_ids, skip_special_tokens)
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""

    @staticmethod
    def _left_context(decode: Decode, prompt_token_ids: list[int], skip: bool) -> list[int]:
        """The last few prompt tokens, starting on a character boundary: a window that began
        inside a character spelled by byte tokens would decode to U+FFFD forever."""
        start = max(0, len(prompt_token_ids) - _INITIAL_CONTEXT)
        lowest = max(0, start - 8)  # a UTF-8 character spans at most 4 byte tokens
        while start > lowest and decode(
                prompt_token_ids[start:], skip_special_tokens=skip).startswith("\ufffd"):
            start -= 1
        return list(prompt_token_ids[start:])

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (the text is then
        truncated at it, or just after it with include_stop_str_in_output)."""
        start_len = len(self.output_text)
        for tok in new_token_ids:
            self._ids.append(tok)
            self.output_text += self._decode_next()
        self.num_output_tokens += len(new_token_ids)
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return None
        return self._check_stop_strings(start_len)

    def _decode_next(self) -> str:
        skip = self.skip_special_tokens
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = self._decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence (or nothing new yet): wait for more tokens
        new = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new

    def _check_stop_strings(self, start_len: int) -> str | None:
        text = self.output_text
        for s in self.stop:
            # Only the new text (plus room for a stop string straddling the boundary) is searched.
            idx = text.find(s, max(0, start_len - len(s) + 1))
            if idx >= 0:
                cut = idx + len(s) if self.include_stop_str_in_output else idx
                self.output_text = text[:cut]
                return s
        return None

    def text_to_stream(self, sent: int, finished: bool) -> str:
        """The text a stream may show now, given ``sent`` characters already shown."""
        end = len(self.output_text) if finished else len(self.output_text) - self.stop_buffer_length
        return self.output_text[sent:end] if end > sent else ""
