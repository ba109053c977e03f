"""The OpenAI server over data-parallel replicas: /metrics per replica under the engine label
(a shared prefix's hits on one replica only, requests spread over both), a killed replica
turning /health 503 within a second with a message naming it, no replica outliving the server;
and (slow) `pagedllm serve --data-parallel-size 2` over the demo model, launched from a script
with no `__main__` guard: greedy text as one replica's, SIGTERM reaping both core processes."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import HTTP, ServerThread, make_fake_engine, serve_demo

from pagedllm.entrypoints.openai.server import build_app

SHARED = list(range(100, 140))  # 40 token ids: two full blocks of 16, then more


def _by_engine(url: str, name: str) -> dict[str, float]:
    """One sample's value per engine label (summed over its other labels)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(HTTP.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                values[s.labels["engine"]] = values.get(s.labels["engine"], 0.0) + s.value
    return values


def _complete(url: str, prompt: list[int]) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_per_replica_and_a_killed_replica_turns_health_503(demo_tokenizer):
    engine = make_fake_engine(demo_tokenizer, num_gpu_blocks_override=64, data_parallel_size=2)
    pids = list(engine.engine_core.pids)
    srv = ServerThread(build_app(engine, ["demo"])).start()
    try:
        for i in range(3):  # one after another: each finds its prefix's holder idle
            _complete(srv.url, SHARED + [500 + i])
        hits = _by_engine(srv.url, "vllm:prefix_cache_hits_total")
        holder = max(hits, key=hits.get)
        assert hits == {holder: 2 * 32.0, str(1 - int(holder)): 0.0}  # 2 requests x 2 blocks
        with ThreadPoolExecutor(4) as pool:  # unrelated and at once: both replicas take some
            list(pool.map(lambda i: _complete(srv.url, [200 + 50 * i + j for j in range(20)]), range(4)))
        success = _by_engine(srv.url, "vllm:request_success_total")
        assert sum(success.values()) == 7 and min(success.values()) >= 2, success
        routed = _by_engine(srv.url, "pagedllm:dp_requests_routed_total")
        assert routed[holder] >= 3 and sum(routed.values()) == 7, routed
        ttft = _by_engine(srv.url, "vllm:time_to_first_token_seconds_count")
        assert ttft == success  # each request's latency under the replica that served it
        assert set(_by_engine(srv.url, "vllm:num_requests_running")) == {"0", "1"}

        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()  # a second, usually; bounded generously for a loaded machine
        while (r := HTTP.get(f"{srv.url}/health")).status_code != 503:
            assert time.monotonic() - t0 < 30.0, "/health still answers 200 after a replica died"
            time.sleep(0.02)
        assert "data-parallel replica 1 of 2 died" in r.text
        assert HTTP.post(f"{srv.url}/v1/completions", json={"model": "demo", "prompt": [5],
                                                           "max_tokens": 2}).status_code >= 500
    finally:
        srv.stop()
        engine.shutdown()  # the app stops only an engine its AsyncLLM built (the CLI's case)
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


# `pagedllm serve` started from a user's script with no `if __name__ == "__main__":` guard: the
# replicas' core processes must not run the script again (they run pagedllm's own entry module).
UNGUARDED_LAUNCH = "import sys\nfrom pagedllm.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))\n"


@pytest.mark.slow
def test_serve_data_parallel_2_matches_one_replica_and_sigterm_reaps_both(reference_llm, tmp_path):
    from pagedllm import SamplingParams

    prompts = ["Once upon a time", "The little dog", "Once upon a time there was a girl", "Tom and"]
    want = [o.outputs[0].text for o in reference_llm.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0))]
    launcher = tmp_path / "serve_unguarded.py"
    launcher.write_text(UNGUARDED_LAUNCH)
    proc, url, log = serve_demo("-dp", "2", launcher=str(launcher))
    try:
        cores = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(cores) == 2, [p.cmdline() for p in cores]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: HTTP.post(f"{url}/v1/completions", json={
                "model": "demo", "prompt": p, "max_tokens": 24, "temperature": 0}).json(), prompts))
        assert [g["choices"][0]["text"] for g in got] == want
        assert min(_by_engine(url, "pagedllm:dp_requests_routed_total").values()) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(cores, timeout=5)
        assert not alive, alive  # no orphan
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
