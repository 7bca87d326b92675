"""Server-sent events: the ``data: ...`` framing and a response that notices a client leaving.

Starlette's own streaming response, under ASGI 2.4 servers, learns of a disconnect only when
its next write fails; a request still waiting for pages writes nothing for a long time and
would hold its place in the queue. :class:`EventStream` listens for the disconnect the whole
time and cancels the producer at once, so its ``finally`` cancels the engine request.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(data: Any) -> str:
    """One SSE event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response whose producer is cancelled when the client goes."""

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def produce() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(produce)
                group.start_soon(watch)
        finally:
            # Cancelled between two events, the producer sits at a ``yield``: close it now
            # (its ``finally`` gives the request back) rather than whenever it is collected.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


__all__ = ["DONE", "EventStream", "event"]
