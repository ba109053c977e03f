"""Issue 57: an EAGLE-3 head and MTP layers behind the server (speculative_config as `pagedllm
serve --speculative-config` passes it); vLLM's speculative decoding counters on /metrics."""
from __future__ import annotations

import pytest
from server_utils import HTTP, ServerThread, scrape

from tests.engine.spec_decode_models import tiny_eagle3, tiny_llama, tiny_mimo


@pytest.mark.parametrize("method", ["eagle3", pytest.param("mtp", marks=pytest.mark.slow)])
def test_a_head_behind_the_server(tmp_path, method):
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    if method == "eagle3":
        target = tiny_llama(tmp_path / "t", 64, seed=0, layers=4)
        spec = {"method": "eagle3", "model": tiny_eagle3(tmp_path / "e", 64, 32, seed=1), "num_speculative_tokens": 2}
    else:
        target, spec = tiny_mimo(tmp_path / "m", 64, seed=2), {"method": "mtp", "num_speculative_tokens": 2}
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = []
    for speculative_config in (None, spec):
        llm = AsyncLLM.from_engine_args(target, speculative_config=speculative_config, enforce_eager=True,
                                        num_gpu_blocks_override=64)
        srv = ServerThread(build_app(llm, ["tiny"])).start()
        try:
            r = HTTP.post(f"{srv.url}/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
            texts.append(r.json()["choices"][0]["text"])
            m = scrape(srv.url)
        finally:
            srv.stop()
    assert texts[0] == texts[1]  # greedy: the head changes nothing but the speed
    assert m["vllm:spec_decode_num_draft_tokens_total"] > 0
