"""Fixtures of the tensor-parallel tests: tiny random models saved once per session, and one torch
thread per process (two ranks on a small machine; the tiny matmuls gain nothing from more)."""
from __future__ import annotations

import pytest
from dist_helpers import build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp_models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ("llama", "qwen3")}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    """Spawned workers (and Ray actors) read OMP_NUM_THREADS when torch starts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
