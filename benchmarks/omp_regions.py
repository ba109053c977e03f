"""Counting OpenMP parallel regions: a shim preloaded into the process that counts every
``GOMP_parallel`` call (what GCC emits for ``#pragma omp parallel``, in inductor's generated
loops, our kernels and torch's own parallel_for) and hands each to libgomp.

    with_counter(argv)   re-runs ``python argv...`` with the shim preloaded (built once, with cc)
    regions()            the count so far in this process, or None without the shim
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import shared_c_library

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
static atomic_long count;
long pagedllm_omp_regions(void) { return atomic_load(&count); }
void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
  static void (*real)(void (*)(void *), void *, unsigned, unsigned);
  if (!real) real = dlsym(RTLD_NEXT, "GOMP_parallel");
  atomic_fetch_add(&count, 1);
  real(fn, data, num_threads, flags);
}
"""
_ENV = "PAGEDLLM_OMP_COUNTER"


def _shim() -> Path:
    return shared_c_library("omp_regions", _SOURCE, "-ldl")


def with_counter(argv: list[str]) -> int:
    """Run ``python argv`` with the shim preloaded; its exit status."""
    env = dict(os.environ, LD_PRELOAD=str(_shim()), **{_ENV: "1"})
    return subprocess.run([sys.executable, *argv], env=env).returncode


def active() -> bool:
    return os.environ.get(_ENV) == "1"


def regions() -> int | None:
    try:
        return int(ctypes.CDLL(None).pagedllm_omp_regions())
    except AttributeError:
        return None
