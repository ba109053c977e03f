#!/usr/bin/env bash
# Makes the separate venv of the llama.cpp peer of the GGUF benchmarks:
#
#     bash benchmarks/setup_llama_cpp.sh           # then: pagedllm bench gguf --llama-cpp
#
# llama-cpp-python is built from source here (PyPI has only its sdist, which vendors llama.cpp),
# for this CPU (GGML_NATIVE: AVX2 or AVX-512 kernels, whichever the machine has), with OpenMP
# threads like a default llama.cpp build. It gets a venv of its own (.venv-llama-cpp at the
# repository root, git-ignored; VENV=DIR to choose another). About 10-15 minutes on 2 cores.
# Safe to rerun. LLAMA_CPP_ISA=v3 builds the AVX2 kernels only (GGML_NATIVE off), the peer of
# pagedllm's AVX2 build (PAGEDLLM_CPU_ISA=v3) on an AVX-512 CPU:
#
#     VENV=.venv-llama-cpp-v3 LLAMA_CPP_ISA=v3 bash benchmarks/setup_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-llama-cpp}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
# On a CPU with AMX (Intel Sapphire Rapids and later), -march=native also compiles llama.cpp's AMX
# backend, whose matmul segfaults on the first llama_decode on our VMs (llama.cpp#20824, open:
# both Q8_0 and Q4_K_M files; AMX itself works here). There the build names the AVX-512 levels
# one by one instead: the same kernels and weight repacking, without the AMX buffer type.
ARCH="-DGGML_NATIVE=ON"
if [ "${LLAMA_CPP_ISA:-native}" = v3 ]; then
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
elif grep -qw amx_int8 /proc/cpuinfo; then
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
fi
CMAKE_ARGS="$ARCH -DGGML_OPENMP=ON -DLLAMA_CURL=OFF" FORCE_CMAKE=1 \
    "$VENV/bin/pip" install --no-cache-dir --verbose --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$VENV/bin/pip" install "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, \
'system info:', llama_cpp.llama_print_system_info().decode())"

# llama.cpp's converter from the same sdist, for benchmarks/gguf.py and the GGUF tests.
VENV="$VENV" LLAMA_CPP_PYTHON_VERSION="$LLAMA_CPP_PYTHON_VERSION" PIP="$VENV/bin/pip" \
    bash benchmarks/setup_gguf_converter.sh
