"""/dashboard and /v1/trace/stream without a browser: the page and its files are served, the
stream sends the step records of docs/trace_schema.md with exact totals, and it is guarded by
the API key like every /v1 route."""
from __future__ import annotations

import threading

import httpx
import pytest
from dash_helpers import LiveServer, send_completions, sse_events


def test_dashboard_page_and_static_files():
    with LiveServer(num_gpu_blocks_override=64, block_size=4) as srv:
        page = httpx.get(f"{srv.url}/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "dashboard/static/dashboard.js" in page.text
        js = httpx.get(f"{srv.url}/dashboard/static/dashboard.js")
        assert js.status_code == 200 and "v1/trace/stream" in js.text
        assert httpx.get(f"{srv.url}/dashboard/static/..%2Fdashboard.py").status_code == 404


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "core-process"])
def test_stream_sends_records_and_exact_totals(multiprocess):
    """The same stream whether the engine core runs here or in its own process (serve's default)."""
    with LiveServer(num_gpu_blocks_override=64, block_size=4, multiprocess=multiprocess) as srv:
        with httpx.Client(timeout=30) as client, client.stream("GET", f"{srv.url}/v1/trace/stream") as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp)
            name, hello = next(events)
            assert name == "hello" and hello["v"] == 1 and hello["num_blocks"] == 64
            assert hello["block_map"]["num_blocks"] == 64 and hello["totals"]["steps"] == 0
            sender = threading.Thread(target=send_completions, args=(srv.url, 4))
            sender.start()
            steps, totals = [], None
            for name, data in events:
                if name == "step":
                    steps.append(data)
                totals = data.get("totals", totals)
                # Every request finished: no step follows, so wait for no later event.
                if totals and totals["finished"] == 4:
                    break
            sender.join()
        assert steps and all(s["v"] == 1 and "budget" in s for s in steps)
        assert "block_map" in steps[0]  # a new viewer's first record has one
        metrics = httpx.get(f"{srv.url}/metrics").text
        gen = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))
        assert totals["generation_tokens"] == gen == 32
        assert totals["running"] == 0 and totals["waiting"] == 0


def test_stream_needs_the_api_key():
    with LiveServer(api_key="k-123", num_gpu_blocks_override=64, block_size=4) as srv:
        assert httpx.get(f"{srv.url}/v1/trace/stream").status_code == 401
        # The page and its files are open (they hold no data); the page sends the key itself.
        assert httpx.get(f"{srv.url}/dashboard").status_code == 200
        assert httpx.get(f"{srv.url}/dashboard/static/dashboard.js").status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        with httpx.stream("GET", f"{srv.url}/v1/trace/stream",
                          headers={"Authorization": "Bearer k-123"}) as resp:
            assert resp.status_code == 200
            name, _ = next(sse_events(resp))
            assert name == "hello"
