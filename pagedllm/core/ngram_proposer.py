"""N-gram (prompt lookup) draft proposer for speculative decoding, in plain Python.

Find the latest earlier occurrence of the last ``n`` tokens (longest ``n`` first, from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed it.
Text that repeats itself (code edits, summaries quoting their source) gets long accepted runs.
"""
from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 4) -> None:
        if num_speculative_tokens < 1 or prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
            raise ValueError("need num_speculative_tokens >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_k: int | None = None) -> list[int]:
        k = self.k if max_k is None else min(self.k, max_k)
        if k <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = token_ids[length - n:]
            first = tail[0]
            # Scan backwards for the latest earlier match; the match must end before the tail.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start] == first and token_ids[start:start + n] == tail:
                    follow = token_ids[start + n:start + n + k]
                    if follow:
                        return follow
        return []
