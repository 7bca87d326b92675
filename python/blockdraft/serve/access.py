"""Who may call the server and how much they may send, checked before any route runs.

:class:`AccessGuard` is an ASGI middleware in front of the app:

* **API key.** With a key set, every route except ``/health`` (and ``/metrics`` when
  public) needs ``Authorization: Bearer <key>``; the SHA-256 digests of the given and the
  expected key are compared with :func:`hmac.compare_digest`, so the time an answer takes
  tells neither how much of a guess was right nor how long the key is. Anything else is a
  401 in OpenAI's shape (``code`` ``"invalid_api_key"``), sent before the body is read.
* **Body size.** A request whose ``Content-Length`` is past the limit is a 413 before any
  of its body is read; a body without one (chunked) is counted while it arrives and is a 413
  the moment it passes the limit. Only a body within the limit reaches the app, which then
  reads it from memory. Nothing is parsed before this check.

Each refusal is reported to ``on_refused`` (the server counts them in
``blockdraft_refused_requests_total{reason}``).

It is pure ASGI (no Starlette ``BaseHTTPMiddleware``), so streamed answers and the
disconnect messages the routes listen for pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockdraft.serve.errors import APIError, too_large, unauthorized

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request body the server reads by default (4 MiB: far more than a prompt of a
model's whole context as text or token ids needs)."""


class AccessGuard:
    """The API key and body-size checks around ``app``.

    Args:
        app: the ASGI app behind the checks.
        api_key: the key clients must send (``None``: no key needed).
        max_body_bytes: the largest request body read (>= 1).
        open_paths: paths served without a key.
        on_refused: called with ``"unauthorized"`` or ``"too_large"`` for each refused request.

    Raises:
        ValueError: an empty key or ``max_body_bytes < 1``.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 open_paths: Collection[str] = ("/health",),
                 on_refused: Callable[[str], None] | None = None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, not {max_body_bytes}")
        self.app = app
        self._digest = _digest(api_key.encode()) if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if self._digest is not None and scope["path"] not in self.open_paths:
            given = _bearer(headers.get(b"authorization"))
            if given is None or not hmac.compare_digest(_digest(given), self._digest):
                await self._refuse(scope, receive, send, "unauthorized", unauthorized(given is not None))
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send, "too_large", too_large(self.max_body_bytes))
            return
        body = await self._read(receive)
        if body is None:
            await self._refuse(scope, receive, send, "too_large", too_large(self.max_body_bytes))
            return
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, reason: str, err: APIError) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)
        await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body's messages, counted as they arrive; ``None`` once they pass the limit
        (the rest is never read). A disconnect ends the body early: the app sees it next."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The request headers by lower-case name (the last of a repeated one)."""
    return {name.lower(): value for name, value in scope.get("headers", [])}


def _bearer(value: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case)."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out ``messages`` first, then whatever ``receive`` gets."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed



__all__ = ["DEFAULT_MAX_BODY_BYTES", "AccessGuard"]
