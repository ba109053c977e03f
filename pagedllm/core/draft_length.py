"""How many draft tokens each request asks its draft model for, from its measured acceptance.

A draft at position j is accepted only if drafts 1..j-1 were, so with a per-token acceptance
rate a it yields a**j tokens on average, while every position costs a draft forward and a row
of verification. A request keeps the positions that still pay: the largest k <= the maximum
with a**k >= ``min_gain``. When not even one position pays, the request pauses: it drafts nothing
and probes with one draft every ``_PROBE_EVERY`` steps, so the estimate keeps being measured
cheaply (a draft every step cost a rejecting pair a quarter of its speed: docs/speculative.md).
The rate is estimated per request from its verifications (accepted drafts against rejections,
older steps decaying), starting from a neutral prior. Plain Python.
"""
from __future__ import annotations

import math
from collections.abc import Collection

_PRIOR_ACCEPTED, _PRIOR_REJECTED = 1.0, 1.0  # a = 0.5 until measured
_DECAY = 0.8  # per verification: recent steps count most
_PROBE_EVERY = 8  # a paused request's steps per probing draft


class DraftLength:
    def __init__(self, max_num_tokens: int, min_gain: float = 0.25) -> None:
        self.max_num_tokens = max_num_tokens
        self.min_gain = min_gain
        self._counts: dict[str, tuple[float, float]] = {}  # request id -> (accepted, rejections)
        self._paused: dict[str, int] = {}  # request id -> steps since its last probe

    def acceptance_rate(self, request_id: str) -> float:
        accepted, rejected = self._counts.get(request_id, (0.0, 0.0))
        return (accepted + _PRIOR_ACCEPTED) / (accepted + rejected + _PRIOR_ACCEPTED + _PRIOR_REJECTED)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of ``num_drafts`` drafts kept the first ``num_accepted``."""
        if num_drafts <= 0:
            return
        accepted, rejected = self._counts.get(request_id, (0.0, 0.0))
        self._counts[request_id] = (accepted * _DECAY + num_accepted,
                                    rejected * _DECAY + (1.0 if num_accepted < num_drafts else 0.0))

    def num_tokens(self, request_id: str) -> int:
        a = self.acceptance_rate(request_id)
        if a >= 1.0:
            return self.max_num_tokens
        k = int(math.log(self.min_gain) / math.log(a)) if a > 0.0 else 0
        if k >= 1:
            self._paused.pop(request_id, None)
            return min(self.max_num_tokens, k)
        waited = self._paused.get(request_id, 0) + 1
        self._paused[request_id] = waited % _PROBE_EVERY  # back to 0 on the probing step
        return int(waited >= _PROBE_EVERY)

    def retain(self, request_ids: Collection[str]) -> None:
        """Forget requests that ended (finished, aborted) once they outnumber the live ones."""
        if len(self._counts) > 2 * len(request_ids) + 64:
            self._counts = {rid: c for rid, c in self._counts.items() if rid in request_ids}
            self._paused = {rid: n for rid, n in self._paused.items() if rid in request_ids}
