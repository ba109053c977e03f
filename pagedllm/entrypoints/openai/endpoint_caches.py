"""FastAPI keeps facts about each endpoint function in module-level LRU caches; those entries keep a
stopped app's endpoints, and through their closures its engine, alive. Clearing them when an app
stops (or a model unloads) lets the engine's weights and KV cache go."""
from __future__ import annotations


def forget_endpoints() -> None:
    """Clear FastAPI's per-endpoint caches (they only memoize: they refill on the next request)."""
    import fastapi.dependencies.models as dependency_models

    for value in vars(dependency_models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
