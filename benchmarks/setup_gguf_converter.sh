#!/usr/bin/env bash
# llama.cpp's own converter (convert_hf_to_gguf.py, with its conversion/ and gguf-py/ folders),
# taken from llama-cpp-python's sdist, which vendors llama.cpp; nothing is compiled. It writes
# the GGUF files that tests and benchmarks read as an independent reference
# (benchmarks/llama_cpp_convert.py), and runs with pagedllm's python (torch, transformers) plus
# sentencepiece, which it imports, installed apart in $VENV/convert-deps.
#
#     bash benchmarks/setup_gguf_converter.sh      # also run by setup_llama_cpp.sh and .ci/run
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-llama-cpp}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PIP="${PIP:-.venv/bin/pip}"

SRC="$(mktemp -d)"
"$PIP" download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
tar -xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
rm -rf "$VENV/llama.cpp" && mkdir -p "$VENV/llama.cpp"
cp -r "$SRC"/llama_cpp_python-*/vendor/llama.cpp/{convert_hf_to_gguf.py,conversion,gguf-py} "$VENV/llama.cpp/"
rm -rf "$SRC"
"$PIP" install -q --target "$VENV/convert-deps" sentencepiece
