"""The commit path: verified target rows into the sequences' accumulators, as the core plans.

``plan_appends`` (the core) checks every state and position and decides, per state, which rows
it keeps, where they go and whether its window slides first; this module moves the tensors
accordingly and then records the batch in the core (``AppendBatch.apply``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from blockdraft import faults
from blockdraft._core import AppendBatch
from blockdraft.kernels import KernelOps
from blockdraft.proposer.state import DFlashState


def check_rows(hidden_rows: object, width: int, device: torch.device) -> Tensor:
    """``hidden_rows`` must be a floating ``[R, width]`` tensor on a device of ``device``'s
    type (rows are moved to ``device`` itself when written).

    Raises:
        TypeError / ValueError: it is not.
    """
    if not isinstance(hidden_rows, Tensor):
        raise TypeError(f"hidden_rows must be a torch.Tensor, not {type(hidden_rows).__name__}")
    if not hidden_rows.is_floating_point():
        raise TypeError(f"hidden_rows must be floating point, not {hidden_rows.dtype}")
    if hidden_rows.dim() != 2 or hidden_rows.shape[1] != width:
        raise ValueError(f"hidden_rows must be [R, {width}] (k*H), not {list(hidden_rows.shape)}")
    if hidden_rows.device.type != device.type:
        raise ValueError(f"hidden_rows are on {hidden_rows.device}, the proposer on {device}")
    return hidden_rows


def as_positions(positions: Sequence[int] | Tensor | Iterable[int]) -> Sequence[int]:
    """Positions as the core takes them: a list, tuple or range as it is, a tensor as its
    list, any other iterable listed (the core checks the ints: a float position is never
    rounded)."""
    if isinstance(positions, (list, tuple, range)):
        return positions
    if isinstance(positions, Tensor):
        out: list[int] = positions.tolist()
        return out
    try:
        return list(positions)
    except TypeError:
        raise TypeError(
            f"positions must be a sequence of ints, not {type(positions).__name__}"
        ) from None


class ContextWriter:
    """Carries out checked ``AppendBatch`` es for one proposer's accumulators.

    Args:
        ops: the proposer's kernels (a batched append where the backend has one).
        block_size: B; a batch of at most B rows per state is a serving step's commit.
    """

    def __init__(self, ops: KernelOps, block_size: int) -> None:
        self.ops = ops
        self.block_size = block_size

    def write(self, states: Sequence[DFlashState], batch: AppendBatch, hidden_rows: Tensor) -> None:
        """The slides, the rows into the accumulators, then the record in the core. Every
        allocation (the rows in the accumulators' dtype, each slide's copy of the rows it
        keeps, the kernel's table) happens before an accumulator is touched: a failure (device
        OOM) leaves every accumulator as it was, since the core still describes the old
        layout.

        A state written by a copy keeps the view of its new rows (``DFlashState.keep_rows``):
        the graph path stages exactly those rows at the next proposal in the common case, and
        a view of ``acc`` by row range stays right for that range for as long as the
        accumulator lives."""
        write = self._prepare(states, batch, hidden_rows)
        if write is not None:
            write.run()
        batch.apply()

    def deferred(self, states: Sequence[DFlashState], batch: AppendBatch, hidden_rows: Tensor) -> Deferred:
        """:meth:`write` with the copies left to the end of a ``with`` block: every allocation
        is made and the core records the batch at once; inside the block each state's new
        rows are read from ``hidden_rows`` (``DFlashState.defer``: a proposal stages them
        from there), and any other read of an accumulator writes them all first. A batch that
        slides a window is written at once."""
        if batch.slides:
            self.write(states, batch, hidden_rows)
            return Deferred(None)
        write = self._prepare(states, batch, hidden_rows)
        batch.apply()
        if write is not None:
            write.defer()
        return Deferred(write)

    def _prepare(self, states: Sequence[DFlashState], batch: AppendBatch, hidden_rows: Tensor) -> _Write | None:
        """The batch's writes with every allocation made, nothing written (``None``: no
        rows)."""
        if faults.active():
            faults.hit("accumulator")
        entries = batch.entries  # (state index, src row, dst row, count) per state with rows
        if not entries:
            return None
        accs: list[Tensor] = [states[e[0]].acc for e in entries]  # type: ignore[misc]
        new_rows = _detached(hidden_rows, accs[0])
        slides = batch.slides
        moves = _prepare_slides(slides, accs) if slides else []
        # One kernel launch takes many sequences' rows as they are when no state's rows were
        # cut (so they lie in order, back to back) and they are a step's few per sequence (the
        # steady state: up to B); one sequence, bigger commits (prefills) and the torch backend
        # copy per sequence.
        n = len(entries)
        ops = self.ops
        table: Tensor | None = None
        if (ops.acc_append is not None and ops.append_table is not None and 1 < n
                and batch.n_rows == batch.kept <= self.block_size * n):
            # The kernel reads rows any stride apart (a step's first row of each block is a
            # strided view of the verify's rows) but each row's columns contiguous.
            if new_rows.stride(-1) != 1:
                new_rows = new_rows.contiguous()
            addrs = [states[e[0]].acc_address for e in entries]
            # Allocated before the first write: a failure here leaves every state as it was.
            table = ops.append_table(addrs, batch.row_map(), new_rows.device)
        return _Write(ops, [states[e[0]] for e in entries], entries, accs, new_rows, moves, table,
                      uncut=batch.n_rows == batch.kept)


class _Write:
    """One ``AppendBatch``'s writes, every allocation made: the slides' kept rows, then the
    new rows (one kernel launch with ``table``, else a copy per state)."""

    def __init__(self, ops: KernelOps, states: list[DFlashState], entries: list[tuple[int, int, int, int]],
                 accs: list[Tensor], new_rows: Tensor, moves: list[tuple[Tensor, int, Tensor]],
                 table: Tensor | None, uncut: bool) -> None:
        self.ops = ops
        self.states = states  # per entry
        self.entries = entries
        self.accs = accs  # held until written: the kernel writes them by address
        self.new_rows = new_rows
        self.moves = moves
        self.table = table
        self.uncut = uncut  # every row is kept: the entries' rows lie back to back, in order
        self.done = False
        self.deferred = False
        self._sources: list[Tensor] | None = None

    def run(self) -> None:
        """Write (once)."""
        if self.done:
            return
        self.done = True
        for acc, keep, kept in self.moves:
            acc[:keep] = kept
        if self.table is not None:
            assert self.ops.acc_append is not None
            self.ops.acc_append(self.new_rows, self.table)
            if self.deferred:
                for st in self.states:
                    st.written()
            return
        for st, src, (_, _, dst, count), acc in zip(self.states, self.sources(), self.entries, self.accs):
            view = acc[dst : dst + count]
            view.copy_(src)
            st.keep_rows(dst, dst + count, view)

    def sources(self) -> list[Tensor]:
        """Per entry its rows of ``new_rows`` (views, made once)."""
        if self._sources is None:
            new_rows = self.new_rows
            if self.uncut and len(self.entries) > 1:
                # One call for all the views (a third of the time of a slice each).
                self._sources = list(new_rows.split_with_sizes([e[3] for e in self.entries]))
            else:
                whole = new_rows.shape[0]
                self._sources = [new_rows if count == whole else new_rows[src : src + count]
                                 for _, src, _, count in self.entries]
        return self._sources

    def defer(self) -> None:
        """Each state reads its new rows from the rows themselves until :meth:`run`."""
        self.deferred = True
        acc = self.accs[0]
        stride = acc.stride(0)
        row_bytes = stride * acc.element_size()
        for st, view, (_, _, dst, count) in zip(self.states, self.sources(), self.entries):
            # Read by address (the graph path's gather) where the rows lie as the
            # accumulator's do: row r of the state at base + r * its row bytes.
            by_address = view.stride(-1) == 1 and (count == 1 or view.stride(0) == stride)
            st.defer(self.run, dst, dst + count, view,
                     view.data_ptr() - dst * row_bytes if by_address else None)


class Deferred:
    """The ``with`` block of :meth:`ContextWriter.deferred`: its end writes the rows."""

    def __init__(self, write: _Write | None) -> None:
        self._write = write

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if self._write is not None:
            self._write.run()


def _detached(hidden_rows: Tensor, acc: Tensor) -> Tensor:
    """The rows in ``acc``'s dtype and on its device, out of autograd (a ``no_grad`` context
    would cost µs per call)."""
    if hidden_rows.requires_grad:
        hidden_rows = hidden_rows.detach()
    return hidden_rows.to(device=acc.device, dtype=acc.dtype)


def _prepare_slides(
    slides: list[tuple[int, int, int]], accs: list[Tensor]
) -> list[tuple[Tensor, int, Tensor]]:
    """An ``AppendBatch``'s slides (``accs``: per entry its accumulator) made ready without
    touching any accumulator: per slide the accumulator, the number of rows it keeps and a
    copy of them (a fault point each: the copy is an allocation). Writing them is
    ``acc[:keep] = copy``."""
    out = []
    for e, src, keep in slides:
        if faults.active():
            faults.hit("accumulator")
        acc = accs[e]
        out.append((acc, keep, acc[src : src + keep].clone()))
    return out


__all__ = ["ContextWriter", "Deferred", "as_positions", "check_rows"]
