"""The Rust core's bookkeeping, for engines that drive it directly and for tests.

Most users never need this module: :class:`~blockdraft.DFlashProposer` calls the core for
them. Here are the pieces it is built from (all implemented in Rust, ``blockdraft._core``):

* per-sequence context bookkeeping: :class:`ContextState` (window, positions, blocks, counters)
  and its plans: :class:`AppendPlan` (with its :class:`SlidePlan`) and
  :class:`PrecomputePlan` (pages and slots for new ctx K/V);
* the target runtime's page tables: :class:`SeqPages` (one sequence's K/V pages, committed and
  pending tokens) and the whole-step calls over many of them, :func:`plan_forward` (giving a
  :class:`ForwardPlan`), :func:`accept_rows` and :func:`free_all`;
* the proposer's batch policy: :func:`propose_batch_max`, :func:`batch_decline_reason`,
  :func:`split_bands`;
* the context-window cap lever: :func:`read_ctx_cap`, :data:`ENV_CTX_CAP`,
  :data:`DEFAULT_CTX_CAP`; the slide lever: :func:`read_slide`, :func:`slide_room`,
  :data:`ENV_SLIDE`, :data:`DEFAULT_SLIDE`;
* :data:`PAD_SLOT`, the slot of a row that must not be written.

Every decision here is deterministic and property-tested (``cargo test``); the pool, the window
functions and the errors are re-exported by :mod:`blockdraft` itself.
"""

from __future__ import annotations

from blockdraft._core import (
    DEFAULT_CTX_CAP,
    DEFAULT_SLIDE,
    ENV_CTX_CAP,
    ENV_SLIDE,
    PAD_SLOT,
    AppendPlan,
    ContextState,
    ForwardPlan,
    PrecomputePlan,
    SeqPages,
    SlidePlan,
    accept_rows,
    batch_decline_reason,
    free_all,
    plan_forward,
    propose_batch_max,
    read_ctx_cap,
    read_slide,
    slide_room,
    split_bands,
)

__all__ = [
    "DEFAULT_CTX_CAP",
    "DEFAULT_SLIDE",
    "ENV_CTX_CAP",
    "ENV_SLIDE",
    "PAD_SLOT",
    "AppendPlan",
    "ContextState",
    "ForwardPlan",
    "PrecomputePlan",
    "SeqPages",
    "SlidePlan",
    "accept_rows",
    "batch_decline_reason",
    "free_all",
    "plan_forward",
    "propose_batch_max",
    "read_ctx_cap",
    "read_slide",
    "slide_room",
    "split_bands",
]
