"""One generation request inside the engine, and the events a step reports about it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from blockdraft.pair import check_context
from blockdraft.proposer import DFlashState
from blockdraft.results import TokenLogprob
from blockdraft.sampling import SamplingParams, as_sampling
from blockdraft.target import check_prompts

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
        min_tokens: its stop tokens are masked out of the target's choice until it has
            generated this many tokens.
        logprobs: how many likeliest alternatives to report with each token's
            log-probability (``None``: no log-probabilities are computed).
        out: generated tokens (a stop token included).
        out_logprobs: one per token of ``out`` when ``logprobs`` is set.
        steps: tokens produced per speculative step (accepted drafts + 1).
        finish_reason: ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"`` once ended.
        error: the message of the failure that ended it, if one did.
        target_pages / drafter_pages: the pages its admission reserved.
        prefill_alone: admit it in a prefill of its own (a batched prefill it was part of
            ran out of device memory).
    """

    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stops: frozenset[int]
    mask_fn: MaskFn | None
    generator: torch.Generator | None
    submitted_at: float
    min_tokens: int = 0
    logprobs: int | None = None
    status: Status = Status.WAITING
    out: list[int] = field(default_factory=list)
    out_logprobs: list[TokenLogprob] = field(default_factory=list)
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
    prefill_alone: bool = False

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

    def fit_drafts(self, drafts: list[int]) -> list[int]:
        """Its greedy drafts made to fit its grammar, walking them through its mask function:
        a draft the grammar allows stays; one it refuses becomes the one token the grammar
        forces there when it forces one (JSON keys, punctuation), else the drafts end there
        (the target could accept neither it nor, after it, any later draft). The drafter
        drafts without the grammar; verification masks every row exactly, so the output is
        the same whatever the drafts. Greedy drafts only: a sampled draft is kept as drawn,
        since acceptance weighs it by the distribution it was drawn from."""
        if self.mask_fn is None or not drafts:
            return drafts
        fitted: list[int] = []
        try:
            for tok in drafts:
                mask = self.bitmask(fitted)
                if mask is not None and not _allows(mask, tok):
                    forced = _only_token(mask)
                    if forced is None:
                        break
                    tok = forced
                fitted.append(tok)
                if tok in self.stops:
                    break
        except Exception:  # noqa: BLE001 - verification asks again and fails the request
            pass
        return fitted

    def holds_stops(self, ahead: int = 0) -> bool:
        """Whether its stop tokens are masked at the position ``ahead`` tokens past ``out``."""
        return bool(self.stops) and len(self.out) + ahead < self.min_tokens

    def ends(self, tokens: Sequence[int]) -> tuple[int, str | None]:
        """What :meth:`push` of ``tokens`` does, without doing it: how many it keeps (up to
        the first stop token or the length limit) and the finish reason they give (``None``:
        the request goes on)."""
        room = self.max_new_tokens - len(self.out)
        if self.stops.isdisjoint(tokens):  # the common case, without a loop in Python
            n = len(tokens)
            return (max(room, 1), "length") if 0 < n and room <= n else (n, None)
        for i, tok in enumerate(tokens, 1):
            if tok in self.stops:
                return i, "stop"
            if i >= room:
                return i, "length"
        return len(tokens), None

    def push(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> int:
        """Append ``tokens`` (with their ``logprobs``, when computed) up to the first stop
        token or the length limit; returns how many were kept (the request is then finished
        if it hit either)."""
        kept, reason = self.ends(tokens)
        self.out.extend(tokens[:kept])
        if logprobs is not None:
            self.out_logprobs.extend(logprobs[:kept])
        if reason is not None:
            self.finish_reason = reason
        return kept

    def event(self) -> StepEvent:
        """What happened since its previous event: the new tokens and, once it ended, why."""
        new = tuple(self.out[self.reported :])
        lps = tuple(self.out_logprobs[self.reported :]) if self.out_logprobs else ()
        self.reported = len(self.out)
        reason = self.finish_reason if self.status.ended else None
        return StepEvent(self.id, new, reason, self.error, lps)


@dataclass(frozen=True)
class StepEvent:
    """What one step did for one request: its new tokens and, once it ended, why.

    Attributes:
        finish_reason: ``None`` while it runs, else ``"stop"``, ``"length"``,
            ``"cancelled"`` or ``"error"`` (``error`` then holds the message).
        logprobs: one per new token when the request asked for them, else empty.
    """

    request_id: int
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def new_request(
    ids: Iterator[int],
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None,
    stop_token_ids: Sequence[int] | None,
    generator: torch.Generator | None,
    seed: int | None,
    seed_base: int | None,
    mask_fn: MaskFn | None,
    min_tokens: int,
    logprobs: int | None,
    vocab: int,
    max_seq_len: int,
    target_positions: int | None,
) -> Request:
    """A checked request (see :meth:`~blockdraft.SpeculativeEngine.submit` for the arguments):
    its prompt within the vocabulary and the context limits, ``max_new_tokens`` clipped at
    the target's ``target_positions``, its id the next of ``ids`` (taken once every check
    passed), and a generator made from ``seed``, else for a sampled request from
    ``seed_base + id`` when there is a base (tensor parallelism: every rank draws the same).

    Raises:
        TypeError / ValueError: a bad argument (named).
    """
    check_options(max_new_tokens, min_tokens, logprobs, vocab)
    params = as_sampling(sampling)
    prompt_ids = check_prompts([prompt], vocab)[0]
    check_context(len(prompt_ids), max_new_tokens, max_seq_len)
    if target_positions is not None:  # binds when max_seq_len is past the target's
        check_context(len(prompt_ids), None, target_positions,
                      limit_name="the target's max_position_embeddings")
        max_new_tokens = min(max_new_tokens, target_positions - len(prompt_ids))
    rid = next(ids)
    if seed is None and generator is None and seed_base is not None and not params.greedy:
        seed = (seed_base + rid) % (1 << 63)
    if seed is not None and generator is None:
        generator = torch.Generator().manual_seed(int(seed))
    return Request(
        id=rid, prompt=prompt_ids, max_new_tokens=max_new_tokens, params=params,
        stops=frozenset(int(t) for t in (stop_token_ids or ())), mask_fn=mask_fn,
        generator=generator, submitted_at=time.perf_counter(), min_tokens=min_tokens,
        logprobs=logprobs,
    )


def _allows(mask: Tensor, token: int) -> bool:
    word = token // 32
    return 0 <= word < mask.shape[-1] and bool((int(mask[word]) >> (token % 32)) & 1)


def _only_token(mask: Tensor) -> int | None:
    """The token a packed mask allows when it allows exactly one, else ``None``."""
    words = mask.nonzero()
    if words.numel() != 1:
        return None
    at = int(words[0])
    bits = int(mask[at]) & 0xFFFFFFFF
    return 32 * at + bits.bit_length() - 1 if bits & (bits - 1) == 0 else None


def check_options(max_new_tokens: int, min_tokens: int, logprobs: int | None, vocab: int) -> None:
    """Raises ``TypeError`` / ``ValueError`` naming a bad length or output option of a
    request: ``max_new_tokens >= 1``, ``0 <= min_tokens <= max_new_tokens``, ``logprobs``
    ``None`` or in ``[0, vocab]``."""
    for name, value in (("max_new_tokens", max_new_tokens), ("min_tokens", min_tokens),
                        ("logprobs", 0 if logprobs is None else logprobs)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
    if not 0 <= min_tokens <= max_new_tokens:
        raise ValueError(f"min_tokens must be in [0, max_new_tokens = {max_new_tokens}], not {min_tokens}")
    if logprobs is not None and not 0 <= logprobs <= vocab:
        raise ValueError(f"logprobs must be in [0, {vocab}] (the vocabulary), not {logprobs}")


__all__ = ["MaskFn", "Request", "Status", "StepEvent", "check_options", "new_request"]
