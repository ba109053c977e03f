"""Builds and loads pagedllm's C++ CPU kernels (csrc/), once per machine, as one extension:

- ``pagedllm::paged_attention`` (csrc/paged_attention.cpp, which stores the step's K/V with
  csrc/store_kv.h before it reads them): the cpu_paged attention backend;
- ``pagedllm::packed_linear`` and ``pagedllm::skinny_gemm`` (csrc/skinny_gemm.cpp): the linears
  of packed layers, in pagedllm's own kernel (layers/linear.py); ``grouped_packed_linear``, the
  same kernel over a mixture-of-experts layer's experts at once (layers/fused_moe.py);
- ``pagedllm::quant_linear`` (csrc/quant_gemm.cpp): the same kernel over weights held as bf16,
  fp16 or block-quantized panels (layers/quantization/); ``grouped_quant_linear``, over a
  mixture-of-experts layer's experts held so;
- ``pagedllm::lora_shrink_expand`` (csrc/lora_sgmv.cpp): the adapters' low-rank update of a
  linear layer for a batch whose rows use different adapters, grouped by adapter (lora/);
- ``pagedllm::fused_experts`` (csrc/fused_moe.cpp): a mixture-of-experts layer's experts in one
  op, from the routing to each token's weighted sum, over either grouped projection.

Their register tiles are sized per x86 level (csrc/isa.h): x86-64-v4 (AVX-512, 32 vector
registers) and x86-64-v3 (AVX2 + FMA, 16). On a CPU of neither level the engine uses torch's
ops (``native_isa()`` is None: the torch attention backend, ``F.linear``).

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
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "skinny_gemm.cpp", CSRC / "quant_gemm.cpp",
           CSRC / "fused_moe.cpp", CSRC / "unified_attention.cpp", CSRC / "lora_sgmv.cpp"]  # + the headers
OPS = ("paged_attention", "skinny_gemm", "packed_linear", "grouped_packed_linear", "quant_linear",
       "grouped_quant_linear", "fused_experts", "unified_attention", "lora_shrink_expand")
# The x86 levels the kernels are tuned for (csrc/isa.h): their -march, and the CPU flags a CPU
# needs to run a build of that level (the Linux /proc/cpuinfo names).
ISA_MARCH = {"v3": "x86-64-v3", "v4": "x86-64-v4"}
ISA_FLAGS = {"v3": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"},
             "v4": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
                    "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
# The engine's build is -march=native: the tiles vectorise to the widest units this CPU has
# (csrc/isa.h picks them from what the compiler enables). The binary is then only valid here,
# so the extension's name carries a hash of the CPU's flags (a cache directory shared between
# different machines gets one build per kind of CPU) and of the sources (torch would not notice
# a change to a header alone). The benchmarks can also build a named level ("v3", "v4") beside
# it, in an op namespace of its own (torch.ops.pagedllm_v3), to measure the AVX2 kernels on an
# AVX-512 CPU. ``PAGEDLLM_CPU_ISA=v3`` (or v4) builds the engine's own kernels for that level in
# place of -march=native, so the whole engine runs the AVX2 kernels on an AVX-512 CPU (the
# benchmarks' peers then get an AVX2 build too: benchmarks/setup_llama_cpp.sh's LLAMA_CPP_ISA).
# -fopenmp: at::parallel_for is a header template; compiled without it, it runs the whole range on
# the calling thread (the kernel then used one core). The extension's libgomp.so.1 is the one
# torch already loaded (same soname), so it shares torch's thread pool.
# --param=avoid-fma-max-bits=0: every contracted multiply-add is an FMA. -march=native tunes for
# the CPU, and GCC's tuning for AMD Zen leaves some loop-carried multiply-adds unfused (a
# latency heuristic that depends on the code around them): the one-row and the tiled paths
# then round differently, and a row's bits would depend on its batch (seen on Zen 3: fp16
# columns 56-63 of every panel, after an unrelated change to the same file).
_COMMON_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "--param=avoid-fma-max-bits=0"]
_LDFLAGS = ["-fopenmp"]


@functools.cache
def _cpuinfo(key: str) -> str:
    """The value of ``key`` in /proc/cpuinfo's first processor ("" where there is none: not
    Linux, or a key this CPU's kernel does not list)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines
                 if line.split(":")[0].strip() == key), "")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo has none: not Linux, or not x86)."""
    return set(_cpuinfo("flags").split())


ENV_CPU_ISA = envs.PAGEDLLM_CPU_ISA


def engine_isa_override() -> str | None:
    """The level ``PAGEDLLM_CPU_ISA`` names for the engine's build, or None (unset or "native")."""
    name = envs.cpu_isa()
    if name == "native":
        return None
    if not ISA_FLAGS[name] <= cpu_flags():
        raise RuntimeError(f"{ENV_CPU_ISA}={name}: this CPU cannot run x86-64-{name} code")
    return name


def native_isa() -> str | None:
    """The tuned level the engine's build runs: "v4" (AVX-512), "v3" (AVX2 + FMA), or None for a
    CPU nobody tuned the kernels for (older x86, Arm): there the engine uses torch's own ops.
    The CPU's own level unless ``PAGEDLLM_CPU_ISA`` names one."""
    flags = cpu_flags()
    return engine_isa_override() or next(
        (isa for isa in ("v4", "v3") if ISA_FLAGS[isa] <= flags), None)


def cpu_description() -> str:
    """The CPU's model name and the tuned level it runs ("AMD EPYC (x86-64-v3: AVX2)"), for
    log lines and benchmark output: every figure names the CPU it came from."""
    name = _cpuinfo("model name")
    isa = native_isa()
    level = {"v4": "x86-64-v4: AVX-512", "v3": "x86-64-v3: AVX2"}.get(isa or "", "no tuned level")
    if engine_isa_override():
        level += f", {ENV_CPU_ISA}={isa}"
    return f"{name or platform.machine() or 'unknown CPU'} ({level})"


def can_run(isa: str) -> bool:
    """Whether this CPU can run a build of ``isa`` ("native", "v3" or "v4")."""
    return isa == "native" or ISA_FLAGS[isa] <= cpu_flags()


# A CPU whose native build runs bf16 activations (csrc/bf16_gemm.h): AVX512-BF16, enabled by
# -march=native there; with AMX-BF16 too the products run on AMX tiles, else as vdpbf16ps dot
# products (AMD Zen 4, Intel Cooper Lake). The x86-64-v3 and -v4 builds have neither.
BF16_ACTIVATION_FLAGS = {"avx512_bf16"}


def has_bf16_activations(isa: str = "native") -> bool:
    """Whether a build of ``isa`` runs bf16 activations: the native build on a CPU with
    BF16_ACTIVATION_FLAGS."""
    return (isa == "native" and engine_isa_override() is None
            and BF16_ACTIVATION_FLAGS <= cpu_flags())


def op_namespace(isa: str) -> str:
    return "pagedllm" if isa == "native" else f"pagedllm_{isa}"


def _cflags(isa: str) -> list[str]:
    if isa == "native":
        level = engine_isa_override()
        march = ISA_MARCH[level] if level else "native"
    else:
        march = ISA_MARCH[isa]
    return [*_COMMON_CFLAGS, f"-march={march}", f"-DPAGEDLLM_NS={op_namespace(isa)}"]


def build_tag(isa: str = "native") -> str:
    """A hash of the sources, flags (and for "native" this CPU's features) of a build: its name."""
    digest = hashlib.sha1(" ".join(sorted(cpu_flags())).encode() if isa == "native" else b"")
    digest.update(" ".join(_cflags(isa) + _LDFLAGS).encode())
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
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + envs.path()


def build_library(name: str, sources: list[Path], cflags: list[str], ldflags: list[str]) -> str:
    """Compile ``sources`` into the shared library ``name`` in torch's extension cache (once per
    machine: a later process finds it built) and load it; its path. Raises RuntimeError when
    there is no compiler, or the compiler's error."""
    from torch.utils import cpp_extension

    compiler = envs.cxx()
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    _ensure_ninja_on_path()
    # ninja's build file names the sources by path: two checkouts sharing one build folder
    # would rebuild it for each other on every load, so each checkout builds its own.
    where = hashlib.sha1(" ".join(str(p.resolve().parent) for p in sources).encode()).hexdigest()[:6]
    name = f"{name}_{where}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    # An flock, released by the OS even if the process dies: parallel pytest workers build once,
    # one after the other. torch's own lock file is a plain file a killed build leaves behind
    # (every later build would wait on it forever); under our lock nobody else is building, so
    # a leftover one is stale.
    with open(build_dir / "pagedllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(name, sources=[str(p) for p in sources], extra_cflags=cflags,
                                  extra_ldflags=ldflags, build_directory=str(build_dir),
                                  is_python_module=False, verbose=False)


def _build(isa: str) -> Any:
    namespace = op_namespace(isa)
    ops = getattr(torch.ops, namespace)
    if all(hasattr(ops, op) for op in OPS):
        # Built and loaded already in this process: torch aborts the process if a library
        # defines the same ops a second time (a relinked .so is a new library).
        return ops
    if not can_run(isa):
        raise RuntimeError(f"this CPU cannot run x86-64-{isa} code")

    build_library(f"pagedllm_cpu_{isa}_{build_tag(isa)}", SOURCES, _cflags(isa), _LDFLAGS)
    # The outputs' shapes for dynamo and inductor, so the kernels can sit in a compiled graph as
    # opaque nodes (the model's graph reaches paged_attention through pagedllm::attention,
    # attention/layer.py).
    torch.library.register_fake(f"{namespace}::paged_attention")(_paged_attention_fake)
    torch.library.register_fake(f"{namespace}::packed_linear")(_packed_linear_fake)
    torch.library.register_fake(f"{namespace}::quant_linear")(_quant_linear_fake)
    torch.library.register_fake(f"{namespace}::grouped_quant_linear")(_grouped_quant_linear_fake)
    torch.library.register_fake(f"{namespace}::fused_experts")(_fused_experts_fake)
    torch.library.register_fake(f"{namespace}::unified_attention")(_unified_attention_fake)
    torch.library.register_fake(f"{namespace}::lora_shrink_expand")(_lora_shrink_expand_fake)
    return ops


def _paged_attention_fake(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float, sliding_window: int = 0, logits_soft_cap: float = 0.0,
                          sinks: torch.Tensor | None = None, key: torch.Tensor | None = None,
                          value: torch.Tensor | None = None,
                          slot_mapping: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, H, D]


def _unified_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_id: int,
                            scale: float, sliding_window: int, logits_soft_cap: float,
                            sinks: torch.Tensor | None) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[1] * query.shape[2]))  # [T, H * D]


def _packed_linear_fake(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _quant_linear_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
                       offsets: torch.Tensor | None, group_size: int, out_features: int,
                       bias: torch.Tensor | None, narrow_activations: bool = False) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _grouped_quant_linear_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
                               offsets: torch.Tensor | None, group_size: int, counts: list[int],
                               out_features: int, narrow_activations: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))  # x [R, K]: every expert's rows


def _lora_shrink_expand_fake(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                             token_slots: torch.Tensor, offsets: list[int], sizes: list[int]) -> None:
    return None  # adds into y in place


def _fused_experts_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        *weights_and_settings: object) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]


def compile_sources(isa: str, output_dir: Path, sources: list[Path] | None = None) -> None:
    """Compile ``sources`` (default: every source) for ``isa`` into objects under ``output_dir`` without linking or
    loading them: proves a level this CPU cannot run (an AVX-512 build on an AVX2 machine)
    still builds. Raises RuntimeError with the compiler's first error."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    compiler = envs.cxx()
    includes = [arg for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
                for arg in ("-isystem", path)]
    for source in SOURCES if sources is None else sources:
        cmd = [compiler, "-std=c++20", "-fPIC", *includes, *_cflags(isa), "-c", str(source),
               "-o", str(output_dir / f"{source.stem}.o")]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{source.name} for {isa}: " + first_error_line(
                RuntimeError(result.stderr)))


@functools.cache
def load_cpu_ops(isa: str = "native") -> Any | None:
    """torch.ops.pagedllm with the kernels above (``isa`` "native": the engine's build), or the
    namespace of a build for one x86 level ("v3", "v4"); None (logged once) when they cannot be
    built or run here."""
    try:
        return _build(isa)
    except Exception as exc:  # any build failure means "use torch's own ops", never a crash
        logger.warning("pagedllm: cannot build the C++ CPU kernels of the cpu_paged attention backend "
                       "and the linears (%s); using the torch attention backend and F.linear "
                       "instead", first_error_line(exc))
        return None


def load_paged_attention_op() -> Callable[..., torch.Tensor] | None:
    ops = load_cpu_ops()
    return None if ops is None else ops.paged_attention


def first_error_line(exc: Exception) -> str:
    """A compiler's log is long; its first diagnostic (``...: error: ...``) says what went
    wrong, else the last line does."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
    return next((line for line in lines if "error:" in line.lower()), lines[-1])[:300]
