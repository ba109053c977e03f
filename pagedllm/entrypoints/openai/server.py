"""The OpenAI-compatible HTTP server: ``build_app(engine)`` -> a FastAPI app; ``run_server`` serves
it with uvicorn (SIGINT/SIGTERM: stop accepting, let in-flight requests finish for a grace
period, then stop the engine, which ends the rest with an error).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /version, POST /tokenize, POST /detokenize, POST /reset_prefix_cache.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_errors import error_response, install_exception_handlers
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (CompletionRequest, DetokenizeRequest,
                                                  DetokenizeResponse, ModelCard, ModelList,
                                                  TokenizeRequest, TokenizeResponse)
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.errors import ValidationError

logger = logging.getLogger(__name__)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is not a valid path
        pass
    if "{" in value:
        return value
    raise ValidationError(f"--chat-template {value!r} is neither a file nor a Jinja template",
                          "chat_template")


def default_served_model_names(model_path: str) -> list[str]:
    """The folder's name (its parent's for a folder named like "hf"), then the path as given:
    /models/stories260K/hf is served as "stories260K" and answers to the path too."""
    path = Path(model_path)
    short = path.parent.name if path.name.lower() in _GENERIC_FOLDER_NAMES and path.parent.name else path.name
    return [short, model_path] if short and short != model_path else [model_path]


_GENERIC_FOLDER_NAMES = {"hf", "model", "weights", "checkpoint", "snapshot"}


class APIKeyMiddleware:
    """Every /v1 request needs ``Authorization: Bearer <key>`` (plain ASGI, so streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                response = error_response(401, "invalid or missing API key: send the header "
                                               "'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM | LLMEngine, served_model_names: list[str] | None = None,
              chat_template: str | None = None, api_key: str | None = None) -> FastAPI:
    """The app over an engine (an AsyncLLM, or an LLMEngine to wrap). The app owns the engine
    from then on: its shutdown stops the engine loop."""
    llm = engine if isinstance(engine, AsyncLLM) else AsyncLLM(engine)
    names = list(served_model_names or default_served_model_names(llm.model_path))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        await llm.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.llm = llm
    install_exception_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    completions = OpenAIServingCompletion(llm, names)
    chat = OpenAIServingChat(llm, names, chat_template)
    metrics = ServerMetrics(llm)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=llm.model_path, max_model_len=llm.max_model_len)
                               for name in names])

    @v1.post("/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await completions.create_completion(request, raw_request)

    @v1.post("/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await chat.create_chat_completion(request, raw_request)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if llm.errored:
            return error_response(503, f"the engine is dead: {llm.dead_error}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": await llm.reset_prefix_cache()}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ValidationError("give exactly one of prompt and messages", "prompt")
        if request.messages is not None:
            ids = await chat.render_prompt(request.messages, None, request.add_generation_prompt, None)
        else:
            tokenizer = _tokenizer(llm)
            ids = (await chat.tokenizer_call(tokenizer, request.prompt,
                                             add_special_tokens=request.add_special_tokens)).input_ids
        strs = (await chat.tokenizer_call(_tokenizer(llm).convert_ids_to_tokens, ids)
                if request.return_token_strs else None)
        return TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len, tokens=list(ids),
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        vocab_size = llm.model_info.vocab_size
        if any(not 0 <= t < vocab_size for t in request.tokens):
            raise ValidationError(f"token ids must be in [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=_tokenizer(llm).decode(request.tokens))

    return app


def _tokenizer(llm: AsyncLLM) -> Any:
    if llm.tokenizer is None:
        raise ValidationError("this server has no tokenizer", "prompt")
    return llm.tokenizer


def create_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  shutdown_timeout: float = 5.0) -> Any:
    """A uvicorn server for ``app`` (from build_app). On SIGINT/SIGTERM it stops accepting and
    gives in-flight requests ``shutdown_timeout`` seconds; then it stops the engine, which ends
    each remaining request with an error (an error event and [DONE] in a stream, a 503
    otherwise), so no client is cut off silently and nothing hangs."""
    import uvicorn

    llm: AsyncLLM = app.state.llm

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(shutdown_timeout, lambda: loop.create_task(llm.shutdown()))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    # uvicorn's own deadline is a backstop: by then every request has had its error.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 5.0)
    return Server(config)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               shutdown_timeout: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM (see create_server)."""
    try:
        create_server(app, host, port, log_level, shutdown_timeout).run()
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on SIGINT, then re-raises it: that is a normal exit.
        # (SIGTERM is re-raised too and ends the process with its default action, status 143.)
        pass
