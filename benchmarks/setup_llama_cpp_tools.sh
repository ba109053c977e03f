#!/usr/bin/env bash
# Builds llama.cpp's own command-line tools, the peer of `pagedllm bench speculative_draft
# --llama-cpp`, from the llama.cpp that llama-cpp-python's sdist vendors (the same sources as
# setup_llama_cpp.sh, so every llama.cpp figure comes from one version):
#
#     bash benchmarks/setup_llama_cpp_tools.sh     # then: pagedllm bench speculative_draft --llama-cpp
#
# Only four binaries, installed in $VENV/bin (.venv-llama-cpp/bin by default, git-ignored):
#   llama-speculative-simple  greedy draft-model speculative decoding with one fixed draft length
#                             per step, what pagedllm's draft_model method does; it prints the
#                             decode speed and n_drafted / n_accept. (llama-speculative adds
#                             several draft sequences and stochastic acceptance, which pagedllm
#                             does not have, and reports no more.)
#   llama-quantize            makes the Q4_0 draft from the target's F32 GGUF.
#   llama-bench               the target alone at batch 1 (-p 0 -n N: decode only).
#   llama-tokenize            the prompt's token ids as llama.cpp reads the text, which pagedllm
#                             is then given (both engines start from the same ids).
# Same kernels and threading as setup_llama_cpp.sh (llama_cpp_arch.sh, OpenMP); nothing is
# downloaded at build time (no curl, no OpenSSL, no web UI). About 15 minutes on 2 cores
# (JOBS=N sets the parallel compile jobs, 2 by default). SDIST=FILE uses an sdist already here
# instead of downloading it. It also copies llama.cpp's converter (setup_gguf_converter.sh), which
# needs pagedllm's venv (make venv). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-llama-cpp}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PIP="${PIP:-.venv/bin/pip}"
JOBS="${JOBS:-2}"
source benchmarks/llama_cpp_arch.sh

# The sources and the build tree stay in $VENV/tools-build, so a rerun compiles only what changed.
WORK="$VENV/tools-build"
mkdir -p "$WORK"
if [ ! -d "$WORK/src-$LLAMA_CPP_PYTHON_VERSION" ]; then
    SDIST="${SDIST:-}"
    if [ -z "$SDIST" ]; then
        "$PIP" download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        SDIST="$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    fi
    rm -rf "$WORK/unpack" && mkdir "$WORK/unpack"
    tar -xzf "$SDIST" -C "$WORK/unpack"
    mv "$WORK"/unpack/llama_cpp_python-*/vendor/llama.cpp "$WORK/src-$LLAMA_CPP_PYTHON_VERSION"
    rm -rf "$WORK/unpack" "$WORK"/*.tar.gz
fi
# shellcheck disable=SC2086 # ARCH is a list of flags
cmake -S "$WORK/src-$LLAMA_CPP_PYTHON_VERSION" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release $ARCH \
    -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
TOOLS="llama-speculative-simple llama-quantize llama-bench llama-tokenize"
# shellcheck disable=SC2086
cmake --build "$WORK/build" -j "$JOBS" --target $TOOLS
mkdir -p "$VENV/bin"
for tool in $TOOLS; do
    install -m 755 "$WORK/build/bin/$tool" "$VENV/bin/$tool"
done
"$VENV/bin/llama-bench" --help >/dev/null
echo "installed in $VENV/bin: $TOOLS"

# llama.cpp's converter from the same sdist, which writes the benchmark's F32 target.
VENV="$VENV" LLAMA_CPP_PYTHON_VERSION="$LLAMA_CPP_PYTHON_VERSION" PIP="$PIP" \
    bash benchmarks/setup_gguf_converter.sh
