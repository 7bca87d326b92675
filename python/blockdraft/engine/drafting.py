"""A step's drafts for the engine's running requests: what each asks the proposer for."""

from __future__ import annotations

from collections.abc import Sequence

from blockdraft.engine.request import Request
from blockdraft.proposer import DFlashProposer, Drafts


def draft_requests(proposer: DFlashProposer, running: Sequence[Request], counts: Sequence[int],
                   sampled: bool) -> Drafts:
    """Drafts for each request: ``counts[i]`` (the draft-length policy's choice), at most
    ``remaining - 1`` (none for a request's last token), under its grammar mask, sampled
    from the drafter with its sampling settings when ``sampled``. How they are drafted is
    the proposer's (:meth:`~blockdraft.DFlashProposer.draft`); a failed proposal is in
    ``Drafts.errors``, not raised."""
    return proposer.draft(
        [r.state for r in running],  # type: ignore[misc]
        [r.out[-1] for r in running],
        [r.anchor_position for r in running],
        [min(k, r.remaining - 1) for k, r in zip(counts, running)],
        # Lists only when some request needs them: most steps have no grammar and greedy drafts.
        masks=([r.draft_bitmask if r.mask_fn is not None else None for r in running]
               if any(r.mask_fn is not None for r in running) else None),
        sampling=[(r.params, r.generator) for r in running] if sampled else None,
    )


__all__ = ["draft_requests"]
