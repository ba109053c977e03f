"""API keys: which routes need one, and the per-key prefix-cache salt.

With ``--api-key K1 [K2 ...]`` every route needs ``Authorization: Bearer <one of the keys>``
except the few that are open on purpose (:data:`OPEN_PATHS`): liveness and version probes that
load balancers and orchestrators call without credentials, the Prometheus scrape (aggregate
counters, no request content), and the API's own description. Everything that reads or changes
state (``/v1/*``, ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache`` and any route added
later) is closed by default, so a new route cannot be left open by forgetting it.

A request with more than one ``Authorization`` header is refused (400): servers and proxies
disagree on which one counts, and that disagreement is how checks get bypassed.

``--cache-salt-per-key``: the prefix cache is shared by every request, so a client can learn
whether someone else sent a prompt prefix from ``usage.prompt_tokens_details.cached_tokens`` or
from the time to first token. Salting each key's requests with a value derived from the key (and
the request's own ``cache_salt``) gives each key its own cache namespace.
"""
from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.anthropic.protocol import error_json
from pagedllm.entrypoints.openai.api_errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics",
                        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                        # The dashboard's page and files hold no data: its stream needs the key,
                        # which the page sends from its key field.
                        "/dashboard"})
OPEN_PREFIXES = ("/dashboard/static/",)
KEY_SALT_STATE = "pagedllm_key_salt"  # request.state field that carries the key's salt


def key_salt(api_key: str) -> str:
    """A salt that names the key without revealing it (it may appear in logs or stats)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def combine_salt(key: str | None, request_salt: str | None) -> str | None:
    if key is None:
        return request_salt
    return key if request_salt is None else f"{key}:{request_salt}"


def route_path(scope: Scope) -> str:
    """The path the app routes on: uvicorn keeps --root-path as a prefix of ``path``."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def error_responder(scope: Scope) -> Callable[[int, str], JSONResponse]:
    """Anthropic's routes answer in their own error shape, the rest in OpenAI's."""
    return error_json if route_path(scope).startswith("/v1/messages") else error_response


class APIKeyMiddleware:
    """Plain ASGI (streaming and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], salt_per_key: bool = False) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.salts = [key_salt(k) for k in api_keys]
        self.salt_per_key = salt_per_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        reject = error_responder(scope)
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        # Anthropic's clients send the key as x-api-key: the same key, another header.
        api_keys = [b"Bearer " + v for k, v in scope["headers"] if k == b"x-api-key"]
        if len(values) > 1 or len(api_keys) > 1 or (values and api_keys and values != api_keys):
            await reject(400, "more than one Authorization or x-api-key header")(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        got = (values or api_keys or [b""])[0]
        # Compare with every key, so the time taken does not say which key was close.
        matches = [secrets.compare_digest(got, e) for e in self.expected]
        if not any(matches):
            await reject(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                              "(or 'x-api-key: <key>')")(scope, receive, send)
            return
        if self.salt_per_key:
            scope.setdefault("state", {})[KEY_SALT_STATE] = self.salts[matches.index(True)]
        await self.app(scope, receive, send)
