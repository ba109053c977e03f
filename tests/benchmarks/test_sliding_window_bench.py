"""Smoke test of benchmarks/sliding_window.py on tiny models: window 16, one 128-token request
(8x the window) in 32-token chunks, 4-token blocks. The memory figure's numbers are exact block
counts (no timings), so they are checked: the window models hold less KV than their
full-attention peers, each window layer stays within window + chunk + one block (13 blocks),
the full layers hold the whole request, and the pool holds nothing outside the tables."""
from __future__ import annotations

import json

import pytest

from benchmarks import sliding_window

TINY = ["--shape", "tiny", "--window", "16", "--prompt-len", "128", "--decode-tokens", "4",
        "--max-num-batched-tokens", "32", "--block-size", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sw_models"))


def test_memory_figure(model_dir, tmp_path, capsys):
    out = tmp_path / "sw.json"
    sliding_window.main([*TINY, "--skip", "timing", "--model-dir", model_dir, "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "sliding_window memory mistral", "sliding_window memory gemma2"], lines
    assert all(line.endswith("PASS") for line in lines), lines
    m = json.loads(out.read_text())["memory"]
    num_tokens = 128 + 4 - 1  # the last sampled token has no K/V, but its block was allocated
    full_blocks = -(-(num_tokens + 1) // 4)  # 33: every position of the request
    for name in sliding_window.MODELS:
        r = m[name]
        assert r["peak_pool_blocks_used"] == r["peak_blocks"], r  # nothing outside the tables
        assert r["num_blocks"] >= 2 * full_blocks  # the pool never forced the bound
        for g in r["groups"]:
            if g["sliding_window"] is None:
                assert g["peak_blocks"] == full_blocks, (name, g)
            else:
                assert g["sliding_window"] == 16 and g["bound_blocks"] == -(-(16 + 32) // 4) + 1
                assert g["within_bound"] and g["peak_blocks"] <= 13, (name, g)
                # It does free: far less than the request's 33 blocks.
                assert g["peak_blocks"] < full_blocks // 2, (name, g)
    # Mistral: one window group of all 4 layers; Gemma 2: a full and a window group of 2 each.
    assert [(g["sliding_window"], g["num_layers"]) for g in m["mistral"]["groups"]] == [(16, 4)]
    assert [(g["sliding_window"], g["num_layers"]) for g in m["gemma2"]["groups"]] == [
        (None, 2), (16, 2)]
    assert [g["sliding_window"] for g in m["mistral-full"]["groups"]] == [None]
    assert [g["sliding_window"] for g in m["gemma2-full"]["groups"]] == [None]
    for name, peer in sliding_window.PEERS.items():
        assert m[name]["kv_bytes"] < m[peer]["kv_bytes"], name
        assert m[name]["bytes_per_layer_block"] == m[peer]["bytes_per_layer_block"] == 2 * 4 * 2 * 16 * 4
    assert m["mistral-full"]["kv_bytes"] == full_blocks * 4 * 2 * 4 * 2 * 16 * 4  # blocks x layers


def test_decode_timing_table_runs(model_dir, capsys, tmp_path):
    """The timing part end to end at tiny sizes (the times themselves are not checked)."""
    out = tmp_path / "t.json"
    sliding_window.main([*TINY, "--skip", "memory", "--contexts", "32", "64", "--timed-steps", "2",
                         "--enforce-eager", "--model-dir", model_dir, "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("sliding_window decode step") and len(lines) == 3, lines
    ms = json.loads(out.read_text())["decode_ms"]
    assert set(ms) == {"mistral w16", "mistral full"}
    assert all(set(row) == {"32", "64"} and all(t > 0 for t in row.values()) for row in ms.values())
