"""One choice of an answer: an engine request's updates turned into text, log-probabilities
and a finish reason.

An answer holds one choice per prompt and per ``n`` (each its own engine request); their
index is OpenAI's order, ``prompt_index * n + j``. With a ``seed``, choice ``j`` of every
prompt is seeded ``seed + j``, so it equals a one-choice request with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockdraft.serve.errors import APIError, generation_failed
from blockdraft.serve.logprobs import CompletionLogprobs, TokenTexts
from blockdraft.serve.loop import EngineLoop, Ticket
from blockdraft.serve.protocol import GenerationRequest
from blockdraft.serve.text import TextStream


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice ``j``'s sampling seed for a request seeded ``seed`` (``None``: unseeded)."""
    return None if seed is None else seed + j


@dataclass
class Piece:
    """What one update of a choice releases: text, the log-probabilities of its tokens in the
    endpoint's shape (``None`` when not asked for), and whether the choice is complete."""

    text: str
    logprobs: dict[str, Any] | None
    done: bool


@dataclass
class Choice:
    """One admitted engine request of an answer on its way to the client."""

    index: int
    ticket: Ticket
    req: GenerationRequest
    text: TextStream
    texts: TokenTexts
    completion_tokens: int = 0
    steps: list[int] = field(default_factory=list)
    finish: str | None = None
    legacy: CompletionLogprobs | None = None

    def __post_init__(self) -> None:
        if self.req.kind == "completion" and self.req.logprobs is not None:
            self.legacy = CompletionLogprobs(self.texts)

    async def piece(self, loop: EngineLoop) -> Piece:
        """The next update's piece.

        Raises:
            APIError: 500 when generation failed (503 when for want of device memory), 503
                when the server cancelled it.
        """
        upd = await self.ticket.next()
        self.steps.extend(upd.steps)
        before = self.text.used
        delta = self.text.push(upd.tokens)
        new = self.text.used - before
        self.completion_tokens += new
        lps = self._logprobs(upd.logprobs[:new])
        if self.text.stopped:
            self.finish = "stop"
            loop.cancel(self.ticket)
            return Piece(delta, lps, True)
        if upd.finish_reason is None:
            return Piece(delta, lps, False)
        if upd.finish_reason in ("stop", "length"):
            self.finish = upd.finish_reason
            return Piece(delta + self.text.finish(), lps, True)
        if upd.finish_reason == "error":
            raise generation_failed(upd.error, out_of_memory=upd.out_of_memory)
        raise APIError(503, "the server shut down before the request finished",
                       type="server_error", code="cancelled")

    def _logprobs(self, lps: Any) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.legacy is not None:
            return self.legacy.piece(lps)
        return {"content": self.texts.chat(lps), "refusal": None}


def join_logprobs(kind: str, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole answer's logprobs object from its pieces' (in order)."""
    if kind == "chat":
        return {"content": [e for p in pieces for e in p["content"]], "refusal": None}
    return {key: [x for p in pieces for x in p[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


__all__ = ["Choice", "Piece", "choice_seed", "join_logprobs"]
