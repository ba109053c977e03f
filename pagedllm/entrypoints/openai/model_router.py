"""The app of a server with several models: a router in front of one single-model app per loaded
model (build_app's, so every route works the same), keyed by the request body's ``model`` (or a
``?model=`` query parameter; neither: the first model).

The router itself answers GET /v1/models (every model with its state), /health, /ping, /version
and /metrics (every loaded model's series, each under its ``model_name``, plus
``pagedllm:model_loaded`` and ``pagedllm:model_loads``/``_unloads`` per model). The API key and
body limit are checked before a request can load a model."""
from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm import default_chat_template
from pagedllm.entrypoints.openai.api_errors import APIError, error_response, install_exception_handlers
from pagedllm.entrypoints.openai.auth import OPEN_PATHS, OPEN_PREFIXES, route_path
from pagedllm.entrypoints.openai.endpoint_caches import forget_endpoints
from pagedllm.entrypoints.openai.http_limits import replay_body
from pagedllm.entrypoints.openai.model_pool import LOADED, LoadedModel, ModelPool
from pagedllm.entrypoints.openai.model_specs import ModelSpec
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.entrypoints.openai.server import _add_middleware, build_app
from pagedllm.entrypoints.openai.server_options import ServerOptions

_ROUTER_PATHS = {"/v1/models", "/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/redoc"}


class RoutedModelCard(ModelCard):
    state: str  # unloaded, loading, loaded, unloading
    pinned: bool = False
    keep_alive: float | None = None  # seconds; null: never unloaded for idleness


class RoutedModelList(ModelList):
    data: list[RoutedModelCard]  # type: ignore[assignment]


def engine_loader(options: ServerOptions, api_key: str | None, multiprocess: bool | None):
    """The pool's load function: an engine (built off the event loop) and its app."""
    async def load(spec: ModelSpec) -> LoadedModel:
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, spec.model, multiprocess=multiprocess,
                                      **spec.engine_args)
        try:
            app = build_app(llm, [spec.id], spec.chat_template or default_chat_template(spec.model),
                            api_key=api_key, options=options)
            llm.start()
        except BaseException:
            await llm.shutdown()
            raise
        return LoadedModel(llm, app)
    return load


def make_pool(specs: list[ModelSpec], options: ServerOptions, api_key: str | None = None,
              memory_budget: int | None = None, load_timeout_s: float = 600.0,
              multiprocess: bool | None = None) -> ModelPool:
    return ModelPool(specs, engine_loader(options, api_key, multiprocess), memory_budget, load_timeout_s,
                     forget=forget_endpoints)


def build_router_app(specs: list[ModelSpec], options: ServerOptions | None = None, api_key: str | None = None,
                     memory_budget: int | None = None, load_timeout_s: float = 600.0,
                     multiprocess: bool | None = None) -> FastAPI:
    options = options or ServerOptions()
    pool = make_pool(specs, options, api_key, memory_budget, load_timeout_s, multiprocess)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.llm = pool  # create_server stops it after the grace period
    app.state.options = options
    app.state.pool = pool
    install_exception_handlers(app)
    app.add_middleware(ModelDispatchMiddleware, pool=pool)  # innermost: after the key and body checks
    _add_middleware(app, options, list(options.api_keys) + ([api_key] if api_key else []))

    @app.get("/v1/models")
    async def list_models() -> RoutedModelList:
        cards = []
        for served in pool.models.values():
            llm = served.loaded.llm if served.loaded is not None else None
            cards.append(RoutedModelCard(id=served.spec.id, root=served.spec.model,
                                         max_model_len=llm.max_model_len if llm is not None else None,
                                         state=served.state, pinned=served.spec.pinned,
                                         keep_alive=served.spec.keep_alive_s))
        return RoutedModelList(data=cards)

    @app.get("/health", response_class=Response)
    async def health() -> Response:
        for served in pool.models.values():
            problem = served.loaded.llm.health_error() if served.loaded is not None else None
            if problem is not None:
                return error_response(503, f"model {served.spec.id!r}: {problem}")
        return Response(status_code=200)

    app.get("/ping", response_class=Response)(health)
    app.post("/ping", response_class=Response)(health)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        registries = []
        for served in list(pool.models.values()):
            if served.state == LOADED and served.loaded is not None:
                metrics = served.loaded.app.state.metrics
                await metrics.render()  # reads the engine's counters
                registries.append(metrics.registry)
        return Response(generate_latest(_MergedMetrics(registries, pool)), media_type=CONTENT_TYPE_LATEST)

    return app


class _MergedMetrics:
    """Every loaded model's series as one family per name (each sample keeps its model_name)."""

    def __init__(self, registries: list[Any], pool: ModelPool) -> None:
        self.registries = registries
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
        loaded = GaugeMetricFamily("pagedllm:model_loaded", "1 while the model is loaded.", labels=["model_name"])
        loads = CounterMetricFamily("pagedllm:model_loads", "Times the model was loaded.", labels=["model_name"])
        unloads = CounterMetricFamily("pagedllm:model_unloads", "Times the model was unloaded.",
                                      labels=["model_name"])
        for served in self.pool.models.values():
            loaded.add_metric([served.spec.id], 1.0 if served.state == LOADED else 0.0)
            loads.add_metric([served.spec.id], served.num_loads)
            unloads.add_metric([served.spec.id], served.num_unloads)
        yield from (loaded, loads, unloads)


class ModelDispatchMiddleware:
    """Sends a model's request to that model's app, loading the model first if needed."""

    def __init__(self, app: ASGIApp, pool: ModelPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in _ROUTER_PATHS:
            await self.app(scope, receive, send)
            return
        body, replay = await _buffered(receive)
        path = route_path(scope)
        try:  # a route open without the API key never loads a model
            served = await self.pool.acquire(_requested_model(scope, body),
                                             load=path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES))
        except APIError as e:
            await error_response(e.status, e.message, e.param)(scope, replay, send)
            return
        try:
            assert served.loaded is not None  # acquire returns loaded models only
            await served.loaded.app(scope, replay, send)
        finally:
            await self.pool.release(served)


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The whole body (the body limit has bounded it already) and a receive that replays it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    return body, replay_body(body, receive)


def _requested_model(scope: Scope, body: bytes) -> str | None:
    if body[:1] == b"{":
        try:
            model = json.loads(body).get("model")
        except ValueError:
            model = None  # the model's app answers the bad JSON with its 400
        if isinstance(model, str):
            return model
    for pair in scope.get("query_string", b"").decode("latin-1").split("&"):
        key, _, value = pair.partition("=")
        if key == "model" and value:
            return value
    return None


def serve_models(args: argparse.Namespace, models: list[str], engine_args: dict[str, Any],
                 chat_template: str | None) -> int:
    """``pagedllm serve --model A --model B ...`` or ``--models-file F``."""
    from pagedllm.engine.async_engine import multiprocessing_enabled
    from pagedllm.entrypoints.openai.model_specs import (
        check_specs,
        load_models_file,
        parse_keep_alive,
        spec_from_flag,
    )
    from pagedllm.entrypoints.openai.server import default_served_model_names, run_server
    from pagedllm.entrypoints.serve_args import server_options, uvicorn_kwargs

    keep_alive = parse_keep_alive(args.keep_alive if args.keep_alive is not None else "5m", "keep_alive")

    def default_id(path: str) -> str:
        return default_served_model_names(path)[0]

    specs = [spec_from_flag(m, default_id, engine_args, keep_alive, chat_template) for m in models]
    if args.models_file:
        specs += load_models_file(args.models_file, engine_args, keep_alive, default_id, chat_template)
    check_specs(specs, args.models_memory_budget)
    app = build_router_app(specs, server_options(args), memory_budget=args.models_memory_budget,
                           load_timeout_s=args.model_load_timeout,
                           multiprocess=multiprocessing_enabled(default=True))
    run_server(app, args.host, args.port, args.uvicorn_log_level or args.log_level, args.shutdown_timeout,
               **uvicorn_kwargs(args))
    return 0
