"""A vLLM launch line, ``pagedllm serve MODEL -tp 2 --distributed-executor-backend ray`` (and mp),
on the demo model (8 heads, 4 KV heads: two of each per rank): greedy completions equal one
rank's; a worker killed -9 while a stream runs ends the stream with an error and turns /health
503 within a few seconds, naming the dead rank; SIGTERM then exits 0 and leaves no process behind (Ray's included)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
import pytest
from ci_support import free_port
from dist_helpers import DEMO_MODEL_DIR

HTTP = httpx.Client(timeout=60)
PROMPTS = ["Once upon a time", "The cat sat on the mat.", "Lily and Ben were friends."]


def _completion(url: str, prompt: str) -> str:
    r = HTTP.post(f"{url}/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 24,
                                                 "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _serve(*flags: str) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(DEMO_MODEL_DIR),
           "--port", str(port), "--served-model-name", "demo", "--log-level", "warning",
           "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--device", "cpu",
           "--shutdown-timeout", "1", *flags]
    log = tempfile.TemporaryFile(mode="w+")
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDLLM_ENABLE_MULTIPROCESSING", "RAY_ADDRESS")}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()}")
        try:
            if HTTP.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.2)


def _workers(proc: subprocess.Popen, backend: str) -> list[psutil.Process]:
    tree = psutil.Process(proc.pid).children(recursive=True)
    if backend == "ray":
        return [p for p in tree if "RayWorkerWrapper" in " ".join(p.cmdline())]
    # mp: the engine core is the server's spawned child, its workers are the core's.
    return [p for p in tree if "pagedllm.executor.process_main" in " ".join(p.cmdline())
            and p.ppid() != proc.pid]


@pytest.fixture(scope="module")
def one_rank_texts() -> list[str]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.mark.slow  # a server, its engine core, two ranks loading the model (and a local Ray)
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_serve_tp2_matches_one_rank_and_a_killed_worker_is_reported(backend, one_rank_texts):
    proc, url, log = _serve("-tp", "2", "--distributed-executor-backend", backend)
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert [_completion(url, p) for p in PROMPTS] == one_rank_texts
        workers = _workers(proc, backend)
        assert len(workers) == 2, [" ".join(p.cmdline()) for p in tree]

        lines: list[str] = []

        def read() -> None:
            body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 240,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            try:
                with HTTP.stream("POST", f"{url}/v1/completions", json=body) as r:
                    lines.extend(r.iter_lines())
            except httpx.HTTPError as e:
                lines.append(f"closed: {e!r}")
        reader = threading.Thread(target=read)
        reader.start()
        while not any(line.startswith("data: {") for line in lines):
            assert reader.is_alive(), lines
            time.sleep(0.01)
        victim = workers[1]
        victim.kill()
        t0 = time.monotonic()
        while HTTP.get(f"{url}/health").status_code != 503:
            assert time.monotonic() - t0 < 5.0, "/health still 200 five seconds after the kill"
            time.sleep(0.05)
        health = HTTP.get(f"{url}/health").text
        assert f"pid {victim.pid}" in health and "worker rank" in health, health  # which one died
        reader.join(timeout=10)
        assert not reader.is_alive()
        assert any('"error"' in line for line in lines), lines[-3:]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(tree, timeout=15)
        assert not alive, [" ".join(p.cmdline()) for p in alive]  # no orphan, Ray's included
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.seek(0)
        print(log.read()[-4000:])
        log.close()
