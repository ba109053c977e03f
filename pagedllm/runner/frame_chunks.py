"""Keep the memory of Python's frame stack instead of mapping and unmapping it on every step.

Since 3.11 CPython keeps a thread's frames in chunks of 16 KiB, mapped when a call does not fit
in the current one and unmapped when that call returns. The model's forward crosses a chunk's
edge at some depth in every layer: each crossing cost an mmap, four page faults and an munmap,
whose TLB shootdown interrupts the CPUs where the kernels' OpenMP threads wait: a large share
of a batch-1 decode step of a GGUF model (docs/cpu_kernels.md#the-frame-stack).

``keep_frame_chunks()`` installs a small arena allocator (frame_chunks.cpp) that keeps a few
freed chunks for reuse, once per process. It is an optimisation: where it cannot be built (no
compiler, not CPython) the engine runs as before, and says so in the log at debug level.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("frame_chunks.cpp")
CFLAGS = ["-O2"]


@functools.cache
def keep_frame_chunks() -> bool:
    """Install the chunk-keeping arena allocator in this process; whether it is installed."""
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        return False  # no chunked frame stack there
    from pagedllm.kernels.cpu_extension import build_library, first_error_line

    try:
        # Named by what it is built from, so a changed source or flag is a new build.
        tag = hashlib.sha1(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:10]
        path = build_library(f"pagedllm_frame_chunks_{tag}", [SOURCE], CFLAGS, [])
        ctypes.PyDLL(path).pagedllm_keep_frame_chunks()
    except Exception as exc:  # a missing compiler costs speed, never the engine
        logger.debug("pagedllm: Python's frame stack is mapped and unmapped as CPython does it "
                     "(cannot build frame_chunks.cpp: %s)", first_error_line(exc))
        return False
    return True
