"""The scheduler overhead benchmark with tiny settings (--quick), and its --vllm plumbing without vLLM:
a missing venv, a peer that fails, and a stand-in peer that answers the serve protocol."""
from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys
import textwrap

import pytest

from benchmarks import scheduler_overhead as so

ROW = re.compile(r"^(\S+)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d\d)((?:\s+\d+\.\d\d)*)$")
TARGET = re.compile(r"^decode-16: (\d+\.\d\d) us per running request per step "
                    r"\((meets|misses) the 2 us target; ratio \d+\.\d\dx\)$")
QUICK = ["decode-16", "decode-64", "lifecycle-64"]


def _run(capsys, tmp_path, *args: str) -> tuple[list[str], dict]:
    out = tmp_path / "s.json"
    so.main(["--quick", "--steps", "3", "--json", str(out), *args])
    return capsys.readouterr().out.strip().splitlines(), json.loads(out.read_text())


def test_quick_run_prints_medians_and_the_target_line(capsys, tmp_path):
    lines, data = _run(capsys, tmp_path, "--repeat", "2")
    assert lines[0].split()[:1] == ["workload"] and "us/req/step" in lines[0]
    rows = [ROW.match(line) for line in lines[1:4]]
    assert all(rows), lines
    assert [m.group(1) for m in rows] == QUICK
    assert all(len(m.group(5).split()) == 2 for m in rows)  # each repeat's us/req/step
    target = TARGET.match(lines[4])
    assert target and len(lines) == 5, lines

    assert data["repeat"] == 2 and "vllm" not in data
    assert [r["workload"] for r in data["results"]] == QUICK
    assert sorted((r["workload"], r["repeat"]) for r in data["runs"]) == sorted(
        (w, k) for w in QUICK for k in range(2))
    for r in data["results"]:
        runs = [x["us_per_request_per_step"] for x in data["runs"] if x["workload"] == r["workload"]]
        assert r["runs_us_per_request_per_step"] == runs
        assert r["us_per_request_per_step"] == statistics.median(runs) > 0
        assert r["schedule_us_per_step"] > 0 and r["update_us_per_step"] > 0
    assert float(target.group(1)) == pytest.approx(data["results"][0]["us_per_request_per_step"], abs=0.01)
    life = data["results"][2]
    assert life["steps"] > 0 and 0 < life["mean_running"] <= 16


def test_vllm_without_its_venv_says_how_to_make_it(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"bash benchmarks/setup_vllm_cpu\.sh"):
        so.main(["--quick", "--vllm", "--vllm-python", str(tmp_path / "no-venv" / "bin" / "python")])
    assert capsys.readouterr().out == ""  # it fails before running anything


def test_a_failing_vllm_peer_is_reported(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    # pagedllm's own python has no vLLM: the real peer exits, and its message comes through.
    with pytest.raises(SystemExit, match="(?s)peer failed.*vLLM is not importable"):
        so.main(["--quick", "--vllm", "--vllm-python", sys.executable])


def test_vllm_section_from_a_stand_in_peer(tmp_path, capsys):
    fake = tmp_path / "fake_peer.py"
    fake.write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"ready": True, "vllm_version": "0.0-fake"}), flush=True)
        for line in sys.stdin:
            spec = json.loads(line)
            print(json.dumps({"workload": spec["workload"], "schedule_us_per_step": 300.0,
                              "update_us_per_step": 100.0, "us_per_request_per_step": 20.0}),
                  flush=True)
    """))
    python = tmp_path / "python"  # called as PYTHON vllm_scheduler_peer.py --serve ...: ignore those
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {fake}\n")
    python.chmod(0o755)
    lines, data = _run(capsys, tmp_path, "--repeat", "3", "--vllm", "--vllm-python", str(python))
    assert TARGET.match(lines[4]), lines
    assert lines[5].startswith("vLLM 0.0-fake V1 scheduler") and "medians of 3" in lines[5]
    assert "vLLM/pagedllm" in lines[6] and len(lines) == 10, lines
    assert data["vllm"]["version"] == "0.0-fake" and len(data["vllm"]["runs"]) == 9
    for line, r in zip(lines[7:], data["results"]):
        name, s, u, per_req, ratio = line.split()
        assert name == r["workload"] and (s, u, per_req) == ("300.0", "100.0", "20.00")
        paired = [20.0 / x for x in r["runs_us_per_request_per_step"]]
        assert r["vllm_over_pagedllm"] == pytest.approx(statistics.median(paired))
        assert ratio == f"{r['vllm_over_pagedllm']:.2f}x"


def test_the_peer_knows_the_same_workloads():
    """vllm_scheduler_peer.py cannot import pagedllm; its standalone table must match ours."""
    spec = importlib.util.spec_from_file_location("vllm_scheduler_peer", so.VLLM_PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)  # stdlib only at import time; vLLM is imported by Peer()
    for w in so.workload_specs(100):
        assert peer.standard_spec(w["workload"], 100) == w
    assert peer.VOCAB == so.VOCAB and peer.BLOCK_SIZE == so.BLOCK_SIZE
