"""tests/reliability: the chaos test, the group-abort regression and schemathesis. They reuse the
entrypoint tests' helpers (server_utils: a uvicorn server thread on a free port, a FakeRunner
engine), so that folder is importable from here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ENTRYPOINTS = str(Path(__file__).resolve().parent.parent / "entrypoints")
if _ENTRYPOINTS not in sys.path:
    sys.path.insert(0, _ENTRYPOINTS)


@pytest.fixture(scope="session")
def demo_tokenizer():
    from pagedllm.config import default_model
    from pagedllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(default_model())
