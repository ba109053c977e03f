"""Every failure as OpenAI's error object: {"error": {"message", "type", "param", "code"}}.

The handlers map pagedllm's ValidationError to 400 (naming the field), a dead engine to 503,
FastAPI's body validation (bad JSON, unknown or ill-typed fields) to 400, and anything unexpected
to 500, so a client always gets a JSON body it can parse and the server keeps serving.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedllm.errors import EngineDeadError, ValidationError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    422: "UnprocessableEntityError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers for a non-200 answer with a given status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


def exception_to_body(e: BaseException) -> ErrorResponse:
    """The error object for an exception raised while serving (used in streams too)."""
    if isinstance(e, APIError):
        return error_body(e.status, e.message, e.param)
    if isinstance(e, ValidationError):
        return error_body(400, e.message, e.param)
    if isinstance(e, EngineDeadError):
        return error_body(503, str(e))
    return error_body(500, f"internal error: {type(e).__name__}: {e}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('msg')}", None
    if first.get("type") == "missing" and not loc:
        return "the request needs a JSON body", None
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    msg = str(first.get("msg", ""))
    if first.get("type") == "value_error":  # our own check inside a validator: its message alone
        msg = msg.removeprefix("Value error, ")
    message = msg if msg.startswith(f"{where} ") else f"{where}: {msg}"  # named once
    if sum(1 for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]) > 1:
        message = f"{param}: the value matches none of the accepted types or shapes ({first.get('msg')})"
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {where!r}"
    return message, param


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    @app.exception_handler(ValidationError)
    @app.exception_handler(EngineDeadError)
    async def _on_known(_: Request, exc: Exception) -> JSONResponse:
        body = exception_to_body(exc)
        return JSONResponse(body.model_dump(), status_code=body.error.code)

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
