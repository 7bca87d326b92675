# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""The draft forward's inputs from the CUDA-graph metadata, in one launch.

The graph path keeps per sequence ``[ctx len, anchor token, anchor position, page table ...]``
in one int64 row of ``meta`` (see :mod:`blockdraft.graphs`). This kernel turns it into what the
drafter layers take: ctx lengths and page tables as int32, the block's embedded tokens
``[anchor, MASK x (B-1)]`` and their positions. It replaces about eight small torch launches
(fill, index, arange, add, the embedding gather, two dtype conversions) inside the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import check


@triton.jit(do_not_specialize=["mask_id"])
def block_inputs_kernel(
    meta_ptr,  # [m, C] int64 contiguous
    embed_ptr,  # [V, H] (row stride s_embed, last dim contiguous)
    emb_out_ptr,  # [m, B, H]
    pos_out_ptr,  # [m, B] int64
    lens_out_ptr,  # [m] int32
    tables_out_ptr,  # [m, W] int32
    mask_id,
    s_embed,
    COLS: tl.constexpr,
    TABLE_COL: tl.constexpr,
    WIDTH: tl.constexpr,
    HIDDEN: tl.constexpr,
    B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # Programs (i, j < B): row j of sequence i's block (embedding + position); (i, B): its
    # ctx length and page table.
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = meta_ptr + i * COLS
    if j < B:
        tok = tl.where(j == 0, tl.load(row + 1), mask_id)  # the anchor, then MASKs
        tl.store(pos_out_ptr + i * B + j, tl.load(row + 2) + j)
        cols = tl.arange(0, BLOCK_H)
        src = embed_ptr + tok * s_embed
        dst = emb_out_ptr + (i * B + j) * HIDDEN
        for h0 in range(0, HIDDEN, BLOCK_H):
            ok = h0 + cols < HIDDEN
            x = tl.load(src + h0 + cols, mask=ok, other=0.0)
            tl.store(dst + h0 + cols, x.to(emb_out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(lens_out_ptr + i, tl.load(row).to(tl.int32))
        w = tl.arange(0, BLOCK_W)
        for w0 in range(0, WIDTH, BLOCK_W):
            ok = w0 + w < WIDTH
            t = tl.load(row + TABLE_COL + w0 + w, mask=ok, other=0)
            tl.store(tables_out_ptr + i * WIDTH + w0 + w, t.to(tl.int32), mask=ok)


def block_inputs(
    meta: torch.Tensor,
    table_col: int,
    width: int,
    embed: torch.Tensor,
    mask_id: int,
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher; same contract as ``reference.block_inputs``."""
    check("meta", meta, shape=[None, None], dtypes=[torch.int64], contiguous=True)
    check("embed", embed, shape=[None, None], device=meta.device, last_dim_contiguous=True)
    m, cols = meta.shape
    if table_col + width > cols or table_col < 3:
        raise ValueError(f"meta: {cols} columns cannot hold a table of {width} at {table_col}")
    if block < 1:
        raise ValueError(f"block: must be >= 1, got {block}")
    hidden = embed.shape[1]
    dev = meta.device
    lens = torch.empty(m, dtype=torch.int32, device=dev)
    tables = torch.empty((m, width), dtype=torch.int32, device=dev)
    embeds = torch.empty((m, block, hidden), dtype=dtype, device=dev)
    q_pos = torch.empty((m, block), dtype=torch.int64, device=dev)
    if m:
        block_inputs_kernel[(m, block + 1)](
            meta, embed, embeds, q_pos, lens, tables, int(mask_id), embed.stride(0),
            COLS=cols, TABLE_COL=table_col, WIDTH=width, HIDDEN=hidden, B=block,
            BLOCK_H=min(4096, triton.next_power_of_2(hidden)),
            BLOCK_W=min(1024, triton.next_power_of_2(max(1, width))), num_warps=4,
        )
    return lens, tables, embeds, q_pos
