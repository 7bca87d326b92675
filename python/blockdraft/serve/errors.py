"""Errors the server answers with, in the OpenAI API's shape:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI-style body.

    Args:
        status: the HTTP status (400 bad input, 404 unknown model, 429 queue full, 500 a
            failure while generating, 503 shutting down).
        message: what is wrong, in words a client can act on.
        type: OpenAI's error ``type`` (``invalid_request_error``, ``rate_limit_error``,
            ``server_error``).
        code: a short machine-readable name of the problem.
        param: the request field at fault, if one is.
        headers: extra response headers (``Retry-After`` on 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(400, message, code=code, param=param)


def server_error(message: str) -> APIError:
    """A 500: generation failed inside the engine."""
    return APIError(500, message, type="server_error", code="internal_error")


def queue_full(max_queue: int, retry_after_s: int) -> APIError:
    return APIError(
        429, f"the server is at capacity: {max_queue} requests are already waiting; retry later",
        type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="unavailable")


__all__ = ["APIError", "invalid", "queue_full", "server_error", "unavailable"]
