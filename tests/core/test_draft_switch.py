"""core/draft_switch.py: drafting goes on while the measured step costs say it pays."""
from __future__ import annotations

import random

import pytest

from pagedllm.core.draft_length import DraftLength
from pagedllm.core.draft_switch import DraftSwitch

# Synthetic machines: seconds = fixed + per_token * n + per_forward * F.
BANDWIDTH_BOUND = (0.20, 0.0005, 0.03)  # a 1.5B decode step on a CPU: weights read once
COMPUTE_BOUND = (0.02, 0.004, 0.005)  # every row costs: rejected drafts are real work


def _feed(switch: DraftSwitch, machine, steps, noise: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)
    fixed, per_token, per_forward = machine
    for n, f in steps:
        switch.observe(n, f, (fixed + per_token * n + per_forward * f) * (1 + noise * rng.uniform(-1, 1)))


def _mixed_steps(batches=(1, 4, 8, 16, 32), k: int = 4):
    """Prefills, plain decodes and drafting decodes at several batch sizes."""
    return [(b * (1 + d), d) for b in batches for d in range(k + 1)] + [(64, 0), (128, 0)]


def test_the_fit_recovers_the_step_costs():
    switch = DraftSwitch()
    _feed(switch, BANDWIDTH_BOUND, _mixed_steps() * 4)
    assert switch.costs() == pytest.approx(BANDWIDTH_BOUND, rel=1e-6)


def test_drafting_stays_on_until_measured():
    switch = DraftSwitch()
    _feed(switch, COMPUTE_BOUND, [(160, 4)] * 3)
    assert switch.costs() is None and switch.pays([(4, 1.2)] * 32)


def test_drafting_stops_at_the_batch_where_rows_cost_more_than_accepted_tokens_give():
    plan = (4, (1 - 0.7 ** 5) / (1 - 0.7))  # 4 drafts at acceptance 0.7: 2.77 tokens a step
    fixed, per_token, per_forward = COMPUTE_BOUND
    exact = DraftSwitch()
    _feed(exact, COMPUTE_BOUND, _mixed_steps() * 4)
    for b in range(1, 33):  # sum(E) / t(b + 4b, 4) >= b / t(b, 0)
        pays = plan[1] * (fixed + per_token * b) >= fixed + per_token * 5 * b + per_forward * 4
        assert exact.pays([plan] * b) == pays, b
    noisy = DraftSwitch()  # steps measured with +-5% noise: the same decision away from the edge
    _feed(noisy, COMPUTE_BOUND, _mixed_steps() * 4, noise=0.05)
    assert noisy.pays([plan]) and not noisy.pays([plan] * 4) and not noisy.pays([plan] * 32)


def test_a_bandwidth_bound_step_pays_for_drafts_at_every_batch_here():
    switch = DraftSwitch()
    _feed(switch, BANDWIDTH_BOUND, _mixed_steps() * 4)
    assert all(switch.pays([(4, 2.77)] * b) for b in (1, 8, 32))
    assert not switch.pays([(4, 1.0)])  # drafts that are never accepted never pay


def test_batch_one_alone_tells_what_a_draft_costs():
    """At batch 1 the tokens scored are 1 + the drafts, so n and F move together: the fit
    cannot split their costs, but the decision needs only their sum."""
    switch = DraftSwitch()
    _feed(switch, BANDWIDTH_BOUND, [(1 + d, d) for d in (0, 1, 4, 2, 3)] * 6)
    fixed, per_token, per_forward = BANDWIDTH_BOUND
    for k, e in ((4, 1.3), (4, 3.0), (1, 1.1), (1, 1.5)):
        expected = e * (fixed + per_token) >= fixed + per_token * (1 + k) + per_forward * k
        assert switch.pays([(k, e)]) == expected


def test_paused_requests_add_no_cost():
    switch = DraftSwitch()
    _feed(switch, COMPUTE_BOUND, _mixed_steps() * 4)
    assert switch.pays([(0, 1.0)] * 32)


def test_the_fit_follows_the_machine_when_steps_change():
    switch = DraftSwitch()
    _feed(switch, BANDWIDTH_BOUND, _mixed_steps() * 4)
    assert switch.pays([(4, 2.77)] * 32)
    _feed(switch, COMPUTE_BOUND, _mixed_steps() * 8)
    assert not switch.pays([(4, 2.77)] * 32)


def test_plans_come_from_the_draft_length():
    lengths = DraftLength(max_num_tokens=4)
    for _ in range(10):
        lengths.observe("good", 4, 4)
        lengths.observe("bad", 4, 0)
    k, e = lengths.plan("good")
    a = lengths.acceptance_rate("good")
    assert k == 4 and e == pytest.approx(sum(a ** j for j in range(5)))
    assert lengths.plan("bad") == (0, 1.0)


def test_paused_requests_probe_only_where_a_draft_at_the_prior_would_pay():
    """A probe is a bet that the draft agrees again (the prior acceptance): at batch 1 the row is
    nearly free and the bet is taken; where rows are compute, the probe's verification rows and
    the draft's catch-up cost more than the bet could win."""
    lengths = DraftLength(max_num_tokens=4)
    bandwidth, compute = DraftSwitch(), DraftSwitch()
    _feed(bandwidth, BANDWIDTH_BOUND, _mixed_steps() * 4)
    _feed(compute, COMPUTE_BOUND, _mixed_steps() * 4)
    assert bandwidth.pays([lengths.probe_plan()]) and bandwidth.pays([lengths.probe_plan()] * 32)
    assert not compute.pays([lengths.probe_plan()] * 32)
    for _ in range(3):
        lengths.observe("r", 4, 0)
    for _ in range(8):
        lengths.new_step()
    assert lengths.num_tokens("r", probe=False) == 0 and lengths.num_tokens("r") == 1  # the clock's probing step
