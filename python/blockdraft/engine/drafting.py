"""A step's drafts for the engine's running requests: what each asks the proposer for."""

from __future__ import annotations

from collections.abc import Sequence

from blockdraft.engine.accept import argmax_only
from blockdraft.engine.request import Request
from blockdraft.proposer import DFlashProposer, Drafts


def draft_requests(proposer: DFlashProposer, running: Sequence[Request], counts: Sequence[int],
                   sampled: bool, on_device: bool = False) -> Drafts:
    """Drafts for each request: ``counts[i]`` (the draft-length policy's choice), at most
    ``remaining - 1`` (none for a request's last token), sampled from the drafter with its
    sampling settings when ``sampled``. How they are drafted is the proposer's
    (:meth:`~blockdraft.DFlashProposer.draft`); a failed proposal is in ``Drafts.errors``,
    not raised. A request's grammar applies after drafting (:meth:`Request.fit_drafts` on
    greedy drafts), so requests under a grammar draft batched like any other. ``on_device``:
    when every request's acceptance is a plain argmax (:func:`~blockdraft.engine.accept.argmax_only`:
    greedy, no grammar, nothing else on its logits), the drafts may stay on the device
    (``Drafts.pending``)."""
    got = proposer.draft(
        [r.state for r in running],  # type: ignore[misc]
        [r.out[-1] for r in running],
        [r.anchor_position for r in running],
        [min(k, r.remaining - 1) for k, r in zip(counts, running)],
        sampling=[(r.params, r.generator) for r in running] if sampled else None,
        on_device=on_device and all(argmax_only(r) for r in running),
    )
    if any(r.mask_fn is not None for r in running):
        got.tokens = [t if q is not None else r.fit_drafts(t) for r, t, q in zip(running, got.tokens, got.q)]
    return got


__all__ = ["draft_requests"]
