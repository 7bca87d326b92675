"""A step's drafts for the engine's running requests: what each asks the proposer for, and
the drafts launched a step ahead (:class:`Ahead`) joined with those of requests that came
since; :class:`StepDrafts` keeps both for the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from blockdraft.engine.accept import argmax_only
from blockdraft.engine.draft_length import DraftLengthPolicy
from blockdraft.engine.request import Request
from blockdraft.proposer import DFlashProposer, Drafts


def draft_requests(proposer: DFlashProposer, running: Sequence[Request], counts: Sequence[int],
                   sampled: bool, on_device: bool = False) -> Drafts:
    """Drafts for each request: ``counts[i]`` (the draft-length policy's choice), at most
    ``remaining - 1`` (none for a request's last token), sampled from the drafter with its
    sampling settings when ``sampled``. How they are drafted is the proposer's
    (:meth:`~blockdraft.DFlashProposer.draft`); a failed proposal is in ``Drafts.errors``,
    not raised. A request's grammar applies after drafting (:meth:`Request.fit_drafts` on
    greedy drafts), so requests under a grammar draft batched like any other. ``on_device``
    (the caller's :func:`plain_argmax` of ``running``): the drafts may stay on the device
    (``Drafts.pending``)."""
    got = proposer.draft(
        [r.state for r in running],  # type: ignore[misc]
        [r.out[-1] for r in running],
        [r.anchor_position for r in running],
        [min(k, r.remaining - 1) for k, r in zip(counts, running)],
        sampling=[(r.params, r.generator) for r in running] if sampled else None,
        on_device=on_device,
    )
    if any(r.mask_fn is not None for r in running):
        got.tokens = [t if q is not None else r.fit_drafts(t) for r, t, q in zip(running, got.tokens, got.q)]
    return got


def plain_argmax(reqs: Sequence[Request]) -> bool:
    """Whether every request's acceptance is a plain argmax
    (:func:`~blockdraft.engine.accept.argmax_only`: greedy, no grammar, nothing else on its
    logits), so its drafts may stay on the device into the verify."""
    return all(argmax_only(r) for r in reqs)


@dataclass
class Ahead:
    """The next step's drafts, launched before a step's bookkeeping: ``drafts`` has one slot
    per request of ``requests``, in order."""

    requests: list[Request]
    drafts: Drafts


def drafts_for(running: Sequence[Request], ahead: Ahead,
               fresh: Callable[[list[Request]], Drafts]) -> Drafts:
    """Drafts for ``running`` (in order): the rows of ``ahead`` for the requests it drafted,
    ``fresh(rest)`` for the others (requests admitted since). Rows of requests that ended
    since are dropped; drafts ahead of requests that all ended are not used at all."""
    if len(ahead.requests) == len(running) and all(a is r for a, r in zip(ahead.requests, running)):
        return ahead.drafts
    row = {id(r): i for i, r in enumerate(ahead.requests)}
    rest = [r for r in running if id(r) not in row]
    if len(rest) == len(running):
        return fresh(rest)
    got = new = ahead.drafts
    if rest:
        if got.pending is not None:
            # The fresh proposal may replay the drafter's graph whose output this views.
            got.pending = got.pending.clone()
        new = fresh(rest)
    at = {id(r): j for j, r in enumerate(rest)}
    return joined([(got, row[id(r)]) if id(r) in row else (new, at[id(r)]) for r in running])


def joined(rows: Sequence[tuple[Drafts, int]]) -> Drafts:
    """One :class:`~blockdraft.proposer.Drafts` of the given slots (``(drafts, slot)`` each),
    in order. The drafts stay on the device when every part has them there with one width;
    else every part's are read into lists."""
    parts = list({id(d): d for d, _ in rows}.values())  # each part once, in order
    errors = [d.errors[j] for d, j in rows]
    pending = [p.pending for p in parts if p.pending is not None]
    if len(pending) == len(parts) and len({t.shape[1] for t in pending}) == 1:
        first = dict(zip(map(id, parts), accumulate((t.shape[0] for t in pending), initial=0)))
        whole = torch.cat(pending) if len(pending) > 1 else pending[0]
        index = [first[id(d)] + j for d, j in rows]
        if index != list(range(whole.shape[0])):
            whole = whole.index_select(0, torch.tensor(index, dtype=torch.int64).to(whole.device, non_blocking=True))
        return Drafts(tokens=[[] for _ in rows], q=[None] * len(rows), errors=errors, pending=whole)
    tokens = {id(p): p.pending.tolist() if p.pending is not None else p.tokens for p in parts}
    return Drafts(tokens=[tokens[id(d)][j] for d, j in rows], q=[d.q[j] for d, j in rows], errors=errors)


class StepDrafts:
    """Where each step's drafts come from: a proposal for the step's requests, or the drafts
    launched a step ahead (:meth:`launch_ahead`) for those that still run, joined with fresh
    ones for the others (:func:`drafts_for`).

    Args:
        proposer: the engine's proposer.
        lengths: the draft-length policy (how many drafts each request asks for).
        sampled: at ``temperature > 0``, draft by sampling (:func:`draft_requests`).
        device_drafts: greedy drafts may stay on the device into the verify.

    Attributes:
        batched / single: proposals made so far of several requests / of one.
    """

    def __init__(self, proposer: DFlashProposer, lengths: DraftLengthPolicy, *, sampled: bool,
                 device_drafts: bool) -> None:
        self.proposer = proposer
        self.lengths = lengths
        self.sampled = sampled
        self.device_drafts = device_drafts
        self.batched = 0
        self.single = 0
        self._ahead: Ahead | None = None

    def for_step(self, running: list[Request]) -> Drafts:
        """Drafts for ``running`` (in order): those launched ahead where there are, else a
        proposal; a failed proposal is in ``Drafts.errors``."""
        ahead, self._ahead = self._ahead, None
        return self.propose(running) if ahead is None else drafts_for(running, ahead, self.propose)

    def launch_ahead(self, reqs: list[Request]) -> None:
        """Launch the next step's drafts for ``reqs`` (their acceptance a :func:`plain_argmax`),
        left on the device for :meth:`for_step`."""
        self._ahead = Ahead(reqs, self.propose(reqs, on_device=True))

    def drop_ahead(self) -> None:
        """Forget the drafts launched ahead, so the next step proposes afresh: for a caller
        about to replay the proposer's graphs itself, whose outputs those drafts may view, or
        closing the engine."""
        self._ahead = None

    def propose(self, reqs: list[Request], on_device: bool | None = None) -> Drafts:
        """Drafts for ``reqs`` as the policy chooses; ``on_device``: the caller has checked
        the requests (:func:`plain_argmax`), else they are checked here."""
        if on_device is None:
            on_device = self.device_drafts and plain_argmax(reqs)
        got = draft_requests(self.proposer, reqs, self.lengths.choose([r.id for r in reqs]),
                             self.sampled, on_device=on_device)
        self.batched += got.batched
        self.single += got.single
        return got


__all__ = ["Ahead", "StepDrafts", "draft_requests", "drafts_for", "joined", "plain_argmax"]
