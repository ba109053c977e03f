"""Chaos (issue 15): many concurrent clients against a server with a small KV cache (so requests
are preempted), mixing n = 2..4, beam search, stop strings, chat, streaming and not, mid-stream
disconnects, early aborts and bad requests (chaos_mix.py). At the end: every completed answer
equals the same request replayed alone, no 5xx, every bad request a 4xx with OpenAI's error
object, /health 200, running = waiting = 0 and KV usage 0 on /metrics, and a fresh request
completes.

Two variants over the demo model: a live ``pagedllm serve`` subprocess (the real entry point), and
the same app served in-process from a thread, where the test can also reach the scheduler:
``check_integrity()``, every block free, no unfinished request. Loopback only.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from chaos_mix import check_outcomes, idle_leaks, make_actions, run_chaos, wait_idle
from ci_support import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ENGINE_FLAGS = {"num_gpu_blocks_override": 48, "block_size": 4, "max_num_seqs": 16}
NUM_ACTIONS = 160
SEED = 15



def _wait_healthy(url: str, proc: subprocess.Popen | None, log, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


def _final_checks(url: str, label: str, fig) -> dict[str, float]:
    """The server-side end state; returns the idle metrics."""
    m = wait_idle(url)
    fig.leaks += idle_leaks(m)
    fig.preemptions = m.get("vllm:num_preemptions_total", m.get("vllm:num_preemptions", 0.0))
    with httpx.Client(timeout=30.0) as client:
        assert client.get(url + "/health").status_code == 200
        fresh = client.post(url + "/v1/completions",
                            json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert fresh.status_code == 200 and fresh.json()["choices"][0]["finish_reason"] == "length"
    return m


def _assert_figures(fig, label: str) -> None:
    print(fig.line(label))
    assert fig.server_errors == 0
    assert not fig.bad_answers, "\n".join(fig.bad_answers)
    assert not fig.mismatches, "\n".join(fig.mismatches)
    assert not fig.leaks, fig.leaks
    # The mix did what it says: every kind happened, and the small cache preempted.
    assert fig.completed >= 40 and fig.disconnects >= 10 and fig.aborts >= 5 and fig.bad_inputs >= 25
    assert fig.preemptions > 0


def _children(pid: int) -> list:
    try:
        import psutil
    except ImportError:
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_chaos_against_pagedllm_serve():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--uvicorn-log-level", "warning",
           "--shutdown-timeout", "1"]
    for name, value in ENGINE_FLAGS.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    children = []
    try:
        _wait_healthy(url, proc, log)
        children = _children(proc.pid)
        start = time.monotonic()
        outcomes = asyncio.run(run_chaos(url, make_actions(SEED, NUM_ACTIONS)))
        fig = check_outcomes(url, outcomes)
        fig.seconds = time.monotonic() - start
        _final_checks(url, "serve", fig)
        assert proc.poll() is None, "the server died"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for child in children:  # nothing the server started outlives it
            if child.is_running():
                child.kill()
        log.seek(0)
        output = log.read()
        log.close()
    assert "Traceback" not in output, output[-4000:]
    _assert_figures(fig, "serve")


def test_chaos_in_process_keeps_the_scheduler_consistent():
    """The same mix against the app served from a thread over an in-process AsyncLLM: at the
    end the scheduler passes check_integrity(), every KV block is free, nothing is unfinished."""
    from server_utils import ServerThread

    from pagedllm.config import default_model
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app, load_chat_template

    template = load_chat_template(os.path.join(os.path.dirname(default_model()), "chat_template.jinja"))
    llm = AsyncLLM.from_engine_args(default_model(), **ENGINE_FLAGS)
    engine = llm.engine
    srv = ServerThread(build_app(llm, chat_template=template)).start()
    try:
        start = time.monotonic()
        outcomes = asyncio.run(run_chaos(srv.url, make_actions(SEED + 1, NUM_ACTIONS)))
        fig = check_outcomes(srv.url, outcomes)
        fig.seconds = time.monotonic() - start
        _final_checks(srv.url, "in-process", fig)
    finally:
        srv.stop()  # the loop is stopped: the engine's state can be read from here
    scheduler = engine.scheduler
    try:
        scheduler.check_integrity()
    except AssertionError as e:
        fig.leaks.append(f"check_integrity: {e}")
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    if free != engine.num_blocks:
        fig.leaks.append(f"{engine.num_blocks - free} of {engine.num_blocks} KV blocks still held")
    if engine.has_unfinished_requests():
        fig.leaks.append(f"{engine.get_num_unfinished_requests()} unfinished requests")
    if scheduler.running or scheduler.waiting or scheduler.requests:
        fig.leaks.append(f"scheduler holds running={len(scheduler.running)} waiting={len(scheduler.waiting)} "
                         f"requests={len(scheduler.requests)}")
    _assert_figures(fig, "in-process")
