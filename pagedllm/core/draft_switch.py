"""Whether drafting pays at the current batch, from the target's measured step times.

A CPU step costs a fixed part (every weight read once) plus a part per token it scores, and the
draft adds a forward per draft position. At batch 1 the fixed part dominates and a verification
row is nearly free; at a large batch the rows are compute, and every rejected draft costs what
a real token does. The engine reports each step: its seconds, the tokens the target scored (n)
and the draft forwards run (F, the most drafts any request verified). A least-squares fit over
recent steps gives t(n, F) = fixed + per_token * n + per_forward * F, and drafting goes on while
the tokens the requests expect per step pay for the rows and forwards they add:

    sum(E_i) / t(B + sum(k_i), max(k_i))  >=  B / t(B, 0)

for B requests with k_i drafts and E_i expected tokens each (draft_length.py). Until enough
steps are measured drafting stays on. A prefill step's draft work is counted as the target's
per-token cost, which errs towards switching off.
"""
from __future__ import annotations

from collections.abc import Iterable

_DECAY = 0.95  # per step: the fit follows the current batch
_MIN_STEPS = 8.0  # weighted steps before the fit decides
_RIDGE = 1e-9  # keeps the fit defined when the steps do not tell n and F apart


class DraftSwitch:
    def __init__(self) -> None:
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x x^T, x = (1, n, F)
        self._xt = [0.0] * 3  # decayed sums of x * seconds

    def observe(self, num_tokens: int, num_draft_forwards: int, seconds: float) -> None:
        x = (1.0, float(num_tokens), float(num_draft_forwards))
        for i in range(3):
            self._xt[i] = self._xt[i] * _DECAY + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * _DECAY + x[i] * x[j]

    def costs(self) -> tuple[float, float, float] | None:
        """(fixed, per_token, per_forward) seconds, or None until enough steps are measured."""
        if self._xx[0][0] < _MIN_STEPS:
            return None
        a = [[v + (_RIDGE * self._xx[i][i] if i == j else 0.0) for j, v in enumerate(row)]
             for i, row in enumerate(self._xx)]
        fixed, per_token, per_forward = _solve(a, list(self._xt))
        return fixed, max(per_token, 0.0), max(per_forward, 0.0)

    def pays(self, plans: Iterable[tuple[int, float]]) -> bool:
        """Whether requests planning (drafts k, expected tokens E) each should draft this step."""
        plans = list(plans)
        costs = self.costs()
        if costs is None or not plans:
            return True
        fixed, per_token, per_forward = costs
        batch, drafts = len(plans), sum(k for k, _ in plans)
        expected = sum(e for _, e in plans)
        plain = fixed + per_token * batch
        spec = fixed + per_token * (batch + drafts) + per_forward * max(k for k, _ in plans)
        return expected * plain >= batch * spec


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a zero pivot's unknown is taken as 0."""
    n = len(b)
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[p], b[c], b[p] = a[p], a[c], b[p], b[c]
        if a[c][c] == 0.0:
            continue
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            a[r] = [v - f * w for v, w in zip(a[r], a[c])]
            b[r] -= f * b[c]
    x = [0.0] * n
    for c in reversed(range(n)):
        if a[c][c] != 0.0:
            x[c] = (b[c] - sum(a[c][j] * x[j] for j in range(c + 1, n))) / a[c][c]
    return x
