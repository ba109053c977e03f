"""Builds and loads pagedllm's C++ CPU kernels (csrc/), once per machine, as one extension:

- ``pagedllm::paged_attention`` and ``pagedllm::write_kv`` (csrc/paged_attention.cpp,
  csrc/write_kv.cpp): the cpu_paged attention backend, and its store of each step's K/V;
- ``pagedllm::packed_linear`` and ``pagedllm::skinny_gemm`` (csrc/skinny_gemm.cpp): the linears
  of prepacked layers, in pagedllm's own kernel (layers/linear.py).

torch.utils.cpp_extension compiles them into torch's extension cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) on first use, which takes ~40 s, and reloads the shared
library in later processes. ``load_cpu_ops()`` returns torch's ``pagedllm`` op namespace with
them, or None after logging one warning when the build is impossible or fails: the callers then
use torch's own ops (the torch attention backend, ``F.linear``).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "skinny_gemm.cpp", CSRC / "write_kv.cpp"]  # + paged_attention_math.h
OPS = ("paged_attention", "skinny_gemm", "packed_linear", "write_kv")
# -march=native: the dot products and GEMM tiles vectorise to the widest units this CPU has. The
# binary is then only valid here, so the extension's name carries a hash of the CPU's flags (a cache directory
# shared between different machines gets one build per kind of CPU) and of the sources (torch
# would not notice a change to the header alone).
# -fopenmp: at::parallel_for is a header template; compiled without it, it runs the whole range on
# the calling thread (the kernel then used one core). The extension's libgomp.so.1 is the one
# torch already loaded (same soname), so it shares torch's thread pool.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_LDFLAGS = ["-fopenmp"]


def _build_tag() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha1(flags.encode())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package (a dependency) installs it into
    the venv's bin folder, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build() -> Any:
    from torch.utils import cpp_extension

    if all(hasattr(torch.ops.pagedllm, op) for op in OPS):
        # Built and loaded already in this process: torch aborts the process if a library
        # defines the same ops a second time (a relinked .so is a new library).
        return torch.ops.pagedllm

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    _ensure_ninja_on_path()
    name = f"pagedllm_cpu_{_build_tag()}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    # An flock, released by the OS even if the process dies: parallel pytest workers build once,
    # one after the other. torch's own lock file is a plain file a killed build leaves behind
    # (every later build would wait on it forever); under our lock nobody else is building, so
    # a leftover one is stale.
    with open(build_dir / "pagedllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        cpp_extension.load(name, sources=[str(p) for p in SOURCES], extra_cflags=_CFLAGS,
                           extra_ldflags=_LDFLAGS, build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    # The outputs' shapes for dynamo and inductor, so the kernels can sit in a compiled graph as
    # opaque nodes (the model's graph reaches paged_attention through pagedllm::attention,
    # attention/layer.py).
    torch.library.register_fake("pagedllm::paged_attention")(_paged_attention_fake)
    torch.library.register_fake("pagedllm::packed_linear")(_packed_linear_fake)
    return torch.ops.pagedllm


def _paged_attention_fake(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, H, D]


def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@functools.cache
def load_cpu_ops() -> Any | None:
    """torch.ops.pagedllm with the kernels above, or None (logged once) when they cannot be built."""
    try:
        return _build()
    except Exception as exc:  # any build failure means "use torch's own ops", never a crash
        logger.warning("pagedllm: cannot build the C++ CPU kernels of the cpu_paged attention backend "
                       "and the linears (%s); using the torch attention backend and F.linear "
                       "instead", _first_error_line(exc))
        return None


def load_paged_attention_op() -> Callable[..., torch.Tensor] | None:
    ops = load_cpu_ops()
    return None if ops is None else ops.paged_attention


def _first_error_line(exc: Exception) -> str:
    """A compiler's log is long; its first diagnostic (``...: error: ...``) says what went
    wrong, else the last line does."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
    return next((line for line in lines if "error:" in line.lower()), lines[-1])[:300]
