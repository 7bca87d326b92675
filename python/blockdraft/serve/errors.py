"""Errors the server answers with, in the OpenAI API's shape:
``{"error": {"message", "type", "param", "code"}}``.

A message never carries a traceback or a file path: what a failure inside the server says
reaches a client through :func:`public_reason` (its first line, paths masked); the log has
the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# An absolute POSIX path of two parts or more not inside a URL (no word character, colon or
# slash before it), or a Windows drive path.
_PATH = re.compile(r"(?<![\w:/.])/(?:[\w.@+-]+/)+[\w.@+-]*|\b[A-Za-z]:\\[^\s'\"]+")
_MAX_REASON = 300


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI-style body.

    Args:
        status: the HTTP status (400 bad input, 401 no or a wrong API key, 404 unknown
            model, 413 a body too large, 429 queue full, 500 a failure while generating, 503
            out of device memory or shutting down).
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


def public_reason(text: str) -> str:
    """What a client may read of an internal failure's message: its first line, file paths
    replaced by ``<path>``, at most a few hundred characters."""
    lines = text.strip().splitlines()
    line = _PATH.sub("<path>", lines[0] if lines else "unknown error")
    return line if len(line) <= _MAX_REASON else line[: _MAX_REASON - 3] + "..."


def server_error(message: str) -> APIError:
    """A 500: generation failed inside the engine (``message`` as :func:`public_reason`
    leaves it)."""
    return APIError(500, public_reason(message), type="server_error", code="internal_error")


def generation_failed(reason: str | None, *, out_of_memory: bool = False) -> APIError:
    """The answer of a request the engine ended with an error: 503 ``out_of_memory`` when the
    device ran out of memory for it (a later or smaller request may fit), else 500."""
    why = public_reason(reason or "unknown error")
    if out_of_memory:
        return APIError(503, f"the server ran out of device memory for this request ({why}); "
                        "retry later, or with a shorter prompt or fewer max_tokens",
                        type="server_error", code="out_of_memory")
    return server_error(f"generation failed: {why}")


def unauthorized(given: bool) -> APIError:
    """A 401, as OpenAI answers a missing or wrong API key."""
    message = ("incorrect API key provided" if given else
               "no API key provided: send it in an Authorization header as 'Bearer <key>'")
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int) -> APIError:
    """A 413: the request body is past the server's limit."""
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


def queue_full(max_queue: int, retry_after_s: int) -> APIError:
    return APIError(
        429, f"the server is at capacity: {max_queue} requests are already waiting; retry later",
        type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="unavailable")


__all__ = ["APIError", "generation_failed", "invalid", "public_reason", "queue_full",
           "server_error", "too_large", "unauthorized", "unavailable"]
