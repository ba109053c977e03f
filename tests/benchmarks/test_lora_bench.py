"""Smoke test of `pagedllm bench lora`: it runs end to end on a tiny base with tiny settings,
prints one result line and writes JSON with sane numbers. Speed is not checked."""
from __future__ import annotations

import json

from benchmarks import lora


def test_lora_bench(tmp_path, capsys):
    out = tmp_path / "lora.json"
    lora.main(["--shape", "tiny", "--num-requests", "4", "--input-len", "8", "--output-len", "4",
               "--device", "cpu", "--model-dir", str(tmp_path / "models"), "--json", str(out),
               "--engine-arg", "num_gpu_blocks_override=64", "--rounds", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora (tiny, 8 adapters r16)"), lines
    result = json.loads(out.read_text())
    for run in (result["base"], result["lora"]):
        assert run["batch_tok_per_s"] > 0 and run["decode_tok_per_s"] > 0
    assert result["mixed_ratio"] > 0 and result["decode_ratio"] > 0
    assert [len(result["rounds"][name]) for name in ("base", "lora")] == [2, 2]
    assert len(list((tmp_path / "models").glob("adapter*/adapter_model.safetensors"))) == 8
