"""benchmarks/step_instructions.py: callgrind's dumps summed per phase, and the counted loop itself
(outside valgrind its client requests do nothing, so it runs at full speed here)."""
from __future__ import annotations

import argparse
import shutil

import pytest

from benchmarks import step_cost, step_instructions


def _dump(path, label: str, total: int) -> None:
    path.write_text(f"version: 1\ncreator: callgrind-3.19.0\ncmd: python\ndesc: I1 cache: \n"
                    f"desc: Trigger: Client Request: {label}\n\npositions: line\nevents: Ir\n"
                    f"summary: {total}\n\n\nfn=(1) f\n0 {total}\n\ntotals: {total}\n")


def test_dumps_are_summed_per_phase_and_step(tmp_path):
    _dump(tmp_path / "callgrind.step.7.1-01", "forward", 3000)
    _dump(tmp_path / "callgrind.step.7.2-01", "forward", 1000)
    _dump(tmp_path / "callgrind.step.7.2-02", "forward", 5000)  # a worker thread's: not counted
    _dump(tmp_path / "callgrind.step.7.3-01", "schedule", 400)
    _dump(tmp_path / "callgrind.step.7.4-01", "Program", 999)   # not a phase: the final dump
    _dump(tmp_path / "other.7.1-01", "forward", 10 ** 6)         # another prefix
    r = step_instructions.summarize(tmp_path, "callgrind.step", steps=2)
    assert r["phases"]["forward"] == 2000 and r["phases"]["schedule"] == 200
    assert r["phases"]["sample"] == 0
    assert r["instructions"] == 2200 and set(r["phases"]) == set(step_cost.PHASES)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the client requests")
def test_the_counted_loop_runs_outside_valgrind():
    if not step_cost.DEFAULT_MODEL.exists():
        pytest.skip("the demo model is not in ../shared")
    args = argparse.Namespace(model=str(step_cost.DEFAULT_MODEL), eager=True, batch=2, steps=3)
    step_instructions._child(args)  # the dumps are no-ops without valgrind; the steps are real
