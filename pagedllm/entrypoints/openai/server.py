"""The OpenAI-compatible HTTP server: ``build_app(engine)`` -> a FastAPI app; ``run_server`` serves
it with uvicorn (SIGINT/SIGTERM: stop accepting, let in-flight requests finish for a grace
period, then stop the engine, which ends the rest with an error).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/messages (Anthropic's, over
the chat route: anthropic/), GET /v1/models, GET /health,
GET|POST /ping, GET /metrics, GET /version, POST /tokenize, POST /detokenize,
POST /reset_prefix_cache; a pooling model's /v1/embeddings, /pooling, /classify, /score,
/rerank (serving_pooling.py); with --allow-runtime-lora-updating POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (serving_lora.py); POST /v1/responses (GET|DELETE /v1/responses/{id}).
Which need the API key: see auth.py; limits: http_limits.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import __version__
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.anthropic.serving_messages import messages_router
from pagedllm.entrypoints.openai.api_errors import error_response, install_exception_handlers
from pagedllm.entrypoints.openai.auth import APIKeyMiddleware
from pagedllm.entrypoints.openai.endpoint_caches import forget_endpoints
from pagedllm.entrypoints.openai.http_limits import BodyLimitMiddleware, header_timeout_protocol
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_lora import LoRAModules, lora_router
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, pooling_router
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, responses_router
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

# The API description (/openapi.json) names what the routes really answer: OpenAI's error object
# for every error status (FastAPI would only list its own 422, which this server never sends),
# server-sent events for a generation with stream: true, Prometheus text on /metrics.
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in (
        (400, "Bad request (error.param names the field)"), (401, "Missing or wrong API key"),
        (404, "Unknown model or route"), (408, "Request body too slow"),
        (413, "Request body too large"), (503, "The engine is dead or stuck"))}
_STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"description": "The whole answer (JSON), or with stream: true a text/event-stream of chunks",
          "content": {"text/event-stream": {"schema": {  # one event: a JSON chunk, or [DONE]
              "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}
_EMPTY_OK: dict[int | str, dict[str, Any]] = {200: {"description": "Healthy (an empty body)"}}


def build_app(engine: AsyncLLM | Any, served_model_names: list[str] | None = None,
              chat_template: str | None = None, api_key: str | None = None,
              options: ServerOptions | None = None) -> FastAPI:
    """The app over an engine (an AsyncLLM, or the LLMEngine one wraps: the entry points use
    the public API only, so they take it as it comes). The app owns the engine
    from then on: its shutdown stops the engine loop. ``api_key`` adds one key to
    ``options.api_keys``."""
    llm = engine if isinstance(engine, AsyncLLM) else AsyncLLM(engine)
    names = list(served_model_names or default_served_model_names(llm.model_path))
    options = options or ServerOptions()
    api_keys = list(options.api_keys) + ([api_key] if api_key else [])

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        await llm.shutdown()
        forget_endpoints()  # else FastAPI's caches keep this app's engine alive

    docs = {} if not options.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan,
                  responses=_ERROR_RESPONSES, **docs)
    app.state.llm = llm
    app.state.options = options
    install_exception_handlers(app)
    _add_middleware(app, options, api_keys)
    metrics = ServerMetrics(llm, names[0], _cache_config_info(llm))
    app.state.metrics = metrics  # a router over several models merges them
    completions = OpenAIServingCompletion(llm, names, options, metrics)
    chat = OpenAIServingChat(llm, names, chat_template, options, metrics)
    loras = LoRAModules(llm, names[0])
    loras.load_at_start(options.lora_modules)
    completions.lora_modules = chat.lora_modules = loras.by_name

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=llm.model_path, max_model_len=llm.max_model_len)
                               for name in names] + loras.model_cards(llm.max_model_len))

    @v1.post("/completions", responses=_STREAMED)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await completions.create_completion(request, raw_request)

    @v1.post("/chat/completions", responses=_STREAMED)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await chat.create_chat_completion(request, raw_request)

    app.include_router(v1)
    app.include_router(messages_router(chat))  # Anthropic's /v1/messages
    if options.allow_runtime_lora_updating:
        app.include_router(lora_router(loras))
    app.include_router(pooling_router(llm, names, OpenAIServingPooling(llm, names, options, metrics)))
    app.include_router(responses_router(OpenAIServingResponses(chat)))  # /v1/responses: over the chat handler
    from pagedllm.entrypoints.openai.dashboard import dashboard_router  # /dashboard, /v1/trace/stream

    app.include_router(dashboard_router(llm))

    @app.get("/health", response_class=Response, responses=_EMPTY_OK)
    async def health() -> Response:
        problem = llm.health_error()  # dead, or stuck (the watchdog)
        if problem is not None:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/ping", response_class=Response, responses=_EMPTY_OK)
    async def ping() -> Response:  # vLLM's (SageMaker's) liveness route: /health's answer
        return await health()

    @app.post("/ping", response_class=Response, responses=_EMPTY_OK)
    async def ping_post() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", responses={200: {"description": "Prometheus text format",
                                          "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": await llm.reset_prefix_cache()}

    app.include_router(_tokenizer_router(llm, chat))
    return app


def _cache_config_info(llm: AsyncLLM) -> dict[str, str]:
    """The labels of vllm:cache_config_info: the cache config's fields, as strings."""
    cache = getattr(getattr(llm.engine, "config", None), "cache_config", None)
    if cache is None or not dataclasses.is_dataclass(cache):
        return {}
    return {f.name: str(getattr(cache, f.name)) for f in dataclasses.fields(cache)}


def _tokenizer(llm: AsyncLLM) -> Any:
    if llm.tokenizer is None:
        raise ValidationError("this server has no tokenizer", "prompt")
    return llm.tokenizer


def create_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  shutdown_timeout: float = 5.0, **uvicorn_kwargs: Any) -> Any:
    """A uvicorn server for ``app`` (from build_app). On SIGINT/SIGTERM it stops accepting and
    gives in-flight requests ``shutdown_timeout`` seconds; then it stops the engine, which ends
    each remaining request with an error (an error event and [DONE] in a stream, a 503
    otherwise), so no client is cut off silently and nothing hangs. ``uvicorn_kwargs`` go to
    uvicorn.Config (ssl_keyfile, ssl_certfile, root_path, ...)."""
    import uvicorn

    llm: AsyncLLM = app.state.llm
    options: ServerOptions = getattr(app.state, "options", ServerOptions())

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
                            timeout_graceful_shutdown=shutdown_timeout + 5.0,
                            http=header_timeout_protocol(options.request_header_timeout),
                            **uvicorn_kwargs)
    return Server(config)


class _Terminated(Exception):
    """SIGTERM, turned into an exception like SIGINT's KeyboardInterrupt."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               shutdown_timeout: float = 5.0, **uvicorn_kwargs: Any) -> None:
    """Serve until SIGINT/SIGTERM (see create_server); both exit normally after the drain.

    uvicorn drains on either signal, then re-raises it under the handler that was there before
    it started: SIGINT's raises KeyboardInterrupt, and the one installed here for SIGTERM
    raises _Terminated (the default would end the process with status 143)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        create_server(app, host, port, log_level, shutdown_timeout, **uvicorn_kwargs).run()
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _add_middleware(app: FastAPI, options: ServerOptions, api_keys: list[str]) -> None:
    """Added innermost first: CORS (outermost, so even a 401 carries its headers), then the key
    check (before a large body is read), then the body limit."""
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=options.max_request_body_bytes,
                       body_timeout=options.request_body_timeout)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, salt_per_key=options.cache_salt_per_key)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_credentials=options.allow_credentials,
                           allow_methods=list(options.allowed_methods),
                           allow_headers=list(options.allowed_headers))


def _tokenizer_router(llm: AsyncLLM, chat: OpenAIServingChat) -> APIRouter:
    """/tokenize and /detokenize (vLLM's routes), with the chat template's rendering."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(request.model)
        request.check_extra_fields()
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

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(request.model)
        request.check_extra_fields()
        vocab_size = llm.model_info.vocab_size
        if any(not 0 <= t < vocab_size for t in request.tokens):
            raise ValidationError(f"token ids must be in [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=_tokenizer(llm).decode(request.tokens))

    return router
