"""Fixtures of the server tests: live servers on 127.0.0.1 (free ports), over the demo model.

* ``server``: one session-wide server over the real demo model (stories260K), served as "demo",
  with a simple chat template (the demo model has none);
* ``reference_llm``: an offline ``LLM`` over the same model, the oracle for greedy text;
* ``fake_server(...)``: a cheap server over a FakeRunner engine (the real tokenizer), for tests
  that need their own server: no chat template, an API key, an engine that dies;
* ``cli_server``: ``pagedllm serve`` in a subprocess, started early (it loads while the other
  tests run) and checked by test_cli.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import openai
import pytest
from ci_support import free_port
from server_utils import CHAT_TEMPLATE, CLI_API_KEY, ServerThread, make_fake_engine, scrape

from pagedllm.config import default_model

MODEL_NAME = "demo"



@pytest.fixture(scope="session", autouse=True)
def cli_server() -> Iterator[SimpleNamespace]:
    """`pagedllm serve` in a subprocess with an API key. Started first and not waited for here:
    the model loads in the background while the in-process tests run."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", default_model(),
           "--port", str(port), "--served-model-name", MODEL_NAME, "--api-key", CLI_API_KEY,
           "--chat-template", CHAT_TEMPLATE, "--log-level", "warning", "--max-num-seqs", "8",
           "--shutdown-timeout", "1"]
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    handle = SimpleNamespace(proc=proc, url=f"http://127.0.0.1:{port}", port=port, log=log)
    yield handle
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    log.close()


@pytest.fixture(scope="session")
def reference_llm():
    from pagedllm import LLM

    return LLM(default_model())


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    llm = AsyncLLM.from_engine_args(default_model())
    srv = ServerThread(build_app(llm, [MODEL_NAME], chat_template=CHAT_TEMPLATE)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                              timeout=60.0)


@pytest.fixture(scope="session")
def demo_tokenizer():
    from pagedllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(default_model())


@pytest.fixture
def fake_server(demo_tokenizer) -> Iterator[Callable[..., ServerThread]]:
    """``fake_server(runner=None, **build_app_kwargs)`` -> a started server over a fake engine."""
    from pagedllm.entrypoints.openai.server import build_app

    started: list[ServerThread] = []

    def start(runner=None, **kwargs) -> ServerThread:
        engine = make_fake_engine(demo_tokenizer, runner, num_gpu_blocks_override=64)
        srv = ServerThread(build_app(engine, [MODEL_NAME], **kwargs)).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def metrics() -> Callable[[str], dict[str, float]]:
    return scrape
