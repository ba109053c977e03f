"""A live server on 127.0.0.1 for the dashboard tests: an app over a FakeRunner engine (no
torch) served by uvicorn on a background thread, and a reader of the SSE trace stream."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from pagedllm.config import EngineConfig, default_model
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.entrypoints.openai.server import build_app, create_server
from pagedllm.runner.fake import FakeRunner


class LiveServer:
    def __init__(self, api_key: str | None = None, multiprocess: bool = False, **engine_args: Any) -> None:
        info = ModelInfo.from_folder(default_model())
        engine = LLMEngine(EngineConfig.from_kwargs(default_model(), **engine_args),
                           runner=FakeRunner(info.vocab_size), model_info=info,
                           tokenizer=load_tokenizer(default_model()), multiprocess=multiprocess)
        self.app = build_app(engine, api_key=api_key)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = create_server(self.app, log_level="warning", shutdown_timeout=1)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def sse_events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """(event name, data) of a server-sent-events response, as they arrive."""
    name, data = "message", ""
    for line in response.iter_lines():
        if not line:
            if data:
                yield name, json.loads(data)
            name, data = "message", ""
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data += line[6:]


def send_completions(url: str, num: int, max_tokens: int = 8, headers: dict | None = None) -> None:
    with httpx.Client(timeout=60, headers=headers or {}) as client:
        for i in range(num):
            r = client.post(f"{url}/v1/completions", json={
                "model": "stories260K", "prompt": f"Once upon a time {i}", "max_tokens": max_tokens,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
