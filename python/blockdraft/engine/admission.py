"""Which waiting requests start at a step: bookkeeping only (no tensors, no allocation).

A request reserves, when it is submitted, the pages it may hold at its longest
(:func:`reserve_pages`): its target pages for prompt + ``max_new_tokens`` + one block of
look-ahead, and the drafter pages of its context window.

Requests start in arrival order (none jumps the queue) while fewer than ``max_active`` run
and the pages each reserves at admission fit what the running ones leave. A request marked
``prefill_alone`` (a batched prefill it was part of ran out of device memory) starts in a
step of its own, so that a prefill that runs out again is that request's alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import blockdraft._core as _core
from blockdraft.engine.request import Request
from blockdraft.proposer import DFlashProposer
from blockdraft.target import TargetBackend


def reserve_pages(req: Request, target: TargetBackend, proposer: DFlashProposer, *, max_seq_len: int,
                  block_size: int, speculate: bool) -> None:
    """Set ``req.target_pages`` and ``req.drafter_pages``, the pages it may hold at its longest
    (no drafter pages without speculation).

    Raises:
        ValueError: the request can never fit the pools.
    """
    budget = len(req.prompt) + req.max_new_tokens
    req.target_pages = target.pages_for(budget + block_size)
    window = _core.ctx_window(max_seq_len, block_size, budget, proposer.levers.ctx_cap)
    req.drafter_pages = math.ceil(window / proposer.page_size) if speculate else 0
    total_t, total_d = target.total_pages, proposer.pool.num_pages
    if (total_t is not None and req.target_pages > total_t) or req.drafter_pages > total_d:
        raise ValueError(
            f"the request needs {req.target_pages} target pages and {req.drafter_pages} "
            f"drafter pages; the pools hold {total_t} and {total_d}: it can never run"
        )


def num_admissible(
    waiting: Sequence[Request],
    running: Sequence[Request],
    *,
    max_active: int,
    target_pages: int | None,
    drafter_pages: int,
) -> int:
    """How many requests at the head of ``waiting`` start now.

    Args:
        waiting / running: the queue in arrival order, and the requests running.
        max_active: the most requests running at once.
        target_pages / drafter_pages: the pools' sizes (``target_pages=None``: the target is
            not page-budgeted).
    """
    if not waiting:
        return 0
    held_t = sum(r.target_pages for r in running)
    held_d = sum(r.drafter_pages for r in running)
    n = 0
    for req in waiting:
        if len(running) + n >= max_active or (req.prefill_alone and n):
            break
        held_t += req.target_pages
        held_d += req.drafter_pages
        if (target_pages is not None and held_t > target_pages) or held_d > drafter_pages:
            break
        n += 1
        if req.prefill_alone:
            break
    return n


__all__ = ["num_admissible", "reserve_pages"]
