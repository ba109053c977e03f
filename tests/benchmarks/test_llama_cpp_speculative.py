"""benchmarks/llama_cpp_speculative.py reads llama.cpp's printed figures, fed by stand-in tools
that print what the vendored llama.cpp prints (examples/speculative-simple, tools/llama-bench); a
missing tool names the setup command. The real tools: `speculative_draft --llama-cpp` by hand."""
from __future__ import annotations

import json

import pytest

from benchmarks import llama_cpp_speculative as peer
from benchmarks import speculative_draft

# The tail of llama-speculative-simple's log, after the generated text (which may hold anything).
SPECULATIVE_LOG = """
the text: decoded 1 tokens in 9 seconds, speed: 1 t/s n_accept = 0

encoded   21 tokens in    0.010 seconds, speed: 2100.000 t/s
decoded   34 tokens in    0.500 seconds, speed:   68.000 t/s

n_draft   = 4
n_predict = 34
n_drafted = 32
n_accept  = 24
accept    = 75.000%
"""


def _tool(folder, name: str, text: str, code: int = 0) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\nexit {code}\n")
    path.chmod(0o755)


def test_speculative_reads_the_last_figures(tmp_path):
    _tool(tmp_path, "llama-speculative-simple", SPECULATIVE_LOG)
    r = peer.speculative(tmp_path / "t.gguf", tmp_path / "d.gguf", "hi", 32, 4, 2, tools_dir=tmp_path)
    assert r["tok_per_s"] == 68.0 and r["num_tokens"] == 34 and r["decode_s"] == 0.5
    assert r["acceptance"] == 0.75
    assert r["tokens_per_step"] == 34 / 10 and r["drafts_per_step"] == 32 / 10  # 10 = 34 - 24 steps


def test_target_alone_reads_llama_bench_json(tmp_path):
    _tool(tmp_path, "llama-bench", json.dumps([{"n_prompt": 0, "n_gen": 32, "n_depth": 20, "avg_ts": 41.5}]))
    assert peer.target_alone(tmp_path / "t.gguf", 32, 20, 2, tools_dir=tmp_path) == 41.5


def test_a_failing_or_silent_tool_says_so(tmp_path):
    _tool(tmp_path, "llama-speculative-simple", "error: failed to load model", code=1)
    with pytest.raises(SystemExit, match="failed to load model"):
        peer.speculative(tmp_path / "t.gguf", tmp_path / "d.gguf", "hi", 32, 4, 2, tools_dir=tmp_path)
    _tool(tmp_path, "llama-speculative-simple", "nothing to report")
    with pytest.raises(SystemExit, match="printed no"):
        peer.speculative(tmp_path / "t.gguf", tmp_path / "d.gguf", "hi", 32, 4, 2, tools_dir=tmp_path)


def test_missing_tools_name_the_setup_command(tmp_path, monkeypatch):
    assert "setup_llama_cpp_tools.sh" in peer.tools_missing(tmp_path)
    monkeypatch.setattr(peer.tools_missing, "__defaults__", (tmp_path,))
    with pytest.raises(SystemExit, match="setup_llama_cpp_tools.sh"):
        speculative_draft.main(["--shape", "tiny", "--llama-cpp", "--model-dir", str(tmp_path)])


def test_prompt_ids_reads_llama_tokenize(tmp_path):
    _tool(tmp_path, "llama-tokenize", "[1, 450, 4996]")
    assert peer.prompt_ids(tmp_path / "t.gguf", "The quick", tools_dir=tmp_path) == [1, 450, 4996]
