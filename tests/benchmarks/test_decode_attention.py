"""Smoke test of the decode-attention microbenchmark (benchmarks/decode_attention.py)."""
from __future__ import annotations

from benchmarks import decode_attention


def test_decode_attention_prints_every_candidate_against_bandwidth(capsys):
    decode_attention.main(["--requests", "3", "--context", "40", "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "16", "--block-size", "4", "--rounds", "1", "--iters", "1",
                           "--copy-mib", "8"])
    out = capsys.readouterr().out
    assert "memory bandwidth" in out
    for name in ("cpu_paged", "torch", "dense"):
        assert f"{name}:" in out and "of bandwidth" in out
