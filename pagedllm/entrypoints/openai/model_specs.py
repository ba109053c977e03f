"""The models one server serves: ``--model A --model B`` or ``--models-file models.yaml|json``.

A models file holds ``{"models": [{"id", "model", "engine_args", "keep_alive", "pinned",
"chat_template", "memory_bytes"}, ...]}`` (only ``model`` is required; ``id`` defaults to the
folder's name). ``keep_alive``: seconds of idle time before the model is unloaded (a number, or
"30s", "5m", "1h"; negative or "forever": never). ``memory_bytes``: what the model counts against
``--models-memory-budget``; by default its weight files plus its KV cache."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.errors import ValidationError

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's five minutes
DEFAULT_KV_CACHE_BYTES = 1 << 30  # the CPU engine's default KV cache
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
_SPEC_KEYS = {"id", "model", "engine_args", "keep_alive", "pinned", "chat_template", "memory_bytes"}


@dataclass(frozen=True)
class ModelSpec:
    id: str
    model: str  # a folder (or what the engine accepts as a model)
    engine_args: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S  # None: never unloaded for idleness
    pinned: bool = False  # loaded at start and never unloaded
    chat_template: str | None = None
    memory_bytes: int | None = None

    def estimated_bytes(self) -> int:
        """What the model counts against the memory budget: given, or weights plus KV cache."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        path = Path(self.model)
        files = [path] if path.is_file() else (list(path.iterdir()) if path.is_dir() else [])
        weights = sum(p.stat().st_size for p in files if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
        return weights + int(self.engine_args.get("kv_cache_memory_bytes") or DEFAULT_KV_CACHE_BYTES)


def parse_keep_alive(value: Any, where: str = "keep_alive") -> float | None:
    if value is None or value == "forever":
        return None
    if isinstance(value, str) and value and value[-1] in _UNITS:
        number, scale = value[:-1], _UNITS[value[-1]]
    else:
        number, scale = value, 1.0
    try:
        seconds = float(number) * scale
    except (TypeError, ValueError):
        raise ValidationError(f"{where} must be seconds, or like 30s, 5m, 1h, or forever; got {value!r}",
                              where) from None
    return None if seconds < 0 else seconds


def parse_bytes(value: str) -> int:
    """``--models-memory-budget``: bytes, or with a unit (512MiB, 8GiB, 8GB)."""
    text = value.strip().lower().replace(" ", "")
    for unit, scale in sorted(_SIZE_UNITS.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            text, factor = text[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        return int(float(text) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (bytes, or like 512MiB, 8GiB)") from None


def spec_from_flag(value: str, default_id: Any, engine_args: dict[str, Any], keep_alive_s: float | None,
                   chat_template: str | None) -> ModelSpec:
    """``--model PATH`` or ``--model ID=PATH``; ``default_id(path)``: the id of a bare path."""
    model_id, sep, path = value.partition("=")
    if not sep or "/" in model_id or not model_id:
        model_id, path = default_id(value), value
    return ModelSpec(model_id, path, dict(engine_args), keep_alive_s, chat_template=chat_template)


def load_models_file(path: str, engine_args: dict[str, Any], keep_alive_s: float | None,
                     default_id: Any, chat_template: str | None) -> list[ModelSpec]:
    """The specs of a models file; ``engine_args``: the launch line's, which each model's own
    override; ``default_id(path)``: the id of a model that gives none."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValidationError(f"{path}: expected {{'models': [{{'model': ...}}, ...]}}", "models_file")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValidationError(f"{path}: models[{i}] needs a 'model' (a path)", "models_file")
        unknown = sorted(set(entry) - _SPEC_KEYS)
        if unknown:
            raise ValidationError(f"{path}: models[{i}] has unknown keys {unknown}; known: "
                                  f"{sorted(_SPEC_KEYS)}", "models_file")
        specs.append(ModelSpec(
            id=str(entry.get("id") or default_id(entry["model"])), model=entry["model"],
            engine_args={**engine_args, **(entry.get("engine_args") or {})},
            keep_alive_s=parse_keep_alive(entry["keep_alive"], f"models[{i}].keep_alive")
            if "keep_alive" in entry else keep_alive_s,
            pinned=bool(entry.get("pinned", False)),
            chat_template=entry.get("chat_template", chat_template), memory_bytes=entry.get("memory_bytes")))
    return specs


def check_specs(specs: list[ModelSpec], memory_budget: int | None) -> None:
    ids = [s.id for s in specs]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValidationError(f"two models share the id {duplicates[0]!r}; name them with --model ID=PATH "
                              "or an 'id' in the models file", "model")
    if memory_budget is not None:
        for spec in specs:
            if spec.estimated_bytes() > memory_budget:
                raise ValidationError(f"model {spec.id!r} needs about {spec.estimated_bytes()} bytes, more than "
                                      f"--models-memory-budget {memory_budget}", "models_memory_budget")
        pinned = sum(s.estimated_bytes() for s in specs if s.pinned)
        if pinned > memory_budget:
            raise ValidationError(f"the pinned models need about {pinned} bytes, more than "
                                  f"--models-memory-budget {memory_budget}", "models_memory_budget")


def add_multi_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models-file", default=None,
                   help="a YAML or JSON file naming several models to serve (id, model, engine_args, "
                        "keep_alive, pinned); see docs/serving.md")
    p.add_argument("--keep-alive", default=None,
                   help="with several models: idle time before a model is unloaded (seconds, or 30s, "
                        "5m, 1h, forever; default: 5m)")
    p.add_argument("--models-memory-budget", type=parse_bytes, default=None,
                   help="with several models: most bytes of loaded models (weights plus KV cache); "
                        "the least recently used idle model is unloaded to make room")
    p.add_argument("--model-load-timeout", type=float, default=600.0,
                   help="with several models: seconds a request waits for its model to load (default: 600)")
