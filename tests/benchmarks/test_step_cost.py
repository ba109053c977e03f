"""benchmarks/step_cost.py counts a decode step's work by phase; on the demo model (eager, so no
compile) the runner's preparation of a decode step allocates no tensor: ids, positions and
attention metadata are written into host arrays kept across steps."""
from __future__ import annotations

import pytest

from benchmarks import step_cost


@pytest.fixture(scope="module")
def counts() -> dict:
    if not step_cost.DEFAULT_MODEL.exists():
        pytest.skip("the demo model is not in ../shared/models")
    return step_cost.measure(str(step_cost.DEFAULT_MODEL), "eager", batch=2, steps=4)


def test_every_phase_is_counted(counts):
    phases = counts["phases"]
    assert set(phases) == set(step_cost.PHASES)
    assert phases["forward"]["torch_ops"] > 0 and phases["forward"]["allocs"] > 0
    assert phases["schedule"]["py_calls"] > 0 and phases["output"]["py_calls"] > 0
    assert phases["detokenize"]["py_calls"] > 0  # the demo requests are detokenized each step
    # The per-phase counts are a partition of the step's.
    assert sum(p["torch_ops"] for p in phases.values()) == pytest.approx(counts["torch_ops"])
    assert sum(p["allocs"] for p in phases.values()) == pytest.approx(counts["allocs"])


def test_decode_preparation_allocates_nothing(counts):
    phases = counts["phases"]
    # One no-op operator per field (torch.from_numpy's lift_fresh): slots, positions, query
    # start locations, sequence lengths, block tables.
    assert phases["metadata"]["torch_ops"] <= 5, phases["metadata"]
    for phase in ("runner_prep", "metadata"):
        assert phases[phase]["allocs"] == 0, (phase, phases[phase])
