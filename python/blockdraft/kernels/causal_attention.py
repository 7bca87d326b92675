# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Causal attention of new rows over their sequences' paged K/V (the target's attention).

One kernel for a prefill chunk, a verify block and a single decode row, for many sequences of
different lengths in one launch. The new rows' own K/V are written into the pages first, so a
query at position ``p`` sees keys ``0..p`` of its sequence (``p - window < key`` in sliding
layers) and causality among the new rows is the same rule as over the context.

Flash-decoding layout: one program per (sequence, tile of ``BLOCK_Q`` new rows, K/V head,
context split) handles the tile's rows times the ``Hq / Hkv`` query heads that share the K/V
head, so each K/V byte is read once per tile and split. Tiles past a sequence's rows exit at
once; the grid and the split count are functions of shapes only (the batch, the most rows of a
sequence, the page-table width), never of per-step lengths, so a launch can be captured in a
CUDA graph. Each program reads its sequence's length on the device and takes its split's
share of that sequence's keys, so a table far wider than the sequences (a runtime's, sized for
its longest) leaves no split idle. The splits' partial softmax states are combined by the
block-attention combine kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, interpreting, next_pow2, sm_count, split_count, split_span
from .paged_attention import block_attention_combine_kernel

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: no inf - inf
_LOG2E = 1.4426950408889634


@triton.jit
def _key_tile(
    q, qp, row_mask, m_i, l_i, acc, t0, hi, seq, kvh, pt_ptr, spt0, kc_ptr, vc_ptr, qk_scale,
    window,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SLIDING: tl.constexpr, IEEE: tl.constexpr,
):
    # Keys at positions [t0, t0 + BLOCK_N) clipped to `hi`, gathered through the page table.
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    kp = t0 + tl.arange(0, BLOCK_N).to(tl.int64)
    n_mask = kp < hi
    page = tl.load(pt_ptr + seq * spt0 + kp // PAGE, mask=n_mask, other=0).to(tl.int64)
    slot = page * PAGE + kp % PAGE
    kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + dims[None, :]
    kv_mask = n_mask[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    vis = n_mask[None, :] & (kp[None, :] <= qp[:, None]) & row_mask[:, None]
    if SLIDING:
        vis = vis & ((qp[:, None] - kp[None, :]) < window)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["spt0", "split_len", "window"])
def causal_attention_kernel(
    q_ptr,  # [R, Hq, D] (last dim contiguous)
    kc_ptr,  # [num_pages, page_size, Hkv, D] contiguous
    vc_ptr,  # [num_pages, page_size, Hkv, D] contiguous
    pt_ptr,  # [n, W] int32 page tables
    qs_ptr,  # [n + 1] int32: sequence i's new rows are rows qs[i] .. qs[i + 1] - 1
    kvl_ptr,  # [n] int32: keys (positions 0 .. kvl - 1) in sequence i's pages
    pos_ptr,  # [R] int64: each new row's position
    out_ptr,  # [R, Hq, D] contiguous (written when ONE_SPLIT)
    part_o_ptr,  # [R * Hq, NUM_SPLITS, D] fp32 (written otherwise)
    part_ml_ptr,  # [R * Hq, NUM_SPLITS, 2] fp32: running max (log2 domain), sum
    sq0, sq1,
    spt0,
    split_len,  # key positions per split, a multiple of BLOCK_N; 0: each sequence's keys / NUM_SPLITS
    window,  # sliding window (used when SLIDING)
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2).to(tl.int64) % NUM_KV_HEADS
    split = tl.program_id(2).to(tl.int64) // NUM_KV_HEADS
    num_heads: tl.constexpr = NUM_KV_HEADS * GROUP

    q_start = tl.load(qs_ptr + seq).to(tl.int64)
    q_end = tl.load(qs_ptr + seq + 1).to(tl.int64)
    q0 = q_start + tile * BLOCK_Q
    if q0 < q_end:
        rows = tl.arange(0, BLOCK_M).to(tl.int64)
        qi = q0 + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_mask = (rows < BLOCK_Q * GROUP) & (qi < q_end)
        dims = tl.arange(0, BLOCK_D).to(tl.int64)
        d_mask = dims < HEAD_DIM
        q = tl.load(q_ptr + qi[:, None] * sq0 + head[:, None] * sq1 + dims[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        qp = tl.load(pos_ptr + qi, mask=row_mask, other=0)

        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        kv_len = tl.load(kvl_ptr + seq).to(tl.int64)
        # the keys any row of the tile can see: up to its last row, from its first row's window
        hi = tl.minimum(tl.max(tl.where(row_mask, qp, -1), axis=0) + 1, kv_len)
        # split_len 0: splits of this sequence's own keys, so every split has work whatever
        # the table's width (a runtime's tables are as wide as its longest sequence could be).
        own = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        span = tl.where(split_len == 0, own, split_len)
        lo = split * span
        if SLIDING:
            first = tl.min(tl.where(row_mask, qp, 1 << 62), axis=0)
            lo = tl.maximum(lo, (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N)
        end = tl.minimum((split + 1) * span, hi)
        if INTERPRET:
            # The CPU interpreter cannot take tensor loop bounds in range(); a while loop is the
            # same iteration (but is not software-pipelined on the GPU, hence two spellings).
            t0 = lo
            while t0 < end:
                m_i, l_i, acc = _key_tile(
                    q, qp, row_mask, m_i, l_i, acc, t0, end, seq, kvh, pt_ptr, spt0, kc_ptr,
                    vc_ptr, qk_scale, window, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D,
                    SLIDING, IEEE)
                t0 += BLOCK_N
        else:
            for t0 in range(lo, end, BLOCK_N):
                m_i, l_i, acc = _key_tile(
                    q, qp, row_mask, m_i, l_i, acc, t0, end, seq, kvh, pt_ptr, spt0, kc_ptr,
                    vc_ptr, qk_scale, window, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D,
                    SLIDING, IEEE)

        out_rows = qi * num_heads + head  # row index into [R, Hq]
        o_mask = row_mask[:, None] & d_mask[None, :]
        if ONE_SPLIT:
            # masked rows (past the tile's sequence) saw no key: keep their 0 / 0 out of the math
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            part = out_rows * NUM_SPLITS + split
            tl.store(part_o_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=o_mask)
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


def tile_rows(max_rows: int, group: int) -> int:
    """New rows per program: all of a decode or verify block (up to ``128 / group``), so a
    block's rows share each K/V load; a prefill chunk is cut into tiles of that many."""
    return max(1, min(next_pow2(max(1, max_rows)), max(1, 128 // group)))


def default_num_splits(programs: int, max_ctx: int, device: torch.device, block_n: int) -> int:
    """Context splits: about 2 programs per SM over ``programs`` (sequences x tiles x K/V
    heads) rounded up to a power of two, as a power of two no larger than the tiles of
    ``max_ctx`` rounded up (:func:`~._validate.split_count`): the count is a compile-time
    constant, so it takes one of a few values whatever the batch and the lengths."""
    tiles = max(1, math.ceil(max_ctx / block_n))
    want = max(1, min(tiles, math.ceil(2 * sm_count(device) / next_pow2(max(1, programs)))))
    return split_count(want, tiles)


def launch_config(n: int, max_rows: int, group: int, kv_heads: int, max_ctx: int,
                  device: torch.device) -> tuple[int, int, int, int, int]:
    """``(BLOCK_Q, q tiles, BLOCK_M, BLOCK_N, default splits)`` of a call over ``n`` sequences
    whose longest holds ``max_rows`` new rows. Every compile-time constant among them depends
    on ``n`` and ``max_rows`` only through their powers-of-two classes (``next_pow2``), so a
    warm-up that runs one call per class compiles every variant a request can reach."""
    block_q = tile_rows(max_rows, group)
    q_tiles = math.ceil(max_rows / block_q)
    block_m = max(16, next_pow2(block_q * group))
    block_n = 64 if block_m <= 64 else 32
    programs = next_pow2(max(1, n)) * next_pow2(q_tiles) * kv_heads
    return block_q, q_tiles, block_m, block_n, default_num_splits(programs, max_ctx, device, block_n)


def causal_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    q_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_rows: int | None = None,
    num_splits: int | None = None,
    split_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton causal attention; same contract as ``reference.causal_attention``.

    Extra keywords: ``max_rows`` bounds any sequence's new rows (default: all ``R`` rows; a
    caller that knows it, e.g. a verify of B rows per sequence, gives it so the grid is
    small and fixed); ``num_splits`` overrides the shape-derived split count; ``split_len``
    fixes the keys per split (default: each sequence's keys over the splits, read on the
    device; a fixed span over the table's width leaves the splits past a short sequence
    empty); ``out`` ``[R, Hq, D]`` contiguous receives the result. Lengths live on the device
    and are not checked: ``kv_lens[i] <= W * page_size`` and each row's position below its
    ``kv_lens``.
    """
    check("q", q, shape=[None, None, None], dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_rows, num_heads, head_dim = q.shape
    dev, dt = q.device, q.dtype
    check("k_cache", k_cache, shape=[None, None, None, head_dim], dtypes=[dt], device=dev,
          contiguous=True)
    kv_heads = k_cache.shape[2]
    if kv_heads == 0 or num_heads % kv_heads:
        raise ValueError(f"k_cache: {kv_heads} K/V heads do not divide {num_heads} query heads")
    check("v_cache", v_cache, shape=list(k_cache.shape), dtypes=[dt], device=dev, contiguous=True)
    page = k_cache.shape[1]
    check("page_tables", page_tables, shape=[None, None], dtypes=[torch.int32], device=dev,
          last_dim_contiguous=True)
    n = page_tables.shape[0]
    check("q_starts", q_starts, shape=[n + 1], dtypes=[torch.int32], device=dev, contiguous=True)
    check("kv_lens", kv_lens, shape=[n], dtypes=[torch.int32], device=dev, contiguous=True)
    check("positions", positions, shape=[num_rows], dtypes=[torch.int64], device=dev,
          contiguous=True)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window: must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty((num_rows, num_heads, head_dim), dtype=dt, device=dev)
    else:
        check("out", out, shape=[num_rows, num_heads, head_dim], dtypes=[dt], device=dev,
              contiguous=True)
    if n == 0 or num_rows == 0:
        return out

    group = num_heads // kv_heads
    max_ctx = page_tables.shape[1] * page
    block_q, q_tiles, block_m, block_n, splits = launch_config(
        n, num_rows if max_rows is None else max(1, max_rows), group, kv_heads, max_ctx, dev)
    block_d = max(16, next_pow2(head_dim))
    if num_splits is None:
        num_splits = splits
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    split_len = split_span(split_len, num_splits, block_n, max_ctx)
    one = num_splits == 1
    rows = num_rows * num_heads
    # Every (row, split) partial is written by the one tile holding the row (an empty split
    # writes sum 0), so the buffers need no initial value.
    part_o = torch.empty((1,) if one else (rows, num_splits, head_dim), dtype=torch.float32,
                         device=dev)
    part_ml = torch.empty((1,) if one else (rows, num_splits, 2), dtype=torch.float32,
                          device=dev)
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    causal_attention_kernel[(n, q_tiles, kv_heads * num_splits)](
        q, k_cache, v_cache, page_tables, q_starts, kv_lens, positions, out, part_o, part_ml,
        q.stride(0), q.stride(1), page_tables.stride(0),
        split_len, int(sliding_window or 0), float(scale) * _LOG2E,
        GROUP=group, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE=page,
        NUM_SPLITS=num_splits, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, SLIDING=sliding_window is not None, IEEE=dt == torch.float32,
        ONE_SPLIT=one, INTERPRET=interpreting(), num_warps=num_warps,
    )
    if not one:
        block_attention_combine_kernel[(rows,)](
            part_o, part_ml, out,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits),
            BLOCK_D=block_d, num_warps=4,
        )
    return out
