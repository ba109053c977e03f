"""Several models behind one server: the demo model under two ids, each an engine of its own behind
the router. Interleaved requests, keep-alive unloading and reloading, the memory budget evicting
the idle model (and waiting for a busy one), requests arriving while their model loads, models
files, and `pagedllm serve --model a=... --model b=...` leaving no process behind."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import openai
import psutil
import pytest
from ci_support import free_port
from prometheus_client.parser import text_string_to_metric_families
from server_utils import CHAT_TEMPLATE, HTTP, ServerThread, wait_for_health

from pagedllm.config import default_model
from pagedllm.entrypoints.openai.model_router import build_router_app
from pagedllm.entrypoints.openai.model_specs import (
    ModelSpec,
    check_specs,
    load_models_file,
    parse_bytes,
    parse_keep_alive,
)
from pagedllm.errors import ValidationError

# Eager: these tests are about routing and loading, and a compile per load would dominate them.
ENGINE_ARGS = {"max_num_seqs": 4, "kv_cache_memory_bytes": 4 << 20, "enforce_eager": True}
PROMPT = "Once upon a time"


def _spec(model_id: str, **kwargs) -> ModelSpec:
    return ModelSpec(model_id, default_model(), dict(ENGINE_ARGS), chat_template=CHAT_TEMPLATE, **kwargs)


def _serve(specs, **kwargs) -> ServerThread:
    return ServerThread(build_router_app(specs, multiprocess=False, **kwargs)).start()


def _client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _states(srv: ServerThread) -> dict[str, str]:
    return {m["id"]: m["state"] for m in HTTP.get(f"{srv.url}/v1/models").json()["data"]}


def _complete(client: openai.OpenAI, model: str, max_tokens: int = 8) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0).choices[0].text


def _wait_for_state(srv: ServerThread, model: str, state: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _states(srv)[model] != state:
        assert time.monotonic() < deadline, f"{model} never became {state}: {_states(srv)}"
        time.sleep(0.05)


def _series(srv: ServerThread) -> dict[tuple[str, str], float]:
    """(sample name, model_name) -> value, summed over other labels."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(HTTP.get(f"{srv.url}/metrics").text):
        for s in family.samples:
            key = (s.name, s.labels.get("model_name", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_two_models_interleaved(reference_llm):
    from pagedllm import SamplingParams

    expected = reference_llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    srv = _serve([_spec("a"), _spec("b")])
    try:
        client = _client(srv)
        assert _states(srv) == {"a": "unloaded", "b": "unloaded"}
        assert [_complete(client, m) for m in ("a", "b", "a", "b")] == [expected] * 4
        chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "b"
        resp = client.responses.create(model="b", input="hi", max_output_tokens=4)
        assert resp.model == "b"
        assert client.responses.retrieve(resp.id, extra_query={"model": "b"}).output_text == resp.output_text
        assert _states(srv) == {"a": "loaded", "b": "loaded"}
        with pytest.raises(openai.NotFoundError) as e:
            _complete(client, "c")
        assert e.value.body["param"] == "model" and "'a'" in e.value.body["message"]
        series = _series(srv)
        assert series[("vllm:request_success_total", "a")] == 2
        assert series[("vllm:request_success_total", "b")] == 4
        assert series[("pagedllm:model_loads_total", "a")] == 1 and series[("pagedllm:model_loaded", "b")] == 1
        assert HTTP.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()


def test_keep_alive_unloads_and_next_request_reloads(reference_llm):
    srv = _serve([_spec("a", keep_alive_s=0.3), _spec("b", keep_alive_s=None)])
    try:
        client = _client(srv)
        first = _complete(client, "a")
        _complete(client, "b")
        _wait_for_state(srv, "a", "unloaded")
        assert _states(srv)["b"] == "loaded"  # no keep-alive: stays
        assert _complete(client, "a") == first  # reloaded by the request, not lost
        series = _series(srv)
        assert series[("pagedllm:model_loads_total", "a")] == 2
        assert series[("pagedllm:model_unloads_total", "a")] >= 1
    finally:
        srv.stop()


def test_memory_budget_evicts_the_idle_model():
    srv = _serve([_spec("a", memory_bytes=100), _spec("b", memory_bytes=100), _spec("c", memory_bytes=40)],
                 memory_budget=150)
    try:
        client = _client(srv)
        _complete(client, "a")
        _complete(client, "c")  # fits beside a
        assert _states(srv) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        _complete(client, "c")  # c is now more recently used than a
        _complete(client, "b")  # a, the least recently used, goes; c still fits
        assert _states(srv) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
    finally:
        srv.stop()


def test_budget_waits_for_a_busy_model():
    """b needs a's room while a serves a request: b's load waits for a's release; none is lost."""
    from pagedllm.entrypoints.openai.model_router import make_pool
    from pagedllm.entrypoints.openai.server_options import ServerOptions

    async def scenario() -> None:
        pool = make_pool([_spec("a", memory_bytes=100), _spec("b", memory_bytes=100)], ServerOptions(),
                         memory_budget=150, multiprocess=False)
        await pool.start()
        try:
            a = await pool.acquire("a")
            b_request = asyncio.ensure_future(pool.acquire("b"))
            await asyncio.sleep(0.3)
            assert not b_request.done() and a.state == "loaded" and pool.models["b"].state == "unloaded"
            await pool.release(a)
            b = await asyncio.wait_for(b_request, 60)
            assert b.state == "loaded" and a.state == "unloaded"
            await pool.release(b)
        finally:
            await pool.shutdown()
        assert all(m.state == "unloaded" for m in pool.models.values())

    asyncio.run(scenario())


def test_requests_while_loading_wait():
    srv = _serve([_spec("a"), _spec("b")])
    try:
        client = _client(srv)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(_complete, client, "a") for _ in range(3)]
            seen = set()
            while not all(f.done() for f in answers):
                seen.add(_states(srv)["a"])
                time.sleep(0.01)
            texts = [f.result() for f in answers]
        assert "loading" in seen
        assert len(set(texts)) == 1 and texts[0]
        assert _series(srv)[("pagedllm:model_loads_total", "a")] == 1  # one load served all three
    finally:
        srv.stop()


def test_a_dead_engine_is_reloaded_by_the_next_request():
    from pagedllm.entrypoints.openai.model_router import make_pool
    from pagedllm.entrypoints.openai.server_options import ServerOptions

    async def scenario() -> None:
        pool = make_pool([_spec("a")], ServerOptions(), multiprocess=False)
        try:
            a = await pool.acquire("a")
            dead = a.loaded.llm
            await pool.release(a)
            await dead.shutdown()  # its streams end with EngineDeadError; /health would be 503
            assert dead.errored
            a = await pool.acquire("a")
            assert a.loaded.llm is not dead and not a.loaded.llm.errored and a.num_loads == 2
            await pool.release(a)
        finally:
            await pool.shutdown()

    asyncio.run(scenario())


def test_unloaded_engines_are_freed():
    """Nothing keeps an unloaded model's engine alive (FastAPI's endpoint caches would)."""
    import gc
    import weakref

    from pagedllm.entrypoints.openai.model_router import make_pool
    from pagedllm.entrypoints.openai.server_options import ServerOptions

    async def scenario() -> list:
        pool = make_pool([_spec("a")], ServerOptions(), multiprocess=False)
        engines = []
        try:
            for _ in range(3):
                a = await pool.acquire("a")
                engines.append(weakref.ref(a.loaded.llm))
                await pool.release(a)
                await pool.unload("a")
        finally:
            await pool.shutdown()
        return engines

    engines = asyncio.run(scenario())
    gc.collect()
    assert [ref() for ref in engines] == [None, None, None]


def test_the_api_key_is_checked_before_a_model_loads():
    from pagedllm.entrypoints.openai.server_options import ServerOptions

    srv = _serve([_spec("a")], options=ServerOptions(api_keys=("k1",)))
    try:
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 2}
        assert HTTP.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        assert HTTP.get(f"{srv.url}/v1/models").status_code == 401
        assert HTTP.get(f"{srv.url}/dashboard").status_code == 503  # open, so it loads nothing
        headers = {"Authorization": "Bearer k1"}
        assert HTTP.get(f"{srv.url}/v1/models", headers=headers).json()["data"][0]["state"] == "unloaded"
        assert HTTP.post(f"{srv.url}/v1/completions", json=body, headers=headers).status_code == 200
    finally:
        srv.stop()


def test_failed_load_is_a_503_and_the_server_goes_on(tmp_path):
    srv = _serve([_spec("a"), ModelSpec("broken", str(tmp_path / "missing"))])
    try:
        client = _client(srv)
        with pytest.raises(openai.InternalServerError) as e:
            _complete(client, "broken")
        assert e.value.status_code == 503 and "failed to load" in e.value.body["message"]
        assert _complete(client, "a")
        assert _states(srv)["broken"] == "unloaded"
    finally:
        srv.stop()


def test_models_file_and_flags(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - id: chat\n    model: {default_model()}\n    keep_alive: 5m\n    pinned: true\n"
                    f"    engine_args: {{max_num_seqs: 2}}\n  - model: {default_model()}\n    keep_alive: forever\n")
    specs = load_models_file(str(path), {"max_num_seqs": 8, "block_size": 8}, 60.0, lambda p: "demo", None)
    assert [(s.id, s.keep_alive_s, s.pinned) for s in specs] == [("chat", 300.0, True), ("demo", None, False)]
    assert specs[0].engine_args == {"max_num_seqs": 2, "block_size": 8}
    json_path = tmp_path / "models.json"
    json_path.write_text(json.dumps({"models": [{"model": "x", "speed": 1}]}))
    with pytest.raises(ValidationError, match="unknown keys"):
        load_models_file(str(json_path), {}, None, str, None)
    with pytest.raises(ValidationError, match="share the id"):
        check_specs([ModelSpec("a", "x"), ModelSpec("a", "y")], None)
    with pytest.raises(ValidationError, match="pinned"):
        check_specs([ModelSpec("a", "x", pinned=True, memory_bytes=60),
                     ModelSpec("b", "y", pinned=True, memory_bytes=60)], 100)
    weights = os.path.getsize(os.path.join(default_model(), "model.safetensors"))
    assert _spec("a").estimated_bytes() == weights + (4 << 20)
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("512MB") == 512 * 10 ** 6 and parse_bytes("1000") == 1000
    assert parse_keep_alive("30s") == 30 and parse_keep_alive("1h") == 3600 and parse_keep_alive(-1) is None
    with pytest.raises(ValidationError):
        parse_keep_alive("soon")


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_cli_models_no_orphans(tmp_path):
    """`pagedllm serve --model a=DEMO --models-file F`: each model an engine core process; a
    keep-alive unload stops its process, and SIGTERM leaves none behind."""
    port = free_port()
    models_file = tmp_path / "models.json"
    models_file.write_text(json.dumps({"models": [{"id": "b", "model": default_model(), "keep_alive": "1s"}]}))
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", f"a={default_model()}",
           "--models-file", str(models_file), "--port", str(port), "--keep-alive", "forever",
           "--log-level", "warning", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(4 << 20),
           "--shutdown-timeout", "1", "--enforce-eager"]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, log, timeout=120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert _complete(client, "a") == _complete(client, "b")
        children = _children(proc.pid)
        assert len(children) >= 2  # one engine core per model
        deadline = time.monotonic() + 30
        while {m["id"]: m["state"] for m in HTTP.get(f"{url}/v1/models").json()["data"]}["b"] != "unloaded":
            assert time.monotonic() < deadline, "b was never unloaded"
            time.sleep(0.1)
        _, alive = psutil.wait_procs(children, timeout=2)  # the unload has reaped b's already
        assert 0 < len(alive) < len(children)  # b's core stopped, a's runs on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
