"""A user's script with no ``if __name__ == "__main__":`` guard, as vLLM users write them: it
builds ``LLM(model, tensor_parallel_size=2)`` at top level, generates, prints, exits 0. pagedllm's
processes (the ranks, and the engine core in core-process mode) run pagedllm's own entry module,
never the script again; none of them outlives the script."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from dist_helpers import DEMO_MODEL_DIR

SCRIPT = """
import psutil
from pagedllm import LLM, SamplingParams

llm = LLM({model!r}, device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64,
          max_model_len=256)
out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))
print("TEXT", repr(out[0].outputs[0].text), flush=True)
print("CHILDREN", *[p.pid for p in psutil.Process().children(recursive=True)
                    if "resource_tracker" not in " ".join(p.cmdline())], flush=True)
"""


@pytest.mark.slow  # two (or three) fresh interpreters import torch and load the model
@pytest.mark.parametrize("core_process", [False, True], ids=["in-process-core", "core-process"])
def test_an_unguarded_script_runs_at_tp_2(tmp_path, core_process):
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT.format(model=str(DEMO_MODEL_DIR)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PAGEDLLM_ENABLE_MULTIPROCESSING": "1" if core_process else "0"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert len(eval(lines["TEXT"])) > 0, proc.stdout  # noqa: S307 - our own repr()
    children = [int(p) for p in lines["CHILDREN"].split()]
    assert len(children) == (3 if core_process else 2), proc.stdout  # the core, then its two ranks
    alive = [psutil.Process(p) for p in children if psutil.pid_exists(p)]
    _, left = psutil.wait_procs(alive, timeout=30)
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left  # no orphan
