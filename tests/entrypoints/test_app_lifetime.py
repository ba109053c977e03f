"""A stopped app lets its engine go: nothing (FastAPI's per-endpoint caches included) keeps an engine
alive once its app's lifespan has ended, so a process that starts and stops servers does not hold
their weights and KV caches."""
from __future__ import annotations

import gc
import weakref

from fastapi.testclient import TestClient
from server_utils import make_fake_engine

from pagedllm.entrypoints.openai.server import build_app


def test_a_stopped_app_frees_its_engine(demo_tokenizer):
    engine = make_fake_engine(demo_tokenizer)
    with TestClient(build_app(engine, ["demo"])) as client:
        body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
    freed = weakref.ref(engine)
    del engine, client
    gc.collect()
    assert freed() is None
