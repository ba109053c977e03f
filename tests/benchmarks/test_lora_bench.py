"""Smoke test of `pagedllm bench lora`: it runs end to end on a tiny base with tiny settings,
prints one result line and writes JSON with sane numbers. Speed is not checked."""
from __future__ import annotations

import json

import pytest

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


@pytest.mark.slow  # llama.cpp converts and quantizes the base
def test_lora_bench_on_a_q4_k_m_base(tmp_path, capsys):
    """``--base-format q4_k_m``: the tiny base written by llama.cpp's converter and quantizer,
    both engines on that file, the same PEFT adapters."""
    from benchmarks.gguf import llama_cpp_missing

    missing = llama_cpp_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "lora.json"
    lora.main(["--shape", "tiny", "--num-requests", "4", "--input-len", "8", "--output-len", "4",
               "--device", "cpu", "--model-dir", str(tmp_path / "models"), "--json", str(out),
               "--engine-arg", "num_gpu_blocks_override=64", "--rounds", "1", "--base-format", "q4_k_m"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora (tiny Q4_K_M, 8 adapters r16)"), lines
    result = json.loads(out.read_text())
    assert result["base_format"] == "q4_k_m" and result["decode_ratio"] > 0 and result["mixed_ratio"] > 0
    assert (tmp_path / "models" / "base-Q4_K_M.gguf").is_file()
    assert not (tmp_path / "models" / "base-F32.gguf").exists()
