"""Issue 57: a draft model behind the server, the engine core in its own process; vLLM's
speculative decoding counters on /metrics."""
from __future__ import annotations

import pytest
from server_utils import HTTP, ServerThread, scrape


@pytest.mark.slow  # the engine core's own process, with two models to load
def test_a_draft_model_behind_the_server():
    from pagedllm.config import default_model
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    demo = default_model()
    spec = {"method": "draft_model", "model": demo, "num_speculative_tokens": 3}
    llm = AsyncLLM.from_engine_args(demo, speculative_config=spec, num_gpu_blocks_override=64,
                                    multiprocess=True)
    srv = ServerThread(build_app(llm, ["demo"])).start()
    try:
        r = HTTP.post(f"{srv.url}/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        m = scrape(srv.url)
    finally:
        srv.stop()
    drafted = m["vllm:spec_decode_num_draft_tokens_total"]
    # The demo model as its own draft: every draft accepted, counted per position too.
    assert drafted > 0 and m["vllm:spec_decode_num_accepted_tokens_total"] == drafted
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == drafted
