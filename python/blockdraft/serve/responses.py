"""The JSON bodies the server answers with, in OpenAI's shapes: whole responses and stream
chunks of ``text_completion`` and ``chat.completion``, ``usage``, and SGLang's ``meta_info``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blockdraft.serve.protocol import Kind


@dataclass(frozen=True)
class Head:
    """What every body of one answer repeats: its id, creation time and model."""

    kind: Kind
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: Kind, model: str) -> Head:
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return cls(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def body(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def meta_info(steps: Sequence[int]) -> dict[str, Any]:
    """SGLang's speculative figures: mean tokens per verify step (tau) and the step count."""
    return {"spec_accept_length": sum(steps) / len(steps) if steps else 0.0,
            "spec_verify_ct": len(steps)}


def choice(head: Head, text: str, finish_reason: str, *, index: int = 0,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole answer (``logprobs``: its object, in the endpoint's shape)."""
    out: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if head.kind == "completion":
        out["text"] = text
    else:
        out["message"] = {"role": "assistant", "content": text}
    return out


def response(head: Head, choices: list[dict[str, Any]], use: dict[str, int],
             meta: dict[str, Any] | None) -> dict[str, Any]:
    """A whole (non-stream) answer of ``choices`` (:func:`choice`, in index order)."""
    body = head.body("text_completion" if head.kind == "completion" else "chat.completion", choices)
    body["usage"] = use
    if meta is not None:
        body["meta_info"] = meta
    return body


def chunk(head: Head, text: str | None, finish_reason: str | None = None, *, index: int = 0,
          logprobs: dict[str, Any] | None = None, usage_field: bool = False,
          meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stream chunk of choice ``index``: new text (``None`` on a chat stream's first
    chunk: the role), or the closing chunk with ``finish_reason``.

    Args:
        logprobs: the log-probabilities of the chunk's tokens, in the endpoint's shape.
        usage_field: add ``"usage": null`` (a stream that ends with a usage chunk has it on
            every other chunk, as OpenAI's do).
    """
    one: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if head.kind == "completion":
        one["text"] = text or ""
        body = head.body("text_completion", [one])
    else:
        if finish_reason is not None:
            one["delta"] = {}
        elif text is None:
            one["delta"] = {"role": "assistant", "content": ""}
        else:
            one["delta"] = {"content": text}
        body = head.body("chat.completion.chunk", [one])
    if usage_field:
        body["usage"] = None
    if meta is not None:
        body["meta_info"] = meta
    return body


def usage_chunk(head: Head, use: dict[str, int]) -> dict[str, Any]:
    """The chunk after the closing one when ``stream_options.include_usage`` is set."""
    object_ = "text_completion" if head.kind == "completion" else "chat.completion.chunk"
    body = head.body(object_, [])
    body["usage"] = use
    return body


__all__ = ["Head", "choice", "chunk", "meta_info", "response", "usage", "usage_chunk"]
