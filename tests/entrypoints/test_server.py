"""The other routes: /health, /version, /v1/models, /metrics, /tokenize, /detokenize,
/reset_prefix_cache; and a server whose engine dies."""
from __future__ import annotations

import json
import re
import time

import pytest
from server_utils import CHAT_TEMPLATE, HTTP

from pagedllm.runner.fake import FakeRunner

PROMPT = "Once upon a time"


def test_health_version_models(server):
    assert HTTP.get(f"{server.url}/health").status_code == 200
    assert HTTP.get(f"{server.url}/version").json()["version"]
    models = HTTP.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [("demo", "model", 512)]


def test_tokenize_detokenize(server, demo_tokenizer):
    r = HTTP.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == demo_tokenizer(PROMPT).input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    bare = HTTP.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False,
                                                      "return_token_strs": True}).json()
    assert bare["tokens"] == r["tokens"][1:] and len(bare["token_strs"]) == bare["count"]
    chat = HTTP.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    text = HTTP.post(f"{server.url}/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"]
    assert text == PROMPT
    assert HTTP.post(f"{server.url}/tokenize", json={}).status_code == 400


def test_reset_prefix_cache(server, client):
    prompt = "Lily and Ben were friends. They liked to play with blocks and cars. One day they"
    client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    hit = client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    r = HTTP.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    miss = client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_exposition(server, client, metrics):
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
    text = HTTP.get(f"{server.url}/metrics").text
    types = {"num_requests_running": "gauge", "num_requests_waiting": "gauge",
             "kv_cache_usage_perc": "gauge", "generation_tokens": "counter",
             "prompt_tokens": "counter", "prefix_cache_hits": "counter",
             "prefix_cache_queries": "counter", "request_success": "counter",
             "num_preemptions": "counter", "time_to_first_token_seconds": "histogram",
             "inter_token_latency_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
             "request_queue_time_seconds": "histogram"}
    types.update({"request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
                  "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
                  "request_inference_time_seconds": "histogram", "request_params_n": "histogram",
                  "request_params_max_tokens": "histogram", "request_max_num_generation_tokens": "histogram",
                  "request_time_per_output_token_seconds": "histogram", "cache_config_info": "gauge",
                  "prompt_tokens_cached": "counter", "spec_decode_num_drafts": "counter",
                  "spec_decode_num_draft_tokens": "counter", "spec_decode_num_accepted_tokens": "counter",
                  "iteration_tokens_total": "histogram"})
    for name, kind in types.items():
        # prometheus_client names a counter's TYPE line with or without _total, by version.
        assert re.search(rf"^# TYPE vllm:{name}(_total)? {kind}$", text, re.M), name
    # vLLM's labels on every vllm: sample, and finish reasons on request_success.
    for line in text.splitlines():
        if line.startswith("vllm:") and not line.startswith("vllm:cache_config_info"):
            assert 'model_name="demo"' in line and 'engine="0"' in line, line
    assert re.search(r'^vllm:request_success_total\{.*finished_reason="length".*\} [1-9]', text, re.M)
    assert re.search(r'^vllm:cache_config_info\{.*block_size="16".*num_gpu_blocks="[1-9]', text, re.M)
    # vLLM's buckets: TTFT up to 2560 s; token counts 1-2-5 up to max_model_len.
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="demo"}' in text
    assert re.search(r'^vllm:request_prompt_tokens_bucket\{.*le="200.0"', text, re.M)
    m = metrics(server.url)
    assert m["vllm:request_success_total{finished_reason=length}"] >= 1
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1
    assert m["vllm:request_params_n_count"] >= 1 and m["vllm:request_generation_tokens_sum"] >= 4
    assert m["vllm:iteration_tokens_total_count"] >= 4  # a prefill step and the decode steps
    # Engine counters with a vLLM counterpart appear only under vLLM's name.
    renamed = ("num_requests_running", "kv_cache_usage_perc", "generation_tokens", "prompt_tokens_total",
               "request_success", "num_preemptions", "prefix_cache_hits", "num_gpu_blocks")
    assert not [n for n in m if n.startswith("pagedllm:") and any(r in n for r in renamed)]


def test_dead_engine_fails_requests_and_health(fake_server):
    class DyingRunner(FakeRunner):
        fail = False

        def execute_model(self, so):
            if self.fail:
                raise RuntimeError("the accelerator fell off")
            time.sleep(0.002)
            return super().execute_model(so)

    runner = DyingRunner(512)
    srv = fake_server(runner=runner, chat_template=CHAT_TEMPLATE)
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with HTTP.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=20) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3:
                runner.fail = True
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "accelerator fell off" in error["message"]

    health = HTTP.get(f"{srv.url}/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "ServiceUnavailableError"
    late = HTTP.post(f"{srv.url}/v1/completions", json={**body, "stream": False})
    assert late.status_code == 503 and late.json()["error"]["code"] == 503
    assert HTTP.get(f"{srv.url}/metrics").status_code == 200  # still answers


def test_default_served_model_names():
    from pagedllm.entrypoints.openai.server import default_served_model_names

    assert default_served_model_names("/m/stories260K/hf") == ["stories260K", "/m/stories260K/hf"]
    assert default_served_model_names("/m/Qwen3-0.6B") == ["Qwen3-0.6B", "/m/Qwen3-0.6B"]
    assert default_served_model_names("tiny") == ["tiny"]


# The series vLLM's own example dashboard (examples/online_serving/prometheus_grafana/grafana.json
# in vllm-project/vllm) queries, every one filtered on model_name.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]


def test_every_dashboard_series_is_served(server, client, metrics):
    import json
    from pathlib import Path

    client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
    dashboard = json.loads((Path(__file__).parents[2] / "examples" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    ours = {name for e in exprs for name in re.findall(r"vllm:[a-z0-9_]+", e)}
    assert all('model_name="$model_name"' in e for e in exprs)
    served = metrics(server.url)
    names = set(served) | {key.split("{")[0] for key in served}
    missing = sorted(n for n in ours | set(VLLM_DASHBOARD_SERIES) if n not in names)
    assert not missing, missing


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "core-process"])
def test_speculative_decoding_metrics(demo_tokenizer, multiprocess):
    """n-gram drafts on a repetitive prompt: drafts, draft tokens, accepted tokens and the
    accepted count per draft position, as vLLM's counters; the per-step series (accepted per
    position, tokens per iteration) come from the step's stats, so the engine core's own
    process reports them too."""
    from server_utils import ServerThread, scrape

    from pagedllm.config import default_model
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = AsyncLLM.from_engine_args(default_model(), speculative_config=spec, num_gpu_blocks_override=64,
                                    multiprocess=multiprocess)
    srv = ServerThread(build_app(llm, ["demo"])).start()
    try:
        r = HTTP.post(f"{srv.url}/v1/completions", json={
            "prompt": "the cat the cat the cat the cat the cat", "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200
        m = scrape(srv.url)
    finally:
        srv.stop()
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    assert m["vllm:spec_decode_num_draft_tokens_total"] >= m["vllm:spec_decode_num_drafts_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert accepted > 0 and m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    assert m["vllm:iteration_tokens_total_count"] >= 2
