"""One sequence's proposer state, and one proposal over many of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

import blockdraft._core as _core
from blockdraft._core import ContextState, PrecomputePlan


class DFlashState:
    """One sequence's proposer state: core bookkeeping + accumulator + device page table.

    Attributes:
        ctx: the core's :class:`~blockdraft.core.ContextState` (window, positions, blocks, counters).
        acc: the context accumulator ``[window, k*H]`` (zeroed at allocation; ``None`` once
            freed).
        acc_address: the accumulator's device address (the batched append and the graph
            path's gather reach it by address; read once, since every step needs it).

    The read-only properties (``window``, ``ctx_len``, ``ctx_committed``, ``ctx_positions``,
    ``page_table``, ``seq_len``, ``prefill_done``, ``last_num_drafted``,
    ``last_num_accepted``, ``freed``, ``owner``) are the same-named getters of ``ctx``.
    """

    __slots__ = ("_fresh", "_pending", "_table", "acc", "acc_address", "ctx")

    def __init__(self, ctx: ContextState, acc: Tensor) -> None:
        self.ctx = ctx
        self.acc: Tensor | None = acc
        self.acc_address = acc.data_ptr()
        # (first row, end row, view, source base) of the last commit: the rows a proposal
        # usually stages next (a different plan range means it does not apply). The view is of
        # `acc`, or of the committed rows themselves while their write is pending; the base
        # is the address row r of that view's memory would have (`acc_address` for `acc`;
        # None: the rows cannot be read by address).
        self._fresh: tuple[int, int, Tensor, int | None] | None = None
        # Writes the accumulator rows of a commit still pending (see `defer`), or None.
        self._pending: Callable[[], None] | None = None
        # (core version, device table): the last table made by `page_table_dev`.
        self._table: tuple[int, Tensor] | None = None

    def rows(self, start: int, end: int) -> Tensor:
        """Accumulator rows ``[start, end)``: the view the last commit kept when that is the
        range (no new view on a step's hot path), else a new one (after the pending write,
        if any)."""
        fresh = self._fresh
        if fresh is not None and fresh[0] == start and fresh[1] == end:
            return fresh[2]
        self.flush()
        assert self.acc is not None
        return self.acc[start:end]

    def source_base(self, start: int, end: int) -> int:
        """The address from which the rows ``[start, end)`` are read by address (row ``r`` at
        ``base + r * row bytes``): where :meth:`rows` would read them."""
        fresh = self._fresh
        if fresh is not None and fresh[0] == start and fresh[1] == end and fresh[3] is not None:
            return fresh[3]
        self.flush()
        return self.acc_address

    def defer(self, write: Callable[[], None], start: int, end: int, view: Tensor, base: int | None) -> None:
        """The rows ``[start, end)`` are committed but not yet in ``acc``: until ``write()``
        has run they are read from ``view`` (by address from source base ``base``; ``None``:
        not by address), and a read of any other range runs ``write()`` first
        (:meth:`flush`)."""
        self._fresh = (start, end, view, base)
        self._pending = write

    @property
    def kept_range(self) -> tuple[int, int] | None:
        """The accumulator row range ``[start, end)`` whose view the last commit kept."""
        fresh = self._fresh
        return None if fresh is None else (fresh[0], fresh[1])

    def keep_rows(self, start: int, end: int, view: Tensor) -> None:
        """Remember ``view`` as accumulator rows ``[start, end)`` (see :meth:`rows`); no write
        is pending any more."""
        self._fresh = (start, end, view, self.acc_address)
        self._pending = None

    def written(self) -> None:
        """The pending write ran without keeping views of ``acc``: forget the committed rows'
        own view (their memory may be reused)."""
        self._fresh = None
        self._pending = None

    def flush(self) -> None:
        """Run the pending write of :meth:`defer`, if any (it writes every state of its
        commit)."""
        write = self._pending
        if write is not None:
            self._pending = None
            write()

    def release(self) -> None:
        """Drop the tensors (the core state is freed by the proposer); a pending write is
        dropped with them."""
        self.acc = None
        self._fresh = None
        self._pending = None
        self._table = None

    @property
    def page_table_dev(self) -> Tensor | None:
        """The page table on the device ``[num_pages]`` int32 (``None`` before the first
        proposal and after free), made from the core's table when it changed since the last
        access: no proposal makes one per sequence."""
        # `prefill_done`: a proposal was confirmed since allocation (free resets it)
        if self.acc is None or not self.ctx.prefill_done:
            return None
        version = self.ctx.version
        if self._table is None or self._table[0] != version:
            table = torch.tensor(self.ctx.page_table, dtype=torch.int32, device=self.acc.device)
            self._table = (version, table)
        return self._table[1]

    @property
    def owner(self) -> int:
        return self.ctx.owner

    @property
    def window(self) -> int:
        return self.ctx.window

    @property
    def ctx_len(self) -> int:
        return self.ctx.ctx_len

    @property
    def ctx_committed(self) -> int:
        return self.ctx.ctx_committed

    @property
    def ctx_positions(self) -> list[int]:
        return self.ctx.ctx_positions

    @property
    def page_table(self) -> list[int]:
        return self.ctx.page_table

    @property
    def seq_len(self) -> int:
        return self.ctx.seq_len

    @property
    def prefill_done(self) -> bool:
        return self.ctx.prefill_done

    @property
    def last_num_drafted(self) -> int:
        return self.ctx.last_num_drafted

    @property
    def last_num_accepted(self) -> int:
        return self.ctx.last_num_accepted

    @property
    def freed(self) -> bool:
        return self.ctx.freed

    def __repr__(self) -> str:
        return (
            f"DFlashState(window={self.window}, ctx_len={self.ctx_len}, "
            f"ctx_committed={self.ctx_committed}, pages={self.ctx.num_pages}, "
            f"freed={self.freed})"
        )


@dataclass(slots=True)
class Proposal:
    """One proposal over ``n`` sequences, as parallel lists: the states (and their core
    states), anchors and their positions, and the outstanding K/V plans from
    ``plan_proposals`` (each state's rows ``[plan.row_start, plan.row_end)`` still need K/V in
    the paged cache, into ``plan.slots``)."""

    states: list[DFlashState]
    ctxs: list[ContextState]
    tokens: list[int]
    positions: list[int]
    plans: list[PrecomputePlan]

    def confirm(self, counts: int | list[int]) -> None:
        """The drafts exist: confirm every plan (their K/V is stored) and note each proposal
        (``counts[i]`` drafts, or ``counts`` for every sequence)."""
        _core.confirm_proposals(self.plans, self.positions, counts)

    def abort(self) -> None:
        """Give back every plan's pages (confirmed plans are ignored)."""
        _core.abort_plans(self.plans)


__all__ = ["DFlashState", "Proposal"]
