"""Which waiting requests start at a step: bookkeeping only (no tensors, no allocation).

Requests start in arrival order (none jumps the queue) while fewer than ``max_active`` run
and the pages each reserves at admission fit what the running ones leave. A request marked
``prefill_alone`` (a batched prefill it was part of ran out of device memory) starts in a
step of its own, so that a prefill that runs out again is that request's alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockdraft.engine.request import Request


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


__all__ = ["num_admissible"]
