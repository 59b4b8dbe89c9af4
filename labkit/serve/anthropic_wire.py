"""Anthropic's Messages API on the wire: its error shape (its answers come with its routes).

Errors are Anthropic's documented shape, `{"type": "error", "error": {"type", "message"}}`,
with its status mapping (https://docs.claude.com/en/api/errors): 400 invalid_request_error
(also for the other 4xx it does not list: 405, 415), 401 authentication_error,
403 permission_error, 404 not_found_error, 413 request_too_large, 429 rate_limit_error,
500 api_error, 529 overloaded_error. labkit's 503s that mean "too busy now, retry"
(a full queue, an unreachable deadline, an engine that is starting or restarting, a server
that drains) are sent as 529 overloaded_error; any other 503 (an engine failure) as
500 api_error. Retry-After stays on both.
"""

from __future__ import annotations

from labkit.serve.errors import APIError

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 529: "overloaded_error"}
OVERLOADED_CODES = frozenset({"queue_full", "deadline_unreachable", "engine_unavailable", "server_draining"})


class AnthropicErrors:
    """labkit's `APIError` in Anthropic's shape (an `ErrorShape`, labkit.serve.errors)."""

    def status(self, error: APIError) -> int:
        if error.status == 503:
            return 529 if error.code in OVERLOADED_CODES else 500
        return error.status if error.status in ANTHROPIC_ERROR_TYPES else 400

    def body(self, error: APIError) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES[self.status(error)],
                                           "message": error.message}}


ANTHROPIC_ERRORS = AnthropicErrors()
