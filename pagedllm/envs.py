"""Every environment variable pagedllm reads, one typed accessor each (vLLM's ``envs.py``).

Each accessor reads ``os.environ`` when called, never at import: a test's monkeypatch or a
launcher's environment takes effect at once. A value outside a variable's choices raises
ValidationError naming the variable and the values it accepts. Writes (a child's environment,
inductor's cache folder) stay with their callers.
"""
from __future__ import annotations

import os
from pathlib import Path

from pagedllm.errors import ValidationError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

# The names, spelled once: modules that print or set a variable import its name from here.
PAGEDLLM_MODEL = "PAGEDLLM_MODEL"
PAGEDLLM_ENABLE_MULTIPROCESSING = "PAGEDLLM_ENABLE_MULTIPROCESSING"
PAGEDLLM_ENFORCE_EAGER = "PAGEDLLM_ENFORCE_EAGER"
PAGEDLLM_CPU_KERNELS = "PAGEDLLM_CPU_KERNELS"
PAGEDLLM_CPU_ISA = "PAGEDLLM_CPU_ISA"
PAGEDLLM_BENCH_CACHE = "PAGEDLLM_BENCH_CACHE"

CPU_KERNELS = ("auto", "pagedllm", "torch")
CPU_ISAS = ("native", "v3", "v4")


def _flag(name: str, default: bool) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); unset or empty: ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValidationError(f"{name}={os.environ[name]!r} is not a switch; use one of "
                          f"{', '.join(_ON + _OFF)} (or unset it)", name)


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``; unset or empty: the first."""
    value = os.environ.get(name) or choices[0]
    if value not in choices:
        raise ValidationError(f"{name}={value!r} is unsupported; supported: {', '.join(choices)}", name)
    return value


def model() -> str | None:
    """PAGEDLLM_MODEL: the model folder when none is given; None: the demo model."""
    return os.environ.get(PAGEDLLM_MODEL)


def enable_multiprocessing(default: bool = False) -> bool:
    """PAGEDLLM_ENABLE_MULTIPROCESSING: the engine core in its own process (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING); unset: ``default`` (``pagedllm serve`` passes True)."""
    return _flag(PAGEDLLM_ENABLE_MULTIPROCESSING, default)


def enforce_eager() -> bool:
    """PAGEDLLM_ENFORCE_EAGER: an unset ``enforce_eager`` means eager (the test suite sets it)."""
    return _flag(PAGEDLLM_ENFORCE_EAGER, False)


def cpu_kernels() -> str:
    """PAGEDLLM_CPU_KERNELS: auto (measure at startup), pagedllm or torch (force one side)."""
    return _choice(PAGEDLLM_CPU_KERNELS, CPU_KERNELS)


def cpu_isa() -> str:
    """PAGEDLLM_CPU_ISA: the x86 level of the engine's C++ build: native (this CPU's), v3 or v4."""
    return _choice(PAGEDLLM_CPU_ISA, CPU_ISAS)


def bench_cache() -> Path:
    """PAGEDLLM_BENCH_CACHE: where benchmarks keep the models they build (~/.cache/pagedllm)."""
    return Path(os.environ.get(PAGEDLLM_BENCH_CACHE, Path.home() / ".cache" / "pagedllm"))


def cxx() -> str:
    """CXX: the C++ compiler for the kernels and for inductor on CPU (c++)."""
    return os.environ.get("CXX", "c++")


def torchinductor_cache_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR: inductor's cache folder as the user chose it (None: unset)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster to join; unset or empty: a local one."""
    return os.environ.get("RAY_ADDRESS") or None


def vllm_api_key() -> str | None:
    """VLLM_API_KEY: the server's API key when --api-key is not given (vLLM's name)."""
    return os.environ.get("VLLM_API_KEY") or None


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS as set (None: unset): set, the user chose the threads, not pagedllm."""
    return os.environ.get("OMP_NUM_THREADS")


def pythonpath() -> str | None:
    """PYTHONPATH as set (None: unset), handed on to the processes pagedllm starts."""
    return os.environ.get("PYTHONPATH")


def path() -> str:
    """PATH (empty when unset): where the compiler and ninja are looked up."""
    return os.environ.get("PATH", "")


def hf_hub_offline() -> bool:
    """HF_HUB_OFFLINE: Hub ids are served from the cache without a network call."""
    return _flag("HF_HUB_OFFLINE", False)


def hf_hub_cache() -> str | None:
    """HF_HUB_CACHE, else HF_HOME/hub (None: huggingface_hub's default folder)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None


def hf_endpoint() -> str | None:
    """HF_ENDPOINT: the Hub's address (a mirror); None: huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or None


def hf_token() -> str | None:
    """HF_TOKEN: the token for private and gated repositories."""
    return os.environ.get("HF_TOKEN") or None
