"""How many draft tokens each request asks its draft model for, from its measured acceptance.

A draft at position j is accepted only if drafts 1..j-1 were, so with a per-token acceptance
rate a (estimated per request, recent verifications weighing most) it yields a**j tokens, while
each position costs a draft forward and a verification row: a request drafts the largest k <=
the maximum with a**k >= ``min_gain``. When none pays it pauses, probing with one draft every
``_PROBE_EVERY`` steps, all on a shared clock's steps: a step that runs the draft reads all its
weights and catches every request up, so probing in turns would pay that on every step.
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
        self._paused: dict[str, int] = {}  # request id -> steps since its last probe (own phase)
        self._step = 0  # the shared probing clock

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

    def plan(self, request_id: str) -> tuple[int, float]:
        """The drafts that pay for the request (0: paused), and the tokens a step yields with them."""
        a = self.acceptance_rate(request_id)
        if a >= 1.0:
            return self.max_num_tokens, self.max_num_tokens + 1.0
        k = min(self.max_num_tokens, int(math.log(self.min_gain) / math.log(a))) if a > 0.0 else 0
        return k, (1.0 - a ** (k + 1)) / (1.0 - a)

    def probe_plan(self) -> tuple[int, float]:
        """A probe's plan at the prior acceptance: what drafting again could find."""
        a = _PRIOR_ACCEPTED / (_PRIOR_ACCEPTED + _PRIOR_REJECTED)
        return 1, 1.0 + a

    def new_step(self) -> None:
        """Advance the shared probing clock: once a step, before the step's ``num_tokens``."""
        self._step += 1

    def num_tokens(self, request_id: str, own_phase: bool = False, planned: int | None = None,
                   probe: bool = True) -> int:
        """This step's drafts (``planned``: the plan's k, if known). ``own_phase``: a paused request
        probes on its own steps, not the clock's (a seeded draw follows its verifications alone);
        ``probe``: False, the others do not probe this step (core/draft_switch.py)."""
        k = self.plan(request_id)[0] if planned is None else planned
        if k >= 1:
            self._paused.pop(request_id, None)
            return k
        if not own_phase:
            return int(probe and self._step % _PROBE_EVERY == 0)
        waited = self._paused.get(request_id, 0) + 1
        self._paused[request_id] = waited % _PROBE_EVERY  # back to 0 on the probing step
        return int(waited >= _PROBE_EVERY)

    def retain(self, request_ids: Collection[str]) -> None:
        """Forget requests that ended (finished, aborted) once they outnumber the live ones."""
        if len(self._counts) > 2 * len(request_ids) + 64:
            self._counts = {rid: c for rid, c in self._counts.items() if rid in request_ids}
            self._paused = {rid: n for rid, n in self._paused.items() if rid in request_ids}
