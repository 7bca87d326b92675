"""One generation request from its body to its answer: checks against the model, submission
of its choices (one engine request per prompt and per ``n``, :mod:`blockdraft.serve.choices`),
then either one JSON answer or a stream of chunks, the choices' interleaved as they come.

Whatever way an answer ends (finished, a stop string, an error, the client leaving, the
server closing), its engine requests are cancelled if they still run, so their pages come
back, and the outcome is counted once in ``blockdraft_requests_total``. One choice that
fails fails the whole answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from blockdraft.grammar import CompiledGrammar, compiler_for
from blockdraft.pair.checks import context_problem
from blockdraft.serve.chat import ChatFormat
from blockdraft.serve.choices import Choice, Piece, choice_seed, join_logprobs
from blockdraft.serve.errors import APIError, invalid
from blockdraft.serve.logprobs import TokenTexts
from blockdraft.serve.loop import EngineLoop, Submission
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.protocol import DEFAULT_COMPLETION_TOKENS, GenerationRequest, Kind, parse_json, parse_request
from blockdraft.serve.responses import Head, choice, chunk, meta_info, response, usage, usage_chunk
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
        self.vocab = int(self.loop.engine.proposer.head.vocab_in)
        self.texts = TokenTexts(self.tokenizer)

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
            prompts = self._prompt_ids(req)
            grammar = await self._grammar(req)
            subs = [sub for ids in prompts for sub in self._submissions(req, ids, grammar)]
            tickets = [self.loop.submit(sub) for sub in subs]
            try:
                for ticket in tickets:
                    await ticket.admitted()
            except BaseException:
                for ticket in tickets:
                    self.loop.cancel(ticket)
                raise
        except APIError as err:
            self.metrics.count(outcome_of(err))
            raise
        choices = [Choice(i, t, req, TextStream(self.tokenizer, req.stop, req.min_tokens), self.texts)
                   for i, t in enumerate(tickets)]
        run = _Run(self, choices, req, Head.new(kind, self.model_name), sum(len(p) for p in prompts))
        if req.stream:
            return EventStream(run.events())
        return await run.answer(http)

    def _prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        if req.messages is not None:
            prompts = [self.chat.render(req.messages)]
        else:
            prompts = [list(self.tokenizer.encode(p)) if isinstance(p, str) else list(p)
                       for p in req.prompts or []]
        for i, ids in enumerate(prompts):
            if not ids:
                raise invalid("the prompt is empty (it encodes to no tokens)" if len(prompts) == 1
                              else f"prompt {i} is empty (it encodes to no tokens)",
                              "messages" if req.messages is not None else "prompt")
        return prompts

    async def _grammar(self, req: GenerationRequest) -> CompiledGrammar | None:
        """The request's grammar compiled (cached by spec), off the event loop and the
        engine's thread.

        Raises:
            APIError: 400 naming the field when it does not compile, or under tensor
                parallelism (a compiled grammar cannot travel to the other ranks).
        """
        if req.grammar is None:
            return None
        tp = self.loop.engine.tp
        if tp is not None and tp.size > 1:
            raise invalid(f"{req.grammar_field} is not supported with tensor parallelism",
                          req.grammar_field, code="unsupported")
        spec = req.grammar
        try:
            return await asyncio.to_thread(lambda: compiler_for(self.tokenizer, self.vocab).compile(spec))
        except ValueError as exc:
            raise invalid(f"{req.grammar_field}: {exc}", req.grammar_field) from None

    def _submissions(self, req: GenerationRequest, ids: list[int],
                     grammar: CompiledGrammar | None = None) -> list[Submission]:
        """The engine requests of one prompt: its ``n`` choices (with a grammar, the model's
        end token stops them even under ``ignore_eos``: the grammar allows it only once
        complete, and only it once nothing can follow)."""
        max_new = self._max_new(req, len(ids))
        if req.min_tokens > max_new:
            raise invalid(f"min_tokens ({req.min_tokens}) is more than the {max_new} tokens "
                          "this request may generate", "min_tokens")
        bad = [t for t in req.stop_token_ids if t >= self.vocab]
        if bad:
            raise invalid(f"stop_token_ids holds ids outside the vocabulary [0, {self.vocab}): "
                          f"{bad}", "stop_token_ids")
        ends = self.stop_ids if grammar is not None or not req.ignore_eos else ()
        stops = tuple(dict.fromkeys([*req.stop_token_ids, *ends]))
        return [Submission(ids, max_new, req.sampling, stops, choice_seed(req.seed, j),
                           min_tokens=req.min_tokens, logprobs=req.logprobs, grammar=grammar)
                for j in range(req.n)]

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
    """One admitted request, its choices on their way to the client."""

    def __init__(self, svc: Service, choices: list[Choice], req: GenerationRequest, head: Head,
                 prompt_tokens: int) -> None:
        self.svc = svc
        self.choices = choices
        self.req = req
        self.head = head
        self.prompt_tokens = prompt_tokens

    async def _pieces(self) -> AsyncGenerator[tuple[Choice, Piece], None]:
        """Every choice's pieces as they come, each choice's in order, until all are done.

        Raises:
            APIError: a choice failed (the others are then left to :meth:`_cancel`).
        """
        loop = self.svc.loop
        pending = {asyncio.ensure_future(c.piece(loop)): c for c in self.choices}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                ready = sorted(((pending.pop(f), f) for f in done), key=lambda cf: cf[0].index)
                # Every outcome is looked at, so no failure is left unretrieved.
                failures = [err for err in (f.exception() for _, f in ready) if err is not None]
                if failures:
                    raise failures[0]
                for c, fut in ready:
                    piece = fut.result()
                    yield c, piece
                    if not piece.done:
                        pending[asyncio.ensure_future(c.piece(loop))] = c
        finally:
            for fut in pending:
                fut.cancel()

    def _cancel(self) -> None:
        for c in self.choices:
            self.svc.loop.cancel(c.ticket)

    def _outcome(self) -> str:
        """The answer's ``blockdraft_requests_total`` status: ``length`` when any choice ran
        to its limit, else ``stop``."""
        return "length" if any(c.finish == "length" for c in self.choices) else "stop"

    def _usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices))

    def _meta(self, choices: list[Choice]) -> dict[str, Any] | None:
        return meta_info([s for c in choices for s in c.steps]) if self.req.return_meta_info else None

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
            outcome = self._outcome()
            return JSONResponse(body)
        finally:
            gone.cancel()
            work.cancel()
            self._cancel()
            self.svc.metrics.count(outcome)

    async def _collect(self) -> dict[str, Any]:
        texts: dict[int, list[str]] = {c.index: [] for c in self.choices}
        lps: dict[int, list[dict[str, Any]]] = {c.index: [] for c in self.choices}
        async with aclosing(self._pieces()) as pieces:
            async for c, piece in pieces:
                texts[c.index].append(piece.text)
                if piece.logprobs is not None:
                    lps[c.index].append(piece.logprobs)
        out = []
        for c in self.choices:
            assert c.finish is not None
            joined = join_logprobs(self.head.kind, lps[c.index]) if self.req.logprobs is not None else None
            out.append(choice(self.head, "".join(texts[c.index]), c.finish, index=c.index, logprobs=joined))
        return response(self.head, out, self._usage(), self._meta(self.choices))

    async def events(self) -> AsyncIterator[str]:
        """The answer as server-sent events, ending ``data: [DONE]``; a failure after the
        stream began is an ``{"error": ...}`` event."""
        with_usage = self.req.include_usage
        outcome = "cancelled"
        try:
            if self.head.kind == "chat":
                for c in self.choices:
                    yield event(chunk(self.head, None, index=c.index, usage_field=with_usage))
            try:
                async with aclosing(self._pieces()) as pieces:
                    async for c, piece in pieces:
                        if piece.text or piece.logprobs is not None:
                            yield event(chunk(self.head, piece.text, index=c.index,
                                              logprobs=piece.logprobs, usage_field=with_usage))
                        if piece.done:
                            assert c.finish is not None
                            yield event(chunk(self.head, None, c.finish, index=c.index,
                                              usage_field=with_usage, meta=self._meta([c])))
            except APIError as err:
                outcome = outcome_of(err)
                yield event(err.body())
            else:
                if with_usage:
                    yield event(usage_chunk(self.head, self._usage()))
                outcome = self._outcome()
            yield DONE
        finally:
            self._cancel()
            self.svc.metrics.count(outcome)


async def _disconnected(http: Request) -> None:
    """Return once the client has gone (the body is read already, so the next message the
    server sends the app is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


__all__ = ["STATUS_OF_ERROR", "Service", "outcome_of"]
