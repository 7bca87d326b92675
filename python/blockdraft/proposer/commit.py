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
        if faults.active():
            faults.hit("accumulator")
        entries = batch.entries  # (state index, src row, dst row, count) per state with rows
        if not entries:
            return
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
            new_rows = new_rows.contiguous()
            addrs = [states[e[0]].acc_address for e in entries]
            # Allocated before the first write: a failure here leaves every state as it was.
            table = ops.append_table(addrs, batch.row_map(), new_rows.device)
        for acc, keep, kept in moves:
            acc[:keep] = kept
        if table is not None:
            assert ops.acc_append is not None
            ops.acc_append(new_rows, table)
        else:
            whole = new_rows.shape[0]
            for (i, src, dst, count), acc in zip(entries, accs):
                view = acc[dst : dst + count]
                view.copy_(new_rows if count == whole else new_rows[src : src + count])
                states[i].keep_rows(dst, dst + count, view)
        batch.apply()


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


__all__ = ["ContextWriter", "as_positions", "check_rows"]
