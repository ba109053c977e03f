"""`pagedllm serve` runs the engine core in a process of its own: SIGTERM drains and reaps it
(and, with --distributed-executor-backend mp, its worker); a core killed -9 fails the open
stream and turns /health 503 within about a second; no orphan survives (psutil)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from server_utils import HTTP, serve_demo

BODY = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
        "temperature": 0, "stream": True}


def _serve(*flags: str) -> tuple[subprocess.Popen, str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_ENABLE_MULTIPROCESSING"}
    return serve_demo("--num-gpu-blocks-override", "64", *flags, env=env)


def _stream_in_background(url: str, lines: list[str]) -> threading.Thread:
    def read() -> None:
        try:
            with HTTP.stream("POST", f"{url}/v1/completions", json=BODY, timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as e:
            lines.append(f"closed: {e!r}")
    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while not any(line.startswith("data: {") for line in lines):
        assert reader.is_alive() and time.monotonic() < deadline, lines
        time.sleep(0.01)
    return reader


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_sigterm_drains_and_reaps_the_core_and_its_workers(backend):
    proc, url, log = _serve("--distributed-executor-backend", backend)
    try:
        children = _tree(proc)
        names = sorted(" ".join(p.cmdline()) for p in children)
        assert len(children) == (2 if backend == "mp" else 1), names  # the core (+ its worker)
        r = HTTP.post(f"{url}/v1/completions", json={**BODY, "stream": False, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        lines: list[str] = []
        reader = _stream_in_background(url, lines)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=20)
        assert not reader.is_alive()
        assert proc.wait(timeout=30) == 0
        assert [line for line in lines if line][-1] == "data: [DONE]"
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, alive  # no orphan
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.mark.slow
def test_a_killed_core_fails_the_stream_and_health_within_a_second():
    proc, url, log = _serve()
    try:
        (core,) = _tree(proc)
        # The core is frozen (SIGSTOP) once the stream has its first chunk, and killed only if the
        # stream is still open then: on a fast machine the 200 tokens can all be out before a
        # kill sent right after the first chunk lands, and the stream would end normally.
        for _ in range(5):
            lines: list[str] = []
            reader = _stream_in_background(url, lines)
            core.suspend()
            time.sleep(0.1)  # outputs the core sent before it stopped reach the client
            if "data: [DONE]" not in lines:
                break
            core.resume()
            reader.join(timeout=5)
        else:
            pytest.fail("every stream ended before the core could be stopped mid-request")
        core.kill()
        t0 = time.monotonic()  # a second, usually; bounded generously for a loaded machine
        while HTTP.get(f"{url}/health").status_code != 503:
            assert time.monotonic() - t0 < 30.0, "/health still answers 200 after the core died"
            time.sleep(0.02)
        reader.join(timeout=5)
        assert not reader.is_alive()
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and "engine core process" in events[-2], events[-2:]
        assert "engine core process" in HTTP.get(f"{url}/health").text
        r = HTTP.post(f"{url}/v1/completions", json={**BODY, "stream": False, "max_tokens": 4})
        assert r.status_code >= 500
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
