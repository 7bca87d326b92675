# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Accumulator rows: batched append of captured target rows, the slide, and the graph path's
gather of staged rows.

Each sequence owns its own accumulator tensor ``[W_i, C]`` (``C = k * H``), so one launch
reaches all of them through a device table of base pointers built by the launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check

_APPEND_BLOCK_C = 1024
_SLIDE_BLOCK_C = 256
_SLIDE_ROWS = 16


@triton.jit
def acc_append_kernel(
    rows_ptr,  # [R, C] contiguous
    meta_ptr,  # [2, R] int64: accumulator index of each row, destination row in it
    table_ptr,  # [n] int64: base address of each accumulator [W_i, C] contiguous
    num_rows,
    num_cols,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cblk = tl.program_id(1).to(tl.int64)
    acc_idx = tl.load(meta_ptr + row)
    dst_row = tl.load(meta_ptr + num_rows + row)
    base = tl.load(table_ptr + acc_idx).to(tl.pointer_type(rows_ptr.dtype.element_ty))
    cols = cblk * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask = cols < num_cols
    x = tl.load(rows_ptr + row * num_cols + cols, mask=mask)
    tl.store(base + dst_row * num_cols + cols, x, mask=mask)


@triton.jit
def acc_slide_kernel(
    meta_ptr,  # [3, n] int64: base address of each accumulator [W_i, C], src start, keep
    num_accs,
    num_cols,
    ELEM: tl.constexpr,  # element dtype of the accumulators
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Source rows are above their destinations (dst = src - src_start), so walking tiles in
    # ascending row order and loading a whole tile before storing it never reads a row that
    # was already overwritten: each program owns its columns exclusively.
    seq = tl.program_id(0).to(tl.int64)
    cblk = tl.program_id(1).to(tl.int64)
    base = tl.load(meta_ptr + seq).to(tl.pointer_type(ELEM))
    src = tl.load(meta_ptr + num_accs + seq)
    keep = tl.load(meta_ptr + 2 * num_accs + seq)
    cols = cblk * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    c_mask = cols < num_cols
    r = tl.arange(0, ROWS).to(tl.int64)
    # a while loop: the CPU interpreter cannot take a runtime bound in range()
    j0 = keep * 0
    while j0 < keep:
        dst = j0 + r
        mask = (dst < keep)[:, None] & c_mask[None, :]
        x = tl.load(base + (src + dst)[:, None] * num_cols + cols[None, :], mask=mask)
        tl.store(base + dst[:, None] * num_cols + cols[None, :], x, mask=mask)
        j0 += ROWS


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
    meta: torch.Tensor, slot_col: int, src_col: int, gamma: int, stage: torch.Tensor
) -> None:
    """Gather the graph path's staged accumulator rows into ``stage`` [cap, C] on the device,
    by the source addresses in ``meta`` (``gamma`` slot and source-address columns from
    ``slot_col`` and ``src_col``; the layout is ``GraphMeta.layout``): a launch that a CUDA graph can replay, so the host copies no
    rows. Unused entries (``PAD_SLOT``) give zero rows. The sources must be live tensors of
    ``stage``'s dtype and row width, on its device; the caller (the graph runner, with the
    proposer's accumulators) guarantees that, nothing here can check it."""
    cap, num_cols = stage.shape
    if cap == 0 or num_cols == 0:
        return
    grid = (cap, triton.cdiv(num_cols, _APPEND_BLOCK_C))
    stage_gather_kernel[grid](meta, stage, meta.shape[1], slot_col, src_col, num_cols,
                              GAMMA=gamma, BLOCK_C=_APPEND_BLOCK_C, num_warps=4)


def _check_accs(accs: Sequence[torch.Tensor], num_cols: int | None,
                dtype: torch.dtype | None, device: torch.device | None) -> None:
    for i, acc in enumerate(accs):
        check(f"accs[{i}]", acc, shape=[None, num_cols], dtypes=[dtype] if dtype else FLOAT_DTYPES,
              device=device, contiguous=True)
        num_cols, dtype, device = acc.shape[1], acc.dtype, acc.device


def _check_counts(name: str, values: Sequence[int], n: int) -> list[int]:
    out = [int(v) for v in values]
    if len(out) != n:
        raise ValueError(f"{name}: expected {n} entries (one per accumulator), got {len(out)}")
    if any(v < 0 for v in out):
        raise ValueError(f"{name}: entries must be >= 0, got {out}")
    return out


def acc_append(
    accs: Sequence[torch.Tensor],
    rows: torch.Tensor,
    row_counts: Sequence[int],
    dst_starts: Sequence[int],
) -> None:
    """Triton batched append; same contract as ``reference.acc_append``.

    accs: n tensors [W_i, C] contiguous, rows' dtype and device; rows [R, C] contiguous with
    ``R == sum(row_counts)``; ``dst_starts[i] + row_counts[i] <= W_i``.
    """
    check("rows", rows, shape=[None, None], dtypes=FLOAT_DTYPES, contiguous=True)
    num_rows, num_cols = rows.shape
    _check_accs(accs, num_cols, rows.dtype, rows.device)
    counts = _check_counts("row_counts", row_counts, len(accs))
    starts = _check_counts("dst_starts", dst_starts, len(accs))
    if sum(counts) != num_rows:
        raise ValueError(f"row_counts: sum {sum(counts)} != rows.shape[0] {num_rows}")
    for i, (acc, c, s) in enumerate(zip(accs, counts, starts)):
        if s + c > acc.shape[0]:
            raise ValueError(f"dst_starts[{i}]: rows [{s}, {s + c}) exceed accumulator of "
                             f"{acc.shape[0]} rows")
    row_map = [i for i, c in enumerate(counts) for _ in range(c)]
    row_map += [s + j for s, c in zip(starts, counts) for j in range(c)]
    acc_append_mapped(rows, append_table([a.data_ptr() for a in accs], row_map, rows.device))


def append_table(addrs: Sequence[int], row_map: Sequence[int], device: torch.device) -> torch.Tensor:
    """The device table of :func:`acc_append_mapped`: ``row_map`` (per row of the rows to
    append the index of its accumulator in ``addrs``, then per row its destination row: the
    core's ``AppendBatch.row_map``) followed by the accumulators' base addresses. Made apart
    from the launch so that a caller can make every allocation before it writes anything."""
    return torch.tensor([*row_map, *addrs], dtype=torch.int64).to(device, non_blocking=True)


def acc_append_mapped(rows: torch.Tensor, table: torch.Tensor) -> None:
    """:func:`acc_append` without its argument checks (which cost µs per accumulator), for a
    caller whose accumulators meet the contract by construction (the proposer's own, made
    contiguous ``[W, C]`` in its dtype on its device), given by their addresses in ``table``
    (:func:`append_table`). One launch."""
    num_rows, num_cols = rows.shape
    if num_rows == 0 or num_cols == 0:
        return
    grid = (num_rows, triton.cdiv(num_cols, _APPEND_BLOCK_C))
    acc_append_kernel[grid](rows, table, table[2 * num_rows :], num_rows, num_cols,
                            BLOCK_C=_APPEND_BLOCK_C, num_warps=4)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def acc_slide(accs: Sequence[torch.Tensor], src_starts: Sequence[int], keeps: Sequence[int]) -> None:
    """Triton batched slide; same contract as ``reference.acc_slide``.

    accs: n tensors [W_i, C] contiguous, one dtype, device and C;
    ``src_starts[i] + keeps[i] <= W_i``.
    """
    if len(accs) == 0:
        return
    _check_accs(accs, None, None, None)
    srcs = _check_counts("src_starts", src_starts, len(accs))
    keep = _check_counts("keeps", keeps, len(accs))
    for i, (acc, s, k) in enumerate(zip(accs, srcs, keep)):
        if s + k > acc.shape[0]:
            raise ValueError(f"src_starts[{i}]: rows [{s}, {s + k}) exceed accumulator of "
                             f"{acc.shape[0]} rows")
    num_cols = accs[0].shape[1]
    max_keep = max(keep)
    if max_keep == 0 or num_cols == 0:
        return
    meta = torch.tensor([[a.data_ptr() for a in accs], srcs, keep], dtype=torch.int64)
    meta = meta.to(accs[0].device)
    grid = (len(accs), triton.cdiv(num_cols, _SLIDE_BLOCK_C))
    acc_slide_kernel[grid](meta, len(accs), num_cols, ELEM=_TL_DTYPES[accs[0].dtype],
                           ROWS=_SLIDE_ROWS, BLOCK_C=_SLIDE_BLOCK_C, num_warps=4)
