"""A live uvicorn server on 127.0.0.1 (a free port, a background thread) for the entrypoint tests, and
`pagedllm serve` over the demo model in a subprocess."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from ci_support import free_port
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import EngineConfig, default_model
from pagedllm.entrypoints.openai.server import create_server

CLI_API_KEY = "test-key-123"

# One client for every plain request of the tests: a new httpx client per call costs ~0.1 s.
HTTP = httpx.Client(timeout=30)

# The demo model has no chat template; the tests give the server this one.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ServerThread:
    """Serves ``app`` until stop(); the socket is bound before the thread starts, so the port is
    known and free."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = create_server(app, log_level="warning", shutdown_timeout=2)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name=f"uvicorn-{self.port}")

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def make_fake_engine(tokenizer, runner=None, **engine_args):
    """An LLMEngine over a FakeRunner (deterministic tokens, no torch) with the real tokenizer."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.model_info import ModelInfo
    from pagedllm.runner.fake import FakeRunner

    info = ModelInfo.from_folder(default_model())
    return LLMEngine(EngineConfig.from_kwargs(default_model(), **engine_args),
                     runner=runner or FakeRunner(info.vocab_size), model_info=info, tokenizer=tokenizer)


def serve_demo(*flags: str, launcher: str | None = None, env: dict[str, str] | None = None,
               ) -> tuple[subprocess.Popen, str, object]:
    """`pagedllm serve` over the demo model (as "demo", short shutdown) in a subprocess on a free
    port, healthy; (process, url, log file). ``launcher``: a script to run instead of the CLI module."""
    port = free_port()
    entry = [launcher] if launcher is not None else ["-m", "pagedllm.entrypoints.cli"]
    cmd = [sys.executable, *entry, "serve", default_model(), "--port", str(port), "--served-model-name", "demo",
           "--log-level", "warning", "--max-model-len", "256", "--shutdown-timeout", "1", *flags]
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, proc, log, timeout=120)
    return proc, url, log


def wait_for_health(url: str, proc: subprocess.Popen | None = None, log=None, timeout: float = 60.0) -> None:
    """Wait for GET /health == 200; fail with the server's output if its process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            output = ""
            if log is not None:
                log.seek(0)
                output = log.read()
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{output}")
        try:
            if HTTP.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


def scrape(url: str) -> dict[str, float]:
    """GET /metrics as {sample name: value}, summed over labels; a sample with an 'le' or a
    'finished_reason' label is also keyed ``name{label=value}``."""
    text = HTTP.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for label in ("le", "finished_reason"):
                if label in s.labels:
                    key = f"{s.name}{{{label}={s.labels[label]}}}"
                    values[key] = values.get(key, 0.0) + s.value
            if "le" not in s.labels:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return values
