#!/usr/bin/env bash
# Makes the separate venv of the llama.cpp peer of the GGUF benchmarks:
#
#     bash benchmarks/setup_llama_cpp.sh           # then: pagedllm bench gguf --llama-cpp
#
# llama-cpp-python is built from source here (PyPI has only its sdist, which vendors llama.cpp),
# for this CPU (GGML_NATIVE: AVX2 or AVX-512 kernels, whichever the machine has), with OpenMP
# threads like a default llama.cpp build. It gets a venv of its own (.venv-llama-cpp at the
# repository root, git-ignored; VENV=DIR to choose another). About 10-15 minutes on 2 cores.
# Safe to rerun. LLAMA_CPP_ISA=v3 builds the AVX2 kernels only (llama_cpp_arch.sh), the peer of
# pagedllm's AVX2 build (PAGEDLLM_CPU_ISA=v3) on an AVX-512 CPU:
#
#     VENV=.venv-llama-cpp-v3 LLAMA_CPP_ISA=v3 bash benchmarks/setup_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-llama-cpp}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
source benchmarks/llama_cpp_arch.sh
CMAKE_ARGS="$ARCH -DGGML_OPENMP=ON -DLLAMA_CURL=OFF" FORCE_CMAKE=1 \
    "$VENV/bin/pip" install --no-cache-dir --verbose --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$VENV/bin/pip" install "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, \
'system info:', llama_cpp.llama_print_system_info().decode())"

# llama.cpp's converter from the same sdist, for benchmarks/gguf.py and the GGUF tests.
VENV="$VENV" LLAMA_CPP_PYTHON_VERSION="$LLAMA_CPP_PYTHON_VERSION" PIP="$VENV/bin/pip" \
    bash benchmarks/setup_gguf_converter.sh
