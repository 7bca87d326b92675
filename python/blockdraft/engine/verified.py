"""A step's verify: the forward over each request's block and its acceptance, then each
request's new tokens pushed and the verify rows its context keeps.

The drafts come as the proposer made them (:class:`~blockdraft.proposer.Drafts`): lists, or
still on the device, where the runtime's verify graph takes them and they come back with its
argmax in one read. A step's verify rows lie request after request (``1 + drafts`` rows each); of each request
that goes on, its first ``accepted + 1`` rows become its drafter context. They are picked in
one gather (one view when every block and every count is the same), not cut out per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import Tensor

from blockdraft.engine.accept import accept_blocks, accept_drafted
from blockdraft.engine.draft_length import DraftLengthPolicy
from blockdraft.engine.request import Request
from blockdraft.proposer import Drafts
from blockdraft.results import TokenLogprob
from blockdraft.target import RuntimeTarget, TargetBackend


def verify(target: TargetBackend, live: Sequence[Request], seqs: Sequence[object], got: Drafts,
           keep: Sequence[int]) -> tuple[list[list[int]], list[tuple[int, int]], Tensor, Tensor]:
    """The verify of each request of ``live`` (target sequences ``seqs``; the requests at
    ``keep`` of those ``got`` was drafted for) and its acceptance: ``(drafts, (accepted, next
    token) per request, logits, captured rows)``."""
    if got.pending is not None:
        # Every request was drafted on the device (no proposal failed), decided by an argmax.
        assert isinstance(target, RuntimeTarget)
        logits, rows = target.verify_drafted(seqs, [r.out[-1] for r in live], got.pending)
        drafts, decided = accept_drafted(got.pending, logits)
        return drafts, decided, logits, rows
    drafts, draft_q = [got.tokens[i] for i in keep], [got.q[i] for i in keep]
    logits, rows = target.verify(seqs, [[r.out[-1], *d] for r, d in zip(live, drafts)])
    return drafts, accept_blocks(live, drafts, logits, draft_q), logits, rows


def push_verified(
    live: Sequence[Request],
    news: Sequence[list[int]],
    offered: Sequence[int],
    logprobs: Sequence[Sequence[TokenLogprob] | None],
    lengths: DraftLengthPolicy,
) -> tuple[list[int], list[range]]:
    """Push each request's new tokens ``news[i]`` (its accepted drafts of the ``offered[i]``
    and the target's next token) and record the step in ``lengths``; returns the indices of
    the requests that go on (not finished by these tokens) and, for each, the positions of
    its accepted rows (from its anchor)."""
    going: list[int] = []
    positions: list[range] = []
    for i, (r, new, k, lp) in enumerate(zip(live, news, offered, logprobs)):
        start = r.anchor_position  # before the push
        lengths.observe(r.id, k, len(new) - 1)
        r.steps.append(len(new))
        r.push(new, lp)
        if r.finish_reason is None:
            going.append(i)
            positions.append(range(start, start + len(new)))
    return going, positions


def kept_rows(rows: Tensor, block_lens: Sequence[int], counts: Sequence[int], which: Sequence[int]) -> Tensor:
    """The first ``counts[i]`` of request ``i``'s ``block_lens[i]`` rows, for each ``i`` of
    ``which`` (in order), request after request."""
    n = len(block_lens)
    if n == 1:
        return rows[: counts[0]]
    first = block_lens[0]
    count = counts[which[0]]
    if len(which) == n and block_lens.count(first) == n and [counts[i] for i in which].count(count) == n:
        # The steady state: one shape for every request, a strided view of the rows.
        return rows.view(n, first, rows.shape[-1])[:, :count].reshape(-1, rows.shape[-1])
    starts = list(accumulate(block_lens, initial=0))
    index = [j for i in which for j in range(starts[i], starts[i] + counts[i])]
    return rows.index_select(0, torch.tensor(index, dtype=torch.int64).to(rows.device, non_blocking=True))


__all__ = ["kept_rows", "push_verified", "verify"]
