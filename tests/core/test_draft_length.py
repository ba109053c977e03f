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


def step(lengths: DraftLength, rid: str) -> int:
    """One engine step of a one-request batch: the clock advances, the request gets its drafts."""
    lengths.new_step()
    return lengths.num_tokens(rid)


def test_a_request_that_rejects_everything_pauses_and_probes_with_one_draft():
    lengths = DraftLength(max_num_tokens=5)
    for _ in range(6):
        k = step(lengths, "r")
        if k:
            lengths.observe("r", k, 0)
    assert lengths.acceptance_rate("r") < 0.25
    ks = [step(lengths, "r") for _ in range(3 * 8)]
    probes = [i for i, k in enumerate(ks) if k]
    assert set(ks) == {0, 1} and len(probes) == 3 and probes[1] - probes[0] == probes[2] - probes[1] == 8
    for _ in range(8 * 8):  # the draft starts to agree: the probes see it, the request drafts more again
        k = step(lengths, "r")
        if k:
            lengths.observe("r", k, k)
    assert lengths.num_tokens("r") == 5


def test_a_paused_request_is_forgotten_when_gone():
    lengths = DraftLength(max_num_tokens=2)
    for _ in range(3):
        lengths.observe("r", 2, 0)
    assert step(lengths, "r") == 0
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


def test_paused_requests_probe_together_whenever_they_paused():
    """One step that runs the draft catches every request up: the paused ones probe on the same
    steps (the shared clock's), so the draft's weights are read once in 8 steps, not every step."""
    lengths = DraftLength(max_num_tokens=4)
    rids = [f"r{i}" for i in range(32)]
    steps = []
    for s in range(4 * 8):
        lengths.new_step()
        if s < 16:  # request i rejects its drafts from step i // 4 on: the pauses start apart
            for i, rid in enumerate(rids):
                if s >= i // 4:
                    lengths.observe(rid, 4, 0)
        steps.append([lengths.num_tokens(rid) for rid in rids])
    assert all(lengths.acceptance_rate(rid) < 0.25 for rid in rids)
    tail = steps[-2 * 8:]  # every request paused: all 32 probe on one step in 8, none between
    assert sorted(sum(ks) for ks in tail) == [0] * 14 + [32, 32]
    probing = [s for s, ks in enumerate(tail) if sum(ks)]
    assert probing[1] - probing[0] == 8


def test_an_own_phase_pause_depends_on_the_request_alone():
    """A seeded request's probes (own_phase=True) fall on the same steps of its own whatever
    the shared clock reads when it pauses: its draws depend on how many drafts it verified."""
    def probes(clock: int) -> list[int]:
        lengths = DraftLength(max_num_tokens=4)
        for _ in range(clock):
            lengths.new_step()
        for _ in range(3):
            lengths.observe("seeded", 4, 0)
        ks = []
        for _ in range(24):
            lengths.new_step()
            ks.append(lengths.num_tokens("seeded", own_phase=True))
        return [s for s, k in enumerate(ks) if k]
    assert probes(0) == probes(3) == probes(5) == [7, 15, 23]
