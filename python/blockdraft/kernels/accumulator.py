# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Accumulator rows: batched append of captured target rows, and the graph path's gather of
staged rows.

Each sequence owns its own accumulator tensor ``[W_i, C]`` (``C = k * H``), so one launch
reaches all of them through a device table of base pointers built by the launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_APPEND_BLOCK_C = 1024


@triton.jit(do_not_specialize=["num_rows", "row_stride"])
def acc_append_kernel(
    rows_ptr,  # [R, C], rows row_stride elements apart, columns contiguous
    meta_ptr,  # [2, R] int64: accumulator index of each row, destination row in it
    table_ptr,  # [n] int64: base address of each accumulator [W_i, C] contiguous
    num_rows,
    num_cols,
    row_stride,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cblk = tl.program_id(1).to(tl.int64)
    acc_idx = tl.load(meta_ptr + row)
    dst_row = tl.load(meta_ptr + num_rows + row)
    base = tl.load(table_ptr + acc_idx).to(tl.pointer_type(rows_ptr.dtype.element_ty))
    cols = cblk * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask = cols < num_cols
    x = tl.load(rows_ptr + row * row_stride + cols, mask=mask)
    tl.store(base + dst_row * num_cols + cols, x, mask=mask)


@triton.jit
def stage_gather_kernel(
    meta_ptr,  # [m, meta_cols] int64: the graph path's metadata (blockdraft_core::step layout)
    stage_ptr,  # [cap, C] contiguous: the gathered rows
    meta_cols,
    slot_col,  # first slot column
    src_col,  # first source-address column
    num_cols,
    GAMMA: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Staged row j is metadata row j // GAMMA, entry j % GAMMA: its slot says whether it is
    # used, its source column where it lies (an accumulator row, by address).
    j = tl.program_id(0).to(tl.int64)
    cblk = tl.program_id(1).to(tl.int64)
    row = meta_ptr + (j // GAMMA) * meta_cols + j % GAMMA
    slot = tl.load(row + slot_col)
    addr = tl.load(row + src_col)
    cols = cblk * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    in_row = cols < num_cols
    src = addr.to(tl.pointer_type(stage_ptr.dtype.element_ty))
    # An unused entry (slot < 0) reads nothing: its address may be stale or 0.
    x = tl.load(src + cols, mask=in_row & (slot >= 0), other=0)
    tl.store(stage_ptr + j * num_cols + cols, x, mask=in_row)


def stage_gather(
    meta: torch.Tensor, slot_col: int, src_col: int, block_size: int, stage: torch.Tensor
) -> None:
    """Gather the graph path's staged accumulator rows into ``stage`` [cap, C] on the device,
    by the source addresses in ``meta`` (``block_size`` slot and source-address columns from
    ``slot_col`` and ``src_col``; the layout is ``GraphMeta.layout``): a launch that a CUDA graph
    can replay, so the host copies no rows. Unused entries (``PAD_SLOT``) give zero rows. The
    sources must be live tensors of ``stage``'s dtype and row width, on its device; the caller
    (the graph runner, with the proposer's accumulators) guarantees that, nothing here can check
    it."""
    cap, num_cols = stage.shape
    if cap == 0 or num_cols == 0:
        return
    grid = (cap, triton.cdiv(num_cols, _APPEND_BLOCK_C))
    stage_gather_kernel[grid](meta, stage, meta.shape[1], slot_col, src_col, num_cols,
                              GAMMA=block_size, BLOCK_C=_APPEND_BLOCK_C, num_warps=4)


def append_table(addrs: Sequence[int], row_map: Sequence[int], device: torch.device) -> torch.Tensor:
    """The device table of :func:`acc_append`: ``row_map`` (per row of the rows to
    append the index of its accumulator in ``addrs``, then per row its destination row: the
    core's ``AppendBatch.row_map``) followed by the accumulators' base addresses. Made apart
    from the launch so that a caller can make every allocation before it writes anything."""
    return torch.tensor([*row_map, *addrs], dtype=torch.int64).to(device, non_blocking=True)


def acc_append(rows: torch.Tensor, table: torch.Tensor) -> None:
    """Rows ``[R, C]`` (columns contiguous, rows any stride apart: a step's first row of each
    block is a strided view of the verify's rows) into the accumulators given by their device
    addresses in ``table`` (:func:`append_table`), one launch: the contract of
    ``reference.acc_append`` with the destinations as addresses. Nothing is checked (the
    checks would cost µs per accumulator): the caller's accumulators meet the contract by
    construction (the proposer's own, contiguous ``[W, C]`` in the rows' dtype on their
    device)."""
    num_rows, num_cols = rows.shape
    if num_rows == 0 or num_cols == 0:
        return
    grid = (num_rows, triton.cdiv(num_cols, _APPEND_BLOCK_C))
    acc_append_kernel[grid](rows, table, table[2 * num_rows :], num_rows, num_cols, rows.stride(0),
                            BLOCK_C=_APPEND_BLOCK_C, num_warps=4)
