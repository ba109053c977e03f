"""Settings for the whole suite.

Engines run eagerly unless a test asks for torch.compile (``enforce_eager=False``): an unset
``enforce_eager`` compiles on CPU too, 7-40 s per engine, and most tests build several engines
(some in subprocesses, which inherit the environment). tests/runner/test_compile.py covers the
compiled path. As vLLM's CPU CI does (VLLM_CPU_CI_ENV), the suite trades that coverage for time.
"""
import os

os.environ.setdefault("PAGEDLLM_ENFORCE_EAGER", "1")

# Optional packages that CI installs are imported with tests/ci_support.py's importorskip (a
# failure under CI=true, a skip elsewhere), never with pytest.importorskip.
