"""One error shape per protocol, for every route of it and every failure.

Every error the service sends, whatever raised it (our validation, Starlette's routing, a
dead engine worker, a bug), is an `APIError` rendered in the shape of the protocol whose
route it came from: the handler picks the `ErrorShape` registered for the longest prefix of
the request's path (`register_error_shape`), OpenAI's by default:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_type"}}

`type` is one of OpenAI's: `invalid_request_error` (400, 404, 405, 413, 415), `authentication_error`
(401), `rate_limit_error` (429: the queue is full, retry later), `server_error` (500 for a bug,
503 when the engine is restarting or overloaded). 429 and 503 carry `Retry-After`. A client
error never reaches the 500 path: `install_error_handlers` turns Starlette's own 404 / 405 and
pydantic's errors into this shape, and anything else into a 500 that names no internals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("labkit.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error"}


@dataclass
class APIError(Exception):
    """An error answer. Raise it anywhere in a route; the handler sends it as JSON."""

    status: int
    message: str
    code: str
    param: str | None = None
    retry_after: float | None = None        # seconds, for 429 and 503
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.status not in ERROR_TYPES:
            raise ValueError(f"no error type for status {self.status}")

    @property
    def type(self) -> str:
        return ERROR_TYPES[self.status]

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, shape: ErrorShape | None = None) -> JSONResponse:
        """The answer in `shape` (OpenAI's by default), with Retry-After for 429 and 503."""
        shape = shape or OPENAI_ERRORS
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return JSONResponse(shape.body(self), status_code=shape.status(self), headers=headers)


class ErrorShape(Protocol):
    """How one protocol writes an error: its body, and the status it sends for it."""

    def body(self, error: APIError) -> dict: ...
    def status(self, error: APIError) -> int: ...


class OpenAIErrors:
    def body(self, error: APIError) -> dict:
        return error.body()

    def status(self, error: APIError) -> int:
        return error.status


OPENAI_ERRORS = OpenAIErrors()


def register_error_shape(app: FastAPI, prefix: str, shape: ErrorShape) -> None:
    """Errors on paths that start with `prefix` (and not with a longer registered one) get `shape`."""
    app.state.error_shapes = {**getattr(app.state, "error_shapes", {}), prefix: shape}


def shape_for(request: Request) -> ErrorShape:
    state = getattr(request.scope.get("app"), "state", None)
    shapes: dict[str, ErrorShape] = getattr(state, "error_shapes", {})
    path = request.url.path
    matches = [prefix for prefix in shapes if path == prefix or path.startswith(prefix.rstrip("/") + "/")]
    return shapes[max(matches, key=len)] if matches else OPENAI_ERRORS


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response(shape_for(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            answer = APIError(404, f"no route {request.url.path}", "unknown_route")
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("Allow") or (error.headers or {}).get("allow")
            answer = APIError(405, f"{request.method} is not allowed on {request.url.path}"
                              + (f" (allowed: {allowed})" if allowed else ""), "method_not_allowed",
                              headers={"Allow": allowed} if allowed else {})
        elif error.status_code in ERROR_TYPES:
            answer = APIError(error.status_code, str(error.detail), "http_error")
        else:
            answer = APIError(400, str(error.detail), "http_error")
        return answer.response(shape_for(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # Routes parse their own bodies; this covers query and path parameters.
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return invalid(first.get("msg", "invalid request"), param).response(shape_for(request))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        answer = APIError(500, "the server failed on this request; it has been logged", "internal_error").response(
            shape_for(request))
        request_id = request.scope.get("state", {}).get("request_id")  # labkit.serve.access; this
        if request_id is not None:                                     # handler runs outside it
            answer.headers["X-Request-Id"] = request_id
        return answer
