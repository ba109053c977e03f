"""Whether drafting pays at the current batch, from the measured step times.

A CPU step costs a fixed part (every weight read once) plus a part per token it scores, and the
draft adds a forward per draft position. At batch 1 the fixed part dominates and a verification
row is nearly free; at a large batch the rows are compute, and every rejected draft costs what
a real token does. For each decode step (a prefill's rows are another regime) the runner reports
its seconds and, apart, the seconds its draft model ran; the engine adds the tokens the target
scored (n) and the draft forwards (F, the most drafts any request verified). Two decayed
least-squares fits over recent steps give the target's t(n) = fixed + per_token * n and the
draft's per_forward * F, and drafting goes on while the tokens the requests expect per step pay
for the rows and forwards they add:

    sum(E_i) / (t(B + sum(k_i)) + per_forward * max(k_i))  >=  B / t(B)

for B requests with k_i drafts and E_i expected tokens each (draft_length.py). A batch whose
requests all draft never shows the plain step t(B) the rule compares with, and the drafting
steps' n vary too little to extrapolate it, so when no plain step is among the recent ones the
switch runs one (every ~24 steps while drafting pays: ~2% of its gain). Until enough steps (one
of them drafting) are measured drafting stays on.
"""
from __future__ import annotations

from collections.abc import Iterable

_DECAY = 0.95  # per step: the fits follow the current batch
_MIN_STEPS = 4.0  # weighted steps before the fit decides (a 2-term fit; the draft's from one step)
_RIDGE = 1e-9  # keeps the fit defined when the steps' token counts do not vary
_MIN_PLAIN = 0.3  # decayed weight of plain steps below which the next step runs plain, to measure


class DraftSwitch:
    def __init__(self) -> None:
        self._xx = [0.0, 0.0, 0.0]  # decayed sums of 1, n, n^2 over steps: the target's fit
        self._xt = [0.0, 0.0]  # decayed sums of t, n * t (t: the step's seconds less the draft's)
        self._ff = self._fd = 0.0  # decayed sums of F^2 and F * draft seconds, drafting steps
        self._plain = 0.0  # decayed count of steps without drafts

    def observe(self, num_tokens: int, num_draft_forwards: int, seconds: float, draft_seconds: float) -> None:
        n, t = float(num_tokens), seconds - draft_seconds
        for i, v in enumerate((1.0, n, n * n)):
            self._xx[i] = self._xx[i] * _DECAY + v
        self._xt = [self._xt[0] * _DECAY + t, self._xt[1] * _DECAY + n * t]
        self._plain = self._plain * _DECAY + (num_draft_forwards == 0)
        if num_draft_forwards:
            f = float(num_draft_forwards)
            self._ff, self._fd = self._ff * _DECAY + f * f, self._fd * _DECAY + f * draft_seconds

    def costs(self) -> tuple[float, float, float] | None:
        """(fixed, per_token, per_forward) seconds, or None until enough steps are measured."""
        s0, s1, s2 = self._xx
        if s0 < _MIN_STEPS or self._ff == 0.0:
            return None
        s0, s2 = s0 * (1 + _RIDGE), s2 * (1 + _RIDGE)
        det = s0 * s2 - s1 * s1
        fixed = (s2 * self._xt[0] - s1 * self._xt[1]) / det
        per_token = (s0 * self._xt[1] - s1 * self._xt[0]) / det
        return fixed, max(per_token, 0.0), self._fd / self._ff

    def pays(self, plans: Iterable[tuple[int, float]]) -> bool:
        """Whether requests planning (drafts k, expected tokens E) each should draft this step."""
        plans = list(plans)
        costs = self.costs()
        if costs is None or not plans:
            return True
        if self._plain < _MIN_PLAIN:
            return False  # one plain step, measured, keeps t(B) an interpolation
        fixed, per_token, per_forward = costs
        batch, drafts = len(plans), sum(k for k, _ in plans)
        expected = sum(e for _, e in plans)
        plain = fixed + per_token * batch
        spec = fixed + per_token * (batch + drafts) + per_forward * max(k for k, _ in plans)
        return expected * plain >= batch * spec
