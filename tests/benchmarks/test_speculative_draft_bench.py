"""Smoke test of benchmarks/speculative_draft.py on the tiny shape: one result line, the four
pairs, greedy output equal to the target's, the pairs' acceptance as built. Speed is not checked."""
from __future__ import annotations

import json

import pytest

from benchmarks import speculative_draft


@pytest.mark.slow
def test_speculative_draft_bench_runs_the_four_pairs(tmp_path, capsys):
    out = tmp_path / "r.json"
    speculative_draft.main(["--shape", "tiny", "--batch-sizes", "1", "--num-tokens", "12",
                            "--model-dir", str(tmp_path), "--json", str(out),
                            "--engine-arg", "num_gpu_blocks_override=64", "--engine-arg", "enforce_eager=True"])
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("speculative_draft tiny: b1 q4_0")
    results = {r["draft"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"q4_0", "small", "self", "eagle3"}
    assert all(r["greedy_agree"] == 1 for r in results.values())
    assert results["self"]["acceptance"] == 1.0
    assert results["small"]["acceptance"] < 0.5 and results["eagle3"]["acceptance"] < 0.5
    assert all(r["ideal"] > 0 and r["cost_ratio"] > 0 for r in results.values())
