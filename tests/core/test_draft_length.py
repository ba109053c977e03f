"""core/draft_length.py: each request's number of drafts follows its measured acceptance."""
from __future__ import annotations

from pagedllm.core.draft_length import DraftLength


def test_a_request_that_accepts_everything_drafts_the_maximum():
    lengths = DraftLength(max_num_tokens=5)
    assert lengths.num_tokens("a") == 2  # the neutral prior: a = 0.5, 0.5**2 >= 0.25
    for _ in range(6):
        k = lengths.num_tokens("a")
        lengths.observe("a", k, k)
    assert lengths.num_tokens("a") == 5


def test_a_request_that_rejects_everything_pauses_and_probes_with_one_draft():
    lengths = DraftLength(max_num_tokens=5)
    for _ in range(6):
        k = lengths.num_tokens("r")
        if k:
            lengths.observe("r", k, 0)
    assert lengths.acceptance_rate("r") < 0.25
    ks = [lengths.num_tokens("r") for _ in range(3 * 8)]
    probes = [i for i, k in enumerate(ks) if k]
    assert set(ks) == {0, 1} and len(probes) == 3 and probes[1] - probes[0] == probes[2] - probes[1] == 8
    for _ in range(8 * 8):  # the draft starts to agree: the probes see it, the request drafts more again
        k = lengths.num_tokens("r")
        if k:
            lengths.observe("r", k, k)
    assert lengths.num_tokens("r") == 5


def test_a_paused_request_is_forgotten_when_gone():
    lengths = DraftLength(max_num_tokens=2)
    for _ in range(3):
        lengths.observe("r", 2, 0)
    assert lengths.num_tokens("r") == 0
    for i in range(100):
        lengths.observe(f"gone{i}", 2, 1)
    lengths.retain(set())
    assert lengths.num_tokens("r") == 2  # the prior again, not paused


def test_requests_are_measured_apart_and_forgotten_when_gone():
    lengths = DraftLength(max_num_tokens=4)
    lengths.observe("a", 4, 4)
    lengths.observe("b", 4, 0)
    assert lengths.acceptance_rate("a") > 0.5 > lengths.acceptance_rate("b")
    for i in range(100):
        lengths.observe(f"gone{i}", 2, 1)
    lengths.retain({"a": None})
    assert lengths.acceptance_rate("b") == 0.5  # forgotten: the prior again
    assert lengths.acceptance_rate("a") > 0.5


def test_requests_that_pause_together_probe_on_different_steps():
    lengths = DraftLength(max_num_tokens=4)
    rids = [f"r{i}" for i in range(32)]
    for rid in rids:  # every request rejects its drafts and pauses on the same step
        for _ in range(3):
            lengths.observe(rid, 4, 0)
    assert all(lengths.acceptance_rate(rid) < 0.25 for rid in rids)
    steps = [[lengths.num_tokens(rid) for rid in rids] for _ in range(3 * 8)]
    assert [sum(ks) for ks in steps] == [32 // 8] * (3 * 8)  # 4 probes a step, not 32 every 8th
    for i, rid in enumerate(rids):  # each still probes once every 8 steps
        probes = [s for s, ks in enumerate(steps) if ks[i]]
        assert len(probes) == 3 and probes[1] - probes[0] == probes[2] - probes[1] == 8


def test_an_unstaggered_pause_depends_on_the_request_alone():
    """A seeded request's probes (staggered=False) fall on the same steps of its own whatever
    paused before it: its draws depend on how many drafts it verified."""
    def probes(others: int) -> list[int]:
        lengths = DraftLength(max_num_tokens=4)
        for i in range(others):  # requests that paused first take phases
            for _ in range(3):
                lengths.observe(f"o{i}", 4, 0)
            lengths.num_tokens(f"o{i}")
        for _ in range(3):
            lengths.observe("seeded", 4, 0)
        return [s for s in range(24) if lengths.num_tokens("seeded", staggered=False)]
    assert probes(0) == probes(3) == probes(5) == [7, 15, 23]
