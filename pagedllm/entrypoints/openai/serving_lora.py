"""The adapters a server serves by name (``--lora-modules NAME=PATH``; a request's ``model``
picks one), their /v1/models cards with the base as ``parent``, and vLLM's runtime routes
/v1/load_lora_adapter and /v1/unload_lora_adapter (only with --allow-runtime-lora-updating;
behind the API key like every /v1 route). Unloading an adapter that requests still use is
refused (400): they finish on it."""
from __future__ import annotations

import itertools
import json

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm import LoRARequest
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.openai.api_errors import APIError
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.errors import ValidationError


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH``, or vLLM's JSON form ``{"name": ..., "path": ...}``: (name, path)."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            pass
    elif "=" in value:
        name, _, path = value.partition("=")
        if name and path:
            return name, path
    raise ValidationError(f"--lora-modules {value!r}: give NAME=PATH (or a JSON object with name "
                          "and path)", "lora_modules")


class LoRAModules:
    """Name -> LoRARequest of the adapters served (the dict the handlers read)."""

    def __init__(self, llm: AsyncLLM, base_name: str) -> None:
        self.llm, self.base_name = llm, base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def load_at_start(self, modules: tuple[str, ...]) -> None:
        """--lora-modules, loaded before the engine loop starts (a bad adapter stops the start)."""
        for value in modules:
            name, path = parse_lora_module(value)
            request = LoRARequest(name, next(self._ids), path)
            self.llm.engine.add_lora(request)
            self.by_name[name] = request

    async def load(self, name: str, path: str) -> None:
        if name in self.by_name or name == self.base_name:
            raise APIError(400, f"the LoRA adapter {name!r} is already loaded", "lora_name")
        request = LoRARequest(name, next(self._ids), path)
        await self.llm.add_lora(request)  # ValidationError (400) with nothing loaded if it does not fit
        self.by_name[name] = request

    async def unload(self, name: str) -> None:
        request = self.by_name.get(name)
        if request is None:
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name")
        await self.llm.remove_lora(request.lora_int_id)  # refused (400) while requests use it
        del self.by_name[name]

    def model_cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=r.lora_path, parent=self.base_name, max_model_len=max_model_len)
                for name, r in self.by_name.items()]


def lora_router(modules: LoRAModules) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> str:
        await modules.load(request.lora_name, request.lora_path)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> str:
        await modules.unload(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    return router
