"""One generation request inside the engine, and the events a step reports about it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from blockdraft.proposer import DFlashState
from blockdraft.sampling import SamplingParams

MaskFn = Callable[[Sequence[int]], "Tensor | None"]
"""``fn(generated_tokens) -> packed int32 bitmask [ceil(V/32)] of the tokens allowed next``
(``None`` = no constraint)."""


class Status(enum.Enum):
    """Where a request is: waiting for pages, running, or ended (finished, cancelled, failed)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (Status.FINISHED, Status.CANCELLED, Status.FAILED)


@dataclass(eq=False)  # a request is an identity: `in` and `remove` must not compare fields
class Request:
    """A request's settings, progress and what it holds (target sequence, proposer state).

    Attributes:
        out: generated tokens (a stop token included).
        steps: tokens produced per speculative step (accepted drafts + 1).
        finish_reason: ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"`` once ended.
        error: the message of the failure that ended it, if one did.
        target_pages / drafter_pages: the pages its admission reserved.
    """

    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stops: frozenset[int]
    mask_fn: MaskFn | None
    generator: torch.Generator | None
    submitted_at: float
    status: Status = Status.WAITING
    out: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    target_seq: Any = None
    state: DFlashState | None = None
    target_pages: int = 0
    drafter_pages: int = 0
    reported: int = 0  # tokens already handed out by an event
    exception: BaseException | None = field(default=None, repr=False)

    @property
    def anchor_position(self) -> int:
        """The position of the last generated token (the next block's anchor)."""
        return len(self.prompt) + len(self.out) - 1

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.out)

    def bitmask(self, extra: Sequence[int] = ()) -> Tensor | None:
        """The allowed-token mask after the generated tokens and ``extra`` (``None``: any)."""
        if self.mask_fn is None:
            return None
        return self.mask_fn([*self.out, *extra])

    def push(self, tokens: Sequence[int]) -> int:
        """Append ``tokens`` up to the first stop token or the length limit; returns how many
        were kept (the request is then finished if it hit either)."""
        kept = 0
        for tok in tokens:
            self.out.append(tok)
            kept += 1
            if tok in self.stops:
                self.finish_reason = "stop"
                break
            if len(self.out) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        return kept


@dataclass(frozen=True)
class StepEvent:
    """What one step did for one request: its new tokens and, once it ended, why.

    Attributes:
        finish_reason: ``None`` while it runs, else ``"stop"``, ``"length"``,
            ``"cancelled"`` or ``"error"`` (``error`` then holds the message).
    """

    request_id: int
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


__all__ = ["MaskFn", "Request", "Status", "StepEvent"]
