# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Block attention: each sequence's B block queries over its paged ctx K/V plus its own block.

Flash-decoding layout: one program per (sequence, K/V head, context split) handles all
``B * (Hq / Hkv)`` query rows that share the K/V head, so each K/V byte is read once per
split. The number of splits is a pure function of shapes (batch, heads, page-table width, SM
count), never of the per-step context lengths, so a launch is CUDA-graph safe; splits beyond a
sequence's context exit after writing an empty partial. The last split also attends to the
block's own keys. A second kernel combines the splits' partial softmax states.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, interpreting, next_pow2, sm_count, split_count, split_span

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: no inf - inf
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q, k, v, kp, qp, valid_n, m_i, l_i, acc, qk_scale, window,
    SLIDING: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
):
    # q [BLOCK_M, BLOCK_D], k/v [BLOCK_N, BLOCK_D], kp [BLOCK_N] int64, qp [BLOCK_M] int64
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    vis = valid_n[None, :]
    if CAUSAL:
        vis = vis & (kp[None, :] <= qp[:, None])
    if SLIDING:
        vis = vis & ((qp[:, None] - kp[None, :]) < window)
        if not CAUSAL:
            vis = vis & ((kp[None, :] - qp[:, None]) < window)
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


@triton.jit
def _ctx_tile(
    q, qp, m_i, l_i, acc, t0, end, seq, kvh, pt_ptr, spt0, kc_ptr, vc_ptr, slot_pos_ptr,
    qk_scale, window,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
):
    # One tile of BLOCK_N context tokens [t0, t0 + BLOCK_N) clipped to `end`, gathered
    # token by token through the page table.
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    toks = t0 + tl.arange(0, BLOCK_N).to(tl.int64)
    n_mask = toks < end
    page = tl.load(pt_ptr + seq * spt0 + toks // PAGE, mask=n_mask, other=0).to(tl.int64)
    slot = page * PAGE + toks % PAGE
    kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + dims[None, :]
    kv_mask = n_mask[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0)
    if SLIDING or CAUSAL:
        kp = tl.load(slot_pos_ptr + slot, mask=n_mask, other=0).to(tl.int64)
    else:
        kp = toks
    return _attend_tile(q, k, v, kp, qp, n_mask, m_i, l_i, acc, qk_scale, window,
                        SLIDING, CAUSAL, IEEE)


@triton.jit(do_not_specialize=["spt0", "split_len", "window"])
def block_attention_kernel(
    q_ptr,  # [n, B, Hq, D] (last dim contiguous)
    kb_ptr,  # [n, B, Hkv, D] (last dim contiguous)
    vb_ptr,  # [n, B, Hkv, D] (last dim contiguous)
    kc_ptr,  # [num_pages, page_size, Hkv, D] contiguous
    vc_ptr,  # [num_pages, page_size, Hkv, D] contiguous
    pt_ptr,  # [n, max_pages] int32
    ctx_ptr,  # [n] int32
    qpos_ptr,  # [n, B] int64 contiguous
    slot_pos_ptr,  # [num_pages * page_size] int32
    out_ptr,  # [n, B, Hq, D] contiguous (written when ONE_SPLIT)
    part_o_ptr,  # [n, B, Hq, NUM_SPLITS, D] fp32 (written otherwise)
    part_ml_ptr,  # [n, B, Hq, NUM_SPLITS, 2] fp32: running max (log2 domain), sum
    sq0, sq1, sq2,
    skb0, skb1, skb2,
    svb0, svb1, svb2,
    spt0,
    split_len,  # context tokens per split, a multiple of BLOCK_N; 0: each sequence's context / NUM_SPLITS
    window,  # sliding window (used when SLIDING)
    qk_scale,  # softmax scale * log2(e)
    NUM_Q: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    num_heads: tl.constexpr = NUM_KV_HEADS * GROUP

    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    qi = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_mask = rows < NUM_Q * GROUP
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = dims < HEAD_DIM

    q = tl.load(
        q_ptr + seq * sq0 + qi[:, None] * sq1 + head[:, None] * sq2 + dims[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    qp = tl.load(qpos_ptr + seq * NUM_Q + qi, mask=row_mask, other=0)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    ctx_len = tl.load(ctx_ptr + seq).to(tl.int64)
    # split_len 0: splits of this sequence's own context, so every split has work whatever
    # the table's width (the graph path's tables are as wide as the window's ceiling).
    own = tl.maximum(tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    span = tl.where(split_len == 0, own, split_len)
    start = split * span
    end = tl.minimum(start + span, ctx_len)
    if INTERPRET:
        # The CPU interpreter cannot take tensor loop bounds in range(); a while loop is the
        # same iteration (but is not software-pipelined on the GPU, hence two spellings).
        t0 = start
        while t0 < end:
            m_i, l_i, acc = _ctx_tile(
                q, qp, m_i, l_i, acc, t0, end, seq, kvh, pt_ptr, spt0, kc_ptr, vc_ptr,
                slot_pos_ptr, qk_scale, window, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D,
                SLIDING, CAUSAL, IEEE)
            t0 += BLOCK_N
    else:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _ctx_tile(
                q, qp, m_i, l_i, acc, t0, end, seq, kvh, pt_ptr, spt0, kc_ptr, vc_ptr,
                slot_pos_ptr, qk_scale, window, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D,
                SLIDING, CAUSAL, IEEE)

    if split == NUM_SPLITS - 1:
        j = tl.arange(0, BLOCK_NB).to(tl.int64)
        j_mask = j < NUM_Q
        b_mask = j_mask[:, None] & d_mask[None, :]
        kb = tl.load(kb_ptr + seq * skb0 + j[:, None] * skb1 + kvh * skb2 + dims[None, :],
                     mask=b_mask, other=0.0)
        vb = tl.load(vb_ptr + seq * svb0 + j[:, None] * svb1 + kvh * svb2 + dims[None, :],
                     mask=b_mask, other=0.0)
        kpb = tl.load(qpos_ptr + seq * NUM_Q + j, mask=j_mask, other=0)
        m_i, l_i, acc = _attend_tile(q, kb, vb, kpb, qp, j_mask, m_i, l_i, acc, qk_scale,
                                     window, SLIDING, CAUSAL, IEEE)

    out_rows = (seq * NUM_Q + qi) * num_heads + head  # row index into [n, B, Hq]
    o_mask = row_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:
        o = acc / l_i[:, None]
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = out_rows * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=o_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def block_attention_combine_kernel(
    part_o_ptr,  # [n * B * Hq, NUM_SPLITS, D] fp32
    part_ml_ptr,  # [n * B * Hq, NUM_SPLITS, 2] fp32
    out_ptr,  # [n * B * Hq, D] contiguous
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    s_mask = sp < NUM_SPLITS
    base = row * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + base * 2, mask=s_mask, other=_NEG_BIG)
    l_sum = tl.load(part_ml_ptr + base * 2 + 1, mask=s_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - m_all) * l_sum
    total = tl.sum(w, axis=0)
    o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + dims[None, :],
                mask=s_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    res = tl.sum(o * tl.exp2(m - m_all)[:, None], axis=0) / total
    tl.store(out_ptr + row * HEAD_DIM + dims, res.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def default_num_splits(n: int, kv_heads: int, max_ctx: int, device: torch.device,
                       block_n: int = 64) -> int:
    """Splits per sequence: about 2 programs per SM for ``n`` rounded up to a power of two,
    as a power of two no larger than the tiles (rounded up) of ``max_ctx``: one of a few values
    whatever ``n`` and the context (:func:`~._validate.split_count`), so every variant is
    compiled by a warm-up over batch sizes and context lengths up to the point where the
    count stops growing (33 wanted over 256 tiles gives 32 splits of 8 tiles).

    Measured on the H200 at n = 1 x 16K, 8 KV heads (kernels/RESULTS.md, split sweep):
    32 splits 0.038 ms, 33 (one empty) 0.038 ms, 50 (3 programs per SM) 0.045 ms,
    64 0.044 ms, 16 0.047 ms.
    """
    tiles = max(1, math.ceil(max_ctx / block_n))
    want = max(1, min(tiles, math.ceil(2 * sm_count(device) / max(1, next_pow2(n) * kv_heads))))
    return split_count(want, tiles)


def block_attention(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_pos: torch.Tensor,
    slot_pos: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    causal_block: bool = False,
    num_splits: int | None = None,
    split_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton block attention; same contract as ``reference.block_attention``.

    Extra keywords: ``num_splits`` overrides the shape-derived split count (tests use it to
    exercise the combine); ``split_len`` fixes the context tokens per split (default: each
    sequence's context over the splits, read on the device); ``out`` [n, B, Hq, D]
    contiguous receives the result. ``ctx_lens`` must not exceed ``max_pages * page_size``
    (not checked: it lives on the device).
    """
    check("q", q, shape=[None, None, None, None], dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    n, num_q, num_heads, head_dim = q.shape
    dev, dt = q.device, q.dtype
    check("k_blk", k_blk, shape=[n, num_q, None, head_dim], dtypes=[dt], device=dev,
          last_dim_contiguous=True)
    kv_heads = k_blk.shape[2]
    if kv_heads == 0 or num_heads % kv_heads:
        raise ValueError(f"k_blk: {kv_heads} K/V heads do not divide {num_heads} query heads")
    check("v_blk", v_blk, shape=[n, num_q, kv_heads, head_dim], dtypes=[dt], device=dev,
          last_dim_contiguous=True)
    check("k_cache", k_cache, shape=[None, None, kv_heads, head_dim], dtypes=[dt], device=dev,
          contiguous=True)
    check("v_cache", v_cache, shape=list(k_cache.shape), dtypes=[dt], device=dev,
          contiguous=True)
    num_pages, page = k_cache.shape[0], k_cache.shape[1]
    check("page_tables", page_tables, shape=[n, None], dtypes=[torch.int32], device=dev,
          last_dim_contiguous=True)
    check("ctx_lens", ctx_lens, shape=[n], dtypes=[torch.int32], device=dev, contiguous=True)
    check("q_pos", q_pos, shape=[n, num_q], dtypes=[torch.int64], device=dev, contiguous=True)
    check("slot_pos", slot_pos, shape=[num_pages * page], dtypes=[torch.int32], device=dev,
          contiguous=True)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window: must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty((n, num_q, num_heads, head_dim), dtype=dt, device=dev)
    else:
        check("out", out, shape=[n, num_q, num_heads, head_dim], dtypes=[dt], device=dev,
              contiguous=True)
    if n == 0 or num_q == 0:
        return out

    group = num_heads // kv_heads
    block_m = max(16, next_pow2(num_q * group))
    block_d = max(16, next_pow2(head_dim))
    block_n = 64 if block_m <= 64 else 32
    max_ctx = page_tables.shape[1] * page
    if num_splits is None:
        num_splits = default_num_splits(n, kv_heads, max_ctx, dev, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    split_len = split_span(split_len, num_splits, block_n, max_ctx)
    one = num_splits == 1
    rows = n * num_q * num_heads
    part_o = torch.empty((1,) if one else (rows, num_splits, head_dim), dtype=torch.float32,
                         device=dev)
    part_ml = torch.empty((1,) if one else (rows, num_splits, 2), dtype=torch.float32,
                          device=dev)
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    block_attention_kernel[(n, kv_heads, num_splits)](
        q, k_blk, v_blk, k_cache, v_cache, page_tables, ctx_lens, q_pos, slot_pos,
        out, part_o, part_ml,
        q.stride(0), q.stride(1), q.stride(2),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2),
        v_blk.stride(0), v_blk.stride(1), v_blk.stride(2),
        page_tables.stride(0),
        split_len, int(sliding_window or 0), float(scale) * _LOG2E,
        NUM_Q=num_q, GROUP=group, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE=page,
        NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_NB=max(16, next_pow2(num_q)), BLOCK_D=block_d,
        SLIDING=sliding_window is not None, CAUSAL=bool(causal_block),
        IEEE=dt == torch.float32, ONE_SPLIT=one, INTERPRET=interpreting(),
        num_warps=num_warps,
    )
    if not one:
        block_attention_combine_kernel[(rows,)](
            part_o, part_ml, out,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits),
            BLOCK_D=block_d, num_warps=4,
        )
    return out
