"""The FastAPI app: OpenAI's endpoints over one engine.

| route | answer |
| --- | --- |
| ``POST /v1/completions`` | a text completion (``stream: true``: server-sent chunks) |
| ``POST /v1/chat/completions`` | a chat completion (``stream: true``: server-sent chunks) |
| ``GET /v1/models`` | the one model served |
| ``GET /health`` | 200 once warmed up while the engine loop runs; 503 "warming up" before |
| ``GET /metrics`` | Prometheus text (:mod:`blockdraft.serve.metrics`) |

Before any route, :class:`~blockdraft.serve.access.AccessGuard` checks the API key (every
route but ``/health``, and ``/metrics`` unless public, when a key is set) and the body size.

The app owns its engine loop: the lifespan's start-up starts it, its shutdown cancels what is
left, closes the engine and logs the pools' final state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from blockdraft.engine import SpeculativeEngine
from blockdraft.serve.access import DEFAULT_MAX_BODY_BYTES, AccessGuard
from blockdraft.serve.chat import ChatFormat
from blockdraft.serve.errors import APIError
from blockdraft.serve.generation import Service
from blockdraft.serve.loop import EngineLoop
from blockdraft.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """How the server behaves around the engine.

    Attributes:
        model_name: the id in ``/v1/models``; requests naming another model get 404.
        max_queue: the most requests waiting beyond those the next step can start (then
            429).
        retry_after_s: the ``Retry-After`` of a 429.
        builtin_chat: the tokenizer is the built-in pair's: chat continues the last user
            message as code.
        stop_timeout_s: how long shutdown waits for the engine loop to close.
        warmup: warm the engine up (:meth:`~blockdraft.SpeculativeEngine.warmup`) on the
            engine loop before the first request; ``/health`` answers 503 "warming up" until
            it ends (``blockdraft serve`` turns it on unless ``--no-warmup``).
        warmup_progress: ``progress(done, total)`` during the warm-up.
        api_key: the key every route but ``/health`` needs as ``Authorization: Bearer
            <key>`` (``None``: none; never shown in the config's repr).
        public_metrics: with a key, serve ``/metrics`` without it too.
        max_body_bytes: the largest request body read; a larger one is a 413.

    Raises:
        ValueError: an empty ``api_key`` or ``max_body_bytes < 1``.
    """

    model_name: str
    max_queue: int = 64
    retry_after_s: int = 1
    builtin_chat: bool = False
    stop_timeout_s: float = 60.0
    warmup: bool = False
    warmup_progress: Callable[[int, int], None] | None = None
    api_key: str | None = field(default=None, repr=False)
    public_metrics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, not {self.max_body_bytes}")


def create_app(engine: SpeculativeEngine, tokenizer: Any, config: ServeConfig) -> FastAPI:
    """The server for ``engine`` (which, once the app starts, only the app's loop touches).

    Raises:
        ValueError: ``config.max_queue < 0``.
    """
    metrics = ServeMetrics()
    loop = EngineLoop(engine, metrics, max_queue=config.max_queue,
                      retry_after_s=config.retry_after_s, warmup=config.warmup,
                      progress=config.warmup_progress)
    service = Service(loop, tokenizer, ChatFormat(tokenizer, builtin=config.builtin_chat),
                      metrics, config.model_name, engine.max_seq_len)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop, config.stop_timeout_s)

    app = FastAPI(title="blockdraft", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service
    app.state.loop = loop
    app.state.metrics = metrics
    app.state.config = config
    app.add_middleware(AccessGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       open_paths=("/health", "/metrics") if config.public_metrics else ("/health",),
                       on_refused=metrics.refuse)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        err = APIError(exc.status_code, str(exc.detail), code=_slug(str(exc.detail)))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("blockdraft serve: %s %s failed", request.method, request.url.path)
        # The client learns that it failed, not where: the log has the message and traceback.
        err = APIError(500, f"internal server error ({type(exc).__name__}); the server log has "
                       "the details", type="server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.handle(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": created,
            "owned_by": "blockdraft", "max_model_len": engine.max_seq_len,
        }]}

    @app.get("/health")
    async def health() -> Response:
        if loop.warming:
            return JSONResponse({"status": "warming up"}, status_code=503)
        if loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def _slug(text: str) -> str:
    return "_".join(text.lower().split()) or "error"


__all__ = ["ServeConfig", "create_app"]
