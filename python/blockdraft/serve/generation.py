"""One generation request from its body to its answer: checks against the model, submission,
then either one JSON answer or a stream of chunks.

Whatever way an answer ends (finished, a stop string, an error, the client leaving, the
server closing), the engine request is cancelled if it still runs, so its pages come back,
and the outcome is counted once in ``blockdraft_requests_total``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from blockdraft.pair.checks import context_problem
from blockdraft.serve.chat import ChatFormat
from blockdraft.serve.errors import APIError, invalid, server_error
from blockdraft.serve.loop import EngineLoop, Submission, Ticket
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.protocol import DEFAULT_COMPLETION_TOKENS, GenerationRequest, Kind, parse_json, parse_request
from blockdraft.serve.responses import Head, chunk, meta_info, response, usage, usage_chunk
from blockdraft.serve.sse import DONE, EventStream, event
from blockdraft.serve.text import TextStream

STATUS_OF_ERROR = {400: "invalid", 404: "invalid", 429: "rejected", 500: "error", 503: "unavailable"}


def outcome_of(err: APIError) -> str:
    """The ``blockdraft_requests_total`` status of an answer that ended in ``err``."""
    return "cancelled" if err.code == "cancelled" else STATUS_OF_ERROR.get(err.status, "error")


@dataclass
class Service:
    """What the generation endpoints share: the loop, the tokenizer, the model's limits."""

    loop: EngineLoop
    tokenizer: Any
    chat: ChatFormat
    metrics: ServeMetrics
    model_name: str
    max_seq_len: int

    def __post_init__(self) -> None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.stop_ids = (eos,) if isinstance(eos, int) else ()

    async def handle(self, http: Request, kind: Kind) -> Response:
        """Answer one ``/v1/completions`` or ``/v1/chat/completions`` request.

        Raises:
            APIError: the request is refused (counted in the metrics).
        """
        try:
            req = parse_request(kind, parse_json(await http.body()))
            if req.model is not None and req.model != self.model_name:
                raise APIError(404, f"the model {req.model!r} does not exist; this server "
                               f"serves {self.model_name!r}", code="model_not_found", param="model")
            ids = self._prompt_ids(req)
            sub = Submission(ids, self._max_new(req, len(ids)), req.sampling, self.stop_ids, req.seed)
            ticket = self.loop.submit(sub)
            try:
                await ticket.admitted()
            except BaseException:
                self.loop.cancel(ticket)
                raise
        except APIError as err:
            self.metrics.count(outcome_of(err))
            raise
        run = _Run(self, ticket, req, Head.new(kind, self.model_name), len(ids))
        if req.stream:
            return EventStream(run.events())
        return await run.answer(http)

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.messages is not None:
            ids = self.chat.render(req.messages)
        elif isinstance(req.prompt, str):
            ids = list(self.tokenizer.encode(req.prompt))
        else:
            ids = list(req.prompt or [])
        if not ids:
            raise invalid("the prompt is empty (it encodes to no tokens)",
                          "messages" if req.messages is not None else "prompt")
        return ids

    def _max_new(self, req: GenerationRequest, prompt_tokens: int) -> int:
        limit = self.max_seq_len
        where = "messages" if req.messages is not None else "prompt"
        problem = context_problem(prompt_tokens, req.max_tokens, limit,
                                  limit_name="this model's context", new_name="max_tokens")
        if problem is not None:
            raise invalid(problem, where if prompt_tokens >= limit else "max_tokens",
                          code="context_length_exceeded")
        if req.max_tokens is None:
            return (min(DEFAULT_COMPLETION_TOKENS, limit - prompt_tokens) if req.kind == "completion"
                    else limit - prompt_tokens)
        return req.max_tokens


class _Run:
    """One admitted request on its way to the client."""

    def __init__(self, svc: Service, ticket: Ticket, req: GenerationRequest, head: Head,
                 prompt_tokens: int) -> None:
        self.svc = svc
        self.ticket = ticket
        self.req = req
        self.head = head
        self.prompt_tokens = prompt_tokens
        self.text = TextStream(svc.tokenizer, req.stop)
        self.completion_tokens = 0
        self.steps: list[int] = []
        self.finish: str | None = None

    async def _piece(self) -> tuple[str, bool]:
        """The text the next update releases, and whether the answer is complete.

        Raises:
            APIError: 500 when generation failed, 503 when the server cancelled it.
        """
        upd = await self.ticket.next()
        self.completion_tokens += len(upd.tokens)
        self.steps.extend(upd.steps)
        delta = self.text.push(upd.tokens)
        if self.text.stopped:
            self.finish = "stop"
            self.svc.loop.cancel(self.ticket)
            return delta, True
        if upd.finish_reason is None:
            return delta, False
        if upd.finish_reason in ("stop", "length"):
            self.finish = upd.finish_reason
            return delta + self.text.finish(), True
        if upd.finish_reason == "error":
            raise server_error(f"generation failed: {upd.error or 'unknown error'}")
        raise APIError(503, "the server shut down before the request finished",
                       type="server_error", code="cancelled")

    def _usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)

    def _meta(self) -> dict[str, Any] | None:
        return meta_info(self.steps) if self.req.return_meta_info else None

    async def answer(self, http: Request) -> Response:
        """The whole answer as one JSON body; the request is cancelled if the client leaves."""
        work = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(_disconnected(http))
        outcome = "cancelled"
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                return Response(status_code=499)  # nobody is there to read it
            try:
                body = work.result()
            except APIError as err:
                outcome = outcome_of(err)
                raise
            assert self.finish is not None
            outcome = self.finish
            return JSONResponse(body)
        finally:
            gone.cancel()
            work.cancel()
            self.svc.loop.cancel(self.ticket)
            self.svc.metrics.count(outcome)

    async def _collect(self) -> dict[str, Any]:
        parts = []
        while True:
            delta, done = await self._piece()
            parts.append(delta)
            if done:
                assert self.finish is not None
                return response(self.head, "".join(parts), self.finish, self._usage(), self._meta())

    async def events(self) -> AsyncIterator[str]:
        """The answer as server-sent events, ending ``data: [DONE]``; a failure after the
        stream began is an ``{"error": ...}`` event."""
        with_usage = self.req.include_usage
        outcome = "cancelled"
        try:
            if self.head.kind == "chat":
                yield event(chunk(self.head, None, usage_field=with_usage))
            while True:
                try:
                    delta, done = await self._piece()
                except APIError as err:
                    outcome = outcome_of(err)
                    yield event(err.body())
                    break
                if delta:
                    yield event(chunk(self.head, delta, usage_field=with_usage))
                if done:
                    assert self.finish is not None
                    yield event(chunk(self.head, None, self.finish, usage_field=with_usage,
                                      meta=self._meta()))
                    if with_usage:
                        yield event(usage_chunk(self.head, self._usage()))
                    outcome = self.finish
                    break
            yield DONE
        finally:
            self.svc.loop.cancel(self.ticket)
            self.svc.metrics.count(outcome)


async def _disconnected(http: Request) -> None:
    """Return once the client has gone (the body is read already, so the next message the
    server sends the app is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


__all__ = ["STATUS_OF_ERROR", "Service", "outcome_of"]
