"""Settings for the whole suite.

Engines run eagerly unless a test asks for torch.compile (``enforce_eager=False``): an unset
``enforce_eager`` compiles on CPU too, 7-40 s per engine, and most tests build several engines
(some in subprocesses, which inherit the environment). tests/runner/test_compile.py and the
compiled half of tests/models/test_compiled_parity.py (every family, weight format and KV cache
dtype; marked slow) cover the compiled path. As vLLM's CPU CI does (VLLM_CPU_CI_ENV), the suite
trades that coverage for time.
"""
import os

import pytest

os.environ.setdefault("PAGEDLLM_ENFORCE_EAGER", "1")
# Every float32 linear on pagedllm's kernel, without the startup measurement (layers/
# linear_choice.py): the tests hold outputs to bit-exact properties the kernel has on every CPU
# it runs (a token's bits in a decode and in a prefill chunk), which torch's matmul need not
# have, and a measured choice could differ between two engines of one test.
# tests/models/test_linear_choice.py tests the measured choice itself.
os.environ.setdefault("PAGEDLLM_CPU_KERNELS", "pagedllm")

# Packages of the `test` extra are imported plainly (a missing one fails, it never skips);
# system tools CI installs (chromium) go through tests/ci_support.py's skip_unless_ci.


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The suite's models are tiny: intra-op threads only fight each other (and the other test
    processes on a small machine); one thread is several times faster for HF and pagedllm alike."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
