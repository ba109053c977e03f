"""Several models behind one server: each an engine core of its own, loaded on its first request
(or at start when pinned), unloaded after its keep-alive of idle time, and, when loading one
would exceed the memory budget, the least recently used idle model is unloaded first.

A request takes its model with ``acquire`` (waiting, with a bound, while it loads) and gives it
back with ``release``; a model with requests in flight or waiting is never unloaded, so no
request is lost to an unload. Loads and unloads of one model hold its lock, so a request that
arrives while its model unloads waits and loads it again."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.api_errors import APIError
from pagedllm.entrypoints.openai.model_specs import ModelSpec

logger = logging.getLogger("pagedllm.entrypoints.models")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"


@dataclass
class LoadedModel:
    """What loading a model gives: its engine (an AsyncLLM) and the app that serves it."""
    llm: Any
    app: Any


@dataclass
class ServedModel:
    spec: ModelSpec
    state: str = UNLOADED
    loaded: LoadedModel | None = None
    last_used: float = 0.0
    num_active: int = 0  # requests being served
    num_waiting: int = 0  # requests waiting for the load
    num_loads: int = 0
    num_unloads: int = 0
    error: str | None = None  # the last load's failure
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    load_task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        return self.num_active > 0 or self.num_waiting > 0


class ModelPool:
    def __init__(self, specs: list[ModelSpec], load: Callable[[ModelSpec], Awaitable[LoadedModel]],
                 memory_budget: int | None = None, load_timeout_s: float = 600.0,
                 forget: Callable[[], None] | None = None) -> None:
        """``forget``: drops what outlives an unloaded model elsewhere (caches holding its app)."""
        self.models = {spec.id: ServedModel(spec) for spec in specs}
        self.default_id = specs[0].id
        self._load_fn = load
        self._forget = forget
        self.memory_budget = memory_budget
        self.load_timeout_s = load_timeout_s
        self._released = asyncio.Condition()
        self._reaper: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the pinned models; start unloading idle ones."""
        for served in self.models.values():
            if served.spec.pinned:
                await self._ensure_loaded(served)
        if any(s.spec.keep_alive_s is not None and not s.spec.pinned for s in self.models.values()):
            self._reaper = asyncio.get_running_loop().create_task(self._reap_idle(), name="pagedllm-models")

    async def shutdown(self) -> None:
        """Stop every engine (and its core process). Idempotent."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        for served in self.models.values():
            if served.load_task is not None and not served.load_task.done():
                await asyncio.gather(served.load_task, return_exceptions=True)
            await self._unload(served)

    # -- requests ------------------------------------------------------------------------------
    async def acquire(self, model_id: str | None, load: bool = True) -> ServedModel:
        """The model, loaded (``load`` false: only if it is loaded already, else a 503)."""
        served = self.models.get(model_id or self.default_id)
        if served is None:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{', '.join(repr(i) for i in self.models)}", "model")
        if not load and served.state != LOADED:
            raise APIError(503, f"the model {served.spec.id!r} is not loaded; a request to it loads it", "model")
        if served.state == LOADED and served.loaded is not None and served.loaded.llm.errored and not served.busy:
            await self._unload(served, only_if_idle=True)  # a dead engine: the request loads a fresh one
        served.num_waiting += 1
        try:
            if served.state != LOADED:
                await self._ensure_loaded(served)
        finally:
            served.num_waiting -= 1
        served.num_active += 1
        served.last_used = time.monotonic()
        return served

    async def release(self, served: ServedModel) -> None:
        served.num_active -= 1
        served.last_used = time.monotonic()
        async with self._released:
            self._released.notify_all()

    async def unload(self, model_id: str) -> None:
        """Unload the model now if no request uses it (its next request loads it again)."""
        await self._unload(self.models[model_id], only_if_idle=True)

    async def _ensure_loaded(self, served: ServedModel) -> None:
        """Wait (at most the load timeout) for the model's load, starting it if none runs."""
        if served.load_task is None or served.load_task.done():
            served.load_task = asyncio.ensure_future(self._load(served))
        try:
            await asyncio.wait_for(asyncio.shield(served.load_task), self.load_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(503, f"the model {served.spec.id!r} did not load within {self.load_timeout_s:g} s "
                                "(--model-load-timeout); it is still loading, try again", "model") from None
        if served.state != LOADED:
            raise APIError(503, f"the model {served.spec.id!r} failed to load: {served.error}", "model")

    async def _load(self, served: ServedModel) -> None:
        async with served.lock:
            if served.state == LOADED:
                return
            await self._make_room(served)
            served.state, served.error = LOADING, None
            started = time.monotonic()
            try:
                served.loaded = await self._load_fn(served.spec)
            except Exception as e:  # noqa: BLE001 - the requests get the reason; the server goes on
                logger.exception("loading model %r failed", served.spec.id)
                served.state, served.error = UNLOADED, f"{type(e).__name__}: {e}"
                return
            served.state, served.last_used = LOADED, time.monotonic()
            served.num_loads += 1
            logger.info("model %r loaded in %.1f s", served.spec.id, served.last_used - started)

    async def _unload(self, served: ServedModel, only_if_idle: bool = False) -> None:
        async with served.lock:
            if served.loaded is None or (only_if_idle and served.busy):
                return  # a request took it meanwhile
            served.state = UNLOADING
            loaded, served.loaded = served.loaded, None
            try:
                await loaded.llm.shutdown()
            finally:
                del loaded
                # No collection here: the engine's shutdown let go of its weights and KV cache, and
                # a full pass over every other model's objects would stall this switch.
                if self._forget is not None:
                    self._forget()
                served.state = UNLOADED
                served.num_unloads += 1
                logger.info("model %r unloaded", served.spec.id)
        async with self._released:  # a load waiting for room may fit now
            self._released.notify_all()

    # -- memory budget and keep-alive ----------------------------------------------------------
    def resident_bytes(self, exclude: ServedModel | None = None) -> int:
        return sum(s.spec.estimated_bytes() for s in self.models.values()
                   if s is not exclude and s.state in (LOADING, LOADED, UNLOADING))

    async def _make_room(self, served: ServedModel) -> None:
        """Unload least recently used idle models until ``served`` fits the budget; wait for a
        busy one to go idle if nothing idle is left."""
        if self.memory_budget is None:
            return
        need = served.spec.estimated_bytes()
        while self.resident_bytes(exclude=served) + need > self.memory_budget:
            idle = [s for s in self.models.values()
                    if s is not served and s.state == LOADED and not s.busy and not s.spec.pinned]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                logger.info("unloading model %r to make room for %r (--models-memory-budget)",
                            victim.spec.id, served.spec.id)
                await self._unload(victim, only_if_idle=True)
                continue
            async with self._released:  # every other model is busy or pinned: wait for a release
                try:
                    await asyncio.wait_for(self._released.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

    async def _reap_idle(self) -> None:
        keep_alives = [s.spec.keep_alive_s for s in self.models.values() if s.spec.keep_alive_s is not None]
        tick = min(5.0, max(0.05, min(keep_alives) / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for served in self.models.values():
                keep_alive = served.spec.keep_alive_s
                if (served.state == LOADED and not served.busy and not served.spec.pinned
                        and keep_alive is not None and now - served.last_used >= keep_alive):
                    await self._unload(served, only_if_idle=True)
