"""pagedllm/envs.py: every environment variable through one typed accessor, read at call time."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedllm import envs
from pagedllm.errors import ValidationError

PKG = Path(__file__).resolve().parents[1] / "pagedllm"


def test_defaults_when_unset(monkeypatch):
    for name in ("PAGEDLLM_MODEL", "PAGEDLLM_ENABLE_MULTIPROCESSING", "PAGEDLLM_ENFORCE_EAGER",
                 "PAGEDLLM_CPU_KERNELS", "PAGEDLLM_CPU_ISA", "PAGEDLLM_BENCH_CACHE", "CXX",
                 "TORCHINDUCTOR_CACHE_DIR", "RAY_ADDRESS", "VLLM_API_KEY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert envs.model() is None
    assert envs.enable_multiprocessing() is False and envs.enable_multiprocessing(True) is True
    assert envs.enforce_eager() is False
    assert envs.cpu_kernels() == "auto" and envs.cpu_isa() == "native"
    assert envs.bench_cache() == Path.home() / ".cache" / "pagedllm"
    assert envs.cxx() == "c++"
    assert envs.torchinductor_cache_dir() is None and envs.ray_address() is None
    assert envs.vllm_api_key() is None and envs.omp_num_threads() is None


def test_values_are_parsed_at_call_time(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL", "/models/x")
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "v3")
    monkeypatch.setenv("PAGEDLLM_BENCH_CACHE", "/tmp/bench")
    monkeypatch.setenv("CXX", "clang++")
    monkeypatch.setenv("RAY_ADDRESS", "")  # empty: a local cluster, as unset
    assert (envs.model(), envs.cpu_kernels(), envs.cpu_isa()) == ("/models/x", "torch", "v3")
    assert envs.bench_cache() == Path("/tmp/bench") and envs.cxx() == "clang++"
    assert envs.ray_address() is None
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")
    assert envs.cpu_kernels() == "pagedllm"  # not cached at import or at the first call


@pytest.mark.parametrize("value, want", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                         ("0", False), ("false", False), ("No", False), ("off", False)])
def test_switches(monkeypatch, value, want):
    monkeypatch.setenv("PAGEDLLM_ENFORCE_EAGER", value)
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", value)
    assert envs.enforce_eager() is want
    assert envs.enable_multiprocessing(default=not want) is want


def test_bad_values_name_the_variable_and_its_choices(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "maybe")
    with pytest.raises(ValidationError, match=r"PAGEDLLM_ENABLE_MULTIPROCESSING='maybe' is not a switch; "
                                              r"use one of 1, true, yes, on, 0, false, no, off") as e:
        envs.enable_multiprocessing()
    assert e.value.param == "PAGEDLLM_ENABLE_MULTIPROCESSING"
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "fast")
    with pytest.raises(ValidationError, match="PAGEDLLM_CPU_KERNELS='fast' is unsupported; "
                                              "supported: auto, pagedllm, torch"):
        envs.cpu_kernels()
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='avx3' is unsupported; supported: native, v3, v4"):
        envs.cpu_isa()


def _environ_reads(tree: ast.AST) -> list[int]:
    """Lines reading os.environ: ``.get``, ``[...]`` as a value, ``in`` (writes, pops, copies
    for a child's environment and setdefault are not reads of one variable)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node) in ("os.environ.get", "os.getenv"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ"
              and isinstance(node.ctx, ast.Load)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_envs_reads_the_environment():
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "envs.py" and path.parent == PKG:
            continue
        lines = _environ_reads(ast.parse(path.read_text()))
        if lines:
            bad[str(path.relative_to(PKG))] = lines
    assert not bad, f"read the environment through pagedllm/envs.py: {bad}"


def test_the_read_check_sees_every_kind_of_read():
    tree = ast.parse("import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = 'Z' in os.environ\n"
                     "os.environ['W'] = '1'\nd = dict(os.environ)\ne = os.getenv('V')\n")
    assert _environ_reads(tree) == [2, 3, 4, 7]


def test_the_isa_choices_are_the_kernels_levels():
    from pagedllm.kernels.cpu_extension import ISA_MARCH

    assert set(envs.CPU_ISAS) == {"native", *ISA_MARCH}
