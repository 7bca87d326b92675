"""One proposal from its plans to its drafts: the core plans every sequence's ctx K/V (all or
nothing), the draft forward runs (its graph replay where that applies), the drafts are picked
and the plans confirmed. Also the checks of a proposal's ``num_drafts`` and grammar bitmask."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

import blockdraft._core as _core
from blockdraft import faults
from blockdraft._core import ContextState
from blockdraft.proposer.forward import DraftForward, Generators
from blockdraft.proposer.graphs import GraphRunner
from blockdraft.proposer.state import DFlashState, Proposal
from blockdraft.sampling import SamplingParams


def plan(
    what: str,
    states: list[DFlashState],
    ctxs: list[ContextState],
    tokens: Sequence[int],
    positions: Sequence[int],
    *,
    vocab_in: int,
    owner: int,
    max_positions: int,
    block_size: int,
) -> Proposal:
    """Check every anchor (below ``vocab_in``; at a position whose block of ``block_size``
    rows stays below the drafter's ``max_positions``) and state (of ``owner``) and plan every
    sequence's ctx K/V (all or nothing: on an error no plan is outstanding).

    Raises:
        ValueError: an anchor whose block passes ``max_positions``, or what the core refuses.
    """
    for p in positions:
        if isinstance(p, int) and not isinstance(p, bool) and p + block_size > max_positions:
            raise ValueError(
                f"{what}: the block anchored at position {p} reaches position "
                f"{p + block_size - 1}, past the drafter's max_position_embeddings "
                f"({max_positions}); a sequence this long decodes with the target alone"
            )
    args = (what, ctxs, tokens, positions, vocab_in, owner)
    fail_at = faults.hits("pool_pages", len(ctxs)) if faults.active() else None
    # `fail_at` exists in test builds only (faults cannot be armed in a release build).
    plans = (_core.plan_proposals(*args) if fail_at is None
             else _core.plan_proposals(*args, fail_at))
    return Proposal(states, ctxs, list(tokens), list(positions), plans)


def precompute_each(forward: DraftForward, proposal: Proposal) -> None:
    """The batched precompute lever off: with every anchor checked and every plan made, each
    sequence's ctx K/V is stored (one GEMM each) and its plan confirmed by itself, so a failure
    part way leaves the sequences before it with valid K/V (the draft then plans again: empty
    plans for them). On a failure the plans not yet confirmed are aborted."""
    try:
        for st, p in zip(proposal.states, proposal.plans):
            forward.store_plans([(st, p)])
            st.ctx.confirm_precompute(p)
    except BaseException:
        proposal.abort()
        raise


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _without_grad(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` under ``no_grad``, entered only when gradients are on: callers such as the engine
    already run under ``inference_mode``, and the context costs µs."""
    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


@_without_grad
def run(
    forward: DraftForward,
    runner: GraphRunner | None,
    proposal: Proposal,
    take: int,
    mask: Tensor | None,
) -> list[list[int]]:
    """Run the proposal's forward (through ``runner``, the graph path, where it takes the
    batch), pick drafts, confirm the plans. Returns ``take`` drafts per sequence, fewer where a
    draft had nothing allowed. Raises on any failure with every plan still outstanding (the
    caller aborts them)."""
    return _run(forward, runner, proposal, take, mask)


@_without_grad
def run_on_device(forward: DraftForward, runner: GraphRunner | None, proposal: Proposal, take: int) -> Tensor:
    """:func:`run` without a mask, its drafts left where the drafter made them: ``[n, take]``
    int64 on the device, every entry a token (nothing is masked out). The plans are confirmed
    once the work is launched; nothing waits for it."""
    got = _graphed(runner, proposal, take)
    if got is not None:
        return got
    picked = forward.run(proposal, take, None)
    if tuple(picked.shape) != (len(proposal.plans), take):
        raise RuntimeError(f"the drafter forward returned drafts of shape {tuple(picked.shape)}, "
                           f"not {(len(proposal.plans), take)}")
    proposal.confirm(take)
    return picked


@_without_grad
def run_sampled(forward: DraftForward, proposal: Proposal, take: int,
                sampling: tuple[SamplingParams, Generators]) -> tuple[list[list[int]], Tensor]:
    """The proposal's forward with its drafts sampled (``sampling``: the settings and one
    random source, or one per sequence), on the plain path; its plans confirmed. Returns
    ``take`` drafts per sequence and their distribution ``[n, take, V]``. Raises with every
    plan still outstanding (the caller aborts them)."""
    picked = forward.run(proposal, take, None, sampling)
    q = forward.last_q
    assert q is not None
    drafts: list[list[int]] = picked.tolist()
    proposal.confirm(take)
    return drafts, q


def _graphed(runner: GraphRunner | None, proposal: Proposal, take: int) -> Tensor | None:
    """The graph path's drafts ``[n, take]`` (a view of the replay's output) with the plans
    confirmed, or ``None`` when it does not take the call (nothing stored then)."""
    n = len(proposal.plans)
    if runner is None or not runner.accepts(n):
        return None
    # The graph path stores the outstanding ctx K/V itself; None: it stored nothing.
    got = runner.draft(proposal)
    if got is None:
        return None
    if got.shape[0] != n:
        raise RuntimeError(f"the graph path returned {got.shape[0]} rows for {n} sequences")
    # Confirmed while the replay runs, before anything waits for it: the K/V is stored by
    # work already launched, and every host-side failure point lies before the launch. (A
    # CUDA error surfacing at a later wait leaves the plans confirmed; the device context is
    # unusable after one anyway, and aborting a confirmed plan is a no-op.) At n = 32 this
    # takes the confirms off the call's critical path.
    proposal.confirm(take)
    return got if take == got.shape[1] else got[:, :take]


def _run(
    forward: DraftForward,
    runner: GraphRunner | None,
    proposal: Proposal,
    take: int,
    mask: Tensor | None,
) -> list[list[int]]:
    n = len(proposal.plans)
    got = _graphed(runner, proposal, take)
    if got is not None:
        rows: list[list[int]] = got.tolist()
        return rows
    picked = forward.run(proposal, take, mask)  # [n, take]
    anchors = torch.tensor(proposal.tokens, dtype=torch.int64, device=picked.device)
    # Row 0 (the anchor) is never a draft; the core's band split drops it.
    band = torch.cat([anchors[:, None], picked], 1).reshape(-1).tolist()
    bands = _core.split_bands(band, n, take + 1, True, take)
    if bands is None:
        raise RuntimeError(f"the drafter forward returned fewer than {n * (take + 1)} rows")
    # A row with no allowed token (-1 from masked_argmax) ends that sequence's drafts.
    bands = [d[: d.index(-1)] if -1 in d else d for d in bands]
    proposal.confirm([len(d) for d in bands])
    return bands


def num_take(num_drafts: int, block_size: int, cap: int | None) -> int:
    """The drafts a proposal of ``num_drafts`` makes: ``num_drafts`` (``1 .. block_size - 1``),
    at most the draft cap ``cap``.

    Raises:
        TypeError / ValueError: ``num_drafts`` not an int, or out of range.
    """
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int):
        raise TypeError(f"num_drafts must be an int, not {type(num_drafts).__name__}")
    if not 1 <= num_drafts <= block_size - 1:
        raise ValueError(f"num_drafts must be in 1..{block_size - 1}, not {num_drafts}")
    return num_drafts if cap is None else min(num_drafts, cap)


def bitmask(mask: Tensor | Sequence[int], rows: int, vocab_size: int, device: torch.device) -> Tensor:
    """A grammar bitmask as ``[rows, ceil(vocab_size / 32)]`` int32 words on ``device``, from
    one row for every draft or one row per draft.

    Raises:
        ValueError: not packed int words, or not of those shapes.
    """
    words = (vocab_size + 31) // 32
    t = mask if isinstance(mask, Tensor) else torch.tensor(list(mask), dtype=torch.int64)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"grammar_bitmask must hold packed int32 words, not {t.dtype}")
    if t.dtype != torch.int32:
        # Accept unsigned-looking words (bit 31 set) given as Python ints.
        t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    if t.dim() == 1:
        t = t.unsqueeze(0).expand(rows, -1)
    if t.dim() != 2 or t.shape[1] != words or t.shape[0] < rows:
        raise ValueError(
            f"grammar_bitmask must be [{words}] or [{rows}, {words}] packed int32, "
            f"not {list(t.shape)}"
        )
    return t[:rows].to(device).contiguous()


__all__ = ["bitmask", "num_take", "plan", "precompute_each", "run", "run_on_device", "run_sampled"]
