"""Runs llama.cpp's own converter (convert_hf_to_gguf.py, vendored in llama-cpp-python's sdist;
benchmarks/setup_llama_cpp.sh copies it under .venv-llama-cpp/llama.cpp) on a model folder:

    python benchmarks/llama_cpp_convert.py LLAMA_CPP_DIR MODEL_FOLDER OUT.gguf f32|f16|q8_0

One change only: a tokenizer whose pre-tokenizer hash the converter does not know (a test's toy
WordPiece vocabulary) is written as ``default`` instead of refused; llama.cpp's WordPiece
tokenizer does not read that field. Everything else (names, metadata, types) is llama.cpp's.
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# where benchmarks/setup_llama_cpp.sh copies the converter (and sentencepiece, which it imports)
LLAMA_CPP = REPO / ".venv-llama-cpp" / "llama.cpp"


def converter_missing() -> str | None:
    """Why llama.cpp's converter cannot run here; None when it can."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is not at {LLAMA_CPP}: run bash benchmarks/setup_llama_cpp.sh"
    return None


def convert_to_gguf(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """``folder`` written by llama.cpp's converter to ``out`` (in a child process, this python)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(LLAMA_CPP.parent / "convert-deps"), str(REPO)]))
    subprocess.run([sys.executable, str(Path(__file__)), str(LLAMA_CPP), str(folder), str(out), outtype],
                   check=True, env=env, capture_output=True)
    return out


def converter_view(folder: Path, view: Path) -> Path:
    """``folder`` as the converter should read it: links to its files, and a tokenizer config
    that names the pad token. The converter reads a Qwen2 model's vocabulary through
    transformers' Qwen2Tokenizer, which adds its default pad token <|endoftext|> as token 32000
    when the config names none, one past the model's 32000 rows, and the converter refuses that."""
    view.mkdir()
    for f in folder.iterdir():
        (view / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (view / "tokenizer_config.json").unlink()
    (view / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": config["eos_token"]}))
    return view


def main() -> None:
    llama_cpp, folder, out, outtype = sys.argv[1:5]
    script = Path(llama_cpp) / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
    from conversion import base  # noqa: E402 (llama.cpp's package, found through the path above)

    known = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # a toy vocabulary hashes to no model llama.cpp lists
            return "default"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(script), folder, "--outtype", outtype, "--outfile", out]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
