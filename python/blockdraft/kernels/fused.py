# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Fused elementwise kernels around a decoder layer's GEMMs: residual add + RMSNorm, per-head
q/k RMSNorm + RoPE (with the v split), SwiGLU's ``silu(gate) * up``.

Each replaces a chain of small torch kernels of the reference layer (RMSNorm as pow/mean/rsqrt/
mul, RoPE as cat/neg/mul/add, the residual add, SwiGLU's silu and mul) by one launch. Math in
fp32, one rounding to the output dtype at the end. The references (same signatures) are
``reference.add_rms_norm``, ``reference.qk_norm_rope`` and ``reference.silu_mul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import next_pow2


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(
    h_ptr,  # [M, H] residual stream (read)
    y_ptr,  # [M, H] branch output (read; ignored when HAS_Y is false)
    w_ptr,  # [H]
    h_out_ptr,  # [M, H] h + y (written when HAS_Y)
    x_out_ptr,  # [M, H] rms_norm(h + y) * w
    num_rows,
    eps,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_Y: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < SIZE
    base = row * SIZE
    h = tl.load(h_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_Y:
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        # The residual stream is kept in the activation dtype, as in the reference.
        h = (h + y).to(h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + base + cols, h, mask=mask)
        h = h.to(tl.float32)
    var = tl.sum(h * h, axis=0) / SIZE
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = h * (1.0 / tl.sqrt(var + eps)) * w
    tl.store(x_out_ptr + base + cols, x.to(x_out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [M, H]`` (+ ``y [M, H]``) -> ``(h + y, rms_norm(h + y) * weight)``, each [M, H]."""
    rows, size = h.shape
    h = h.contiguous()
    h_out = torch.empty_like(h) if y is not None else h
    x_out = torch.empty_like(h)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            h, y.contiguous() if y is not None else h, weight, h_out, x_out, rows, float(eps),
            SIZE=size, BLOCK=next_pow2(size), HAS_Y=y is not None, num_warps=8 if size >= 2048 else 4,
        )
    return h_out, x_out


@triton.jit(do_not_specialize=["num_rows"])
def _qk_norm_rope_kernel(
    qkv_ptr,  # [M, (Hq + 2*Hkv) * D]
    pos_ptr,  # [M] int64
    wq_ptr,  # [D] (unread without HAS_NORM)
    wk_ptr,  # [D] (unread without HAS_NORM)
    inv_freq_ptr,  # [D/2] fp32
    q_ptr,  # [M, Hq, D]
    k_ptr,  # [M, Hkv, D], or a paged cache [num_pages * page_size, Hkv, D] with HAS_SLOTS
    v_ptr,  # as k_ptr
    slot_ptr,  # [M] int64 destination rows of k/v (HAS_SLOTS; negative = not written)
    num_rows,
    rope_scale,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,  # per-head q/k RMSNorm (Qwen3); without it RoPE only (Llama)
    HAS_SLOTS: tl.constexpr,  # k/v rows go to slot_ptr's rows (a paged cache), not row's
):
    # One program per (row, group of BLOCK_H heads), all heads of the group at once ([heads,
    # D/2] halves): the RoPE angles are computed once per program, q and k heads get RMSNorm
    # (their own weights) + rotate-half RoPE, v heads are copied out.
    row = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BHALF]
    dmask = dims < half
    live = (heads < HQ + 2 * HKV) & dmask
    width: tl.constexpr = (HQ + 2 * HKV) * HEAD_DIM
    src = qkv_ptr + row * width + heads * HEAD_DIM + dims
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=live, other=0.0).to(tl.float32)
    is_q = heads < HQ
    is_k = (heads >= HQ) & (heads < HQ + HKV)
    is_v = heads >= HQ + HKV
    # RMSNorm per head (q, k), with that kind's weight
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        wq1 = tl.load(wq_ptr + dims, mask=dmask, other=0.0).to(tl.float32)
        wq2 = tl.load(wq_ptr + half + dims, mask=dmask, other=0.0).to(tl.float32)
        wk1 = tl.load(wk_ptr + dims, mask=dmask, other=0.0).to(tl.float32)
        wk2 = tl.load(wk_ptr + half + dims, mask=dmask, other=0.0).to(tl.float32)
        n1 = x1 * rstd[:, None] * tl.where(is_q, wq1, wk1)
        n2 = x2 * rstd[:, None] * tl.where(is_q, wq2, wk2)
    else:
        n1 = x1
        n2 = x2
    # rotate-half RoPE at this row's position (angles once per row)
    angle = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + dims, mask=dmask,
                                                              other=0.0)
    cos = tl.cos(angle) * rope_scale
    sin = tl.sin(angle) * rope_scale
    o1 = n1 * cos - n2 * sin
    o2 = n2 * cos + n1 * sin
    q_dst = q_ptr + (row * HQ + heads) * HEAD_DIM + dims
    tl.store(q_dst, o1.to(q_ptr.dtype.element_ty), mask=live & is_q)
    tl.store(q_dst + half, o2.to(q_ptr.dtype.element_ty), mask=live & is_q)
    if HAS_SLOTS:
        dst = tl.load(slot_ptr + row)
        kv_live = live & (dst >= 0)
    else:
        dst = row
        kv_live = live
    k_dst = k_ptr + (dst * HKV + (heads - HQ)) * HEAD_DIM + dims
    tl.store(k_dst, o1.to(k_ptr.dtype.element_ty), mask=kv_live & is_k)
    tl.store(k_dst + half, o2.to(k_ptr.dtype.element_ty), mask=kv_live & is_k)
    v_dst = v_ptr + (dst * HKV + (heads - HQ - HKV)) * HEAD_DIM + dims
    tl.store(v_dst, x1.to(v_ptr.dtype.element_ty), mask=kv_live & is_v)
    tl.store(v_dst + half, x2.to(v_ptr.dtype.element_ty), mask=kv_live & is_v)


def _launch_qk_norm_rope(
    qkv: torch.Tensor, positions: torch.Tensor, q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None, inv_freq: torch.Tensor, rope_scale: float, eps: float,
    num_heads: int, num_kv_heads: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slots: torch.Tensor | None,
) -> None:
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("q_norm_w and k_norm_w: give both or neither")
    rows = qkv.shape[0]
    if not rows:
        return
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    heads = num_heads + 2 * num_kv_heads
    # 8 heads per program: enough programs for a few rows (decode), few angle computations
    # for many (measured on the H200: one program per head was 2.4 us per launch at 16 rows
    # and 16 us at 512 rows; one per row 3.2 us and 6.7 us).
    block_h = min(8, next_pow2(heads))
    _qk_norm_rope_kernel[(rows, triton.cdiv(heads, block_h))](
        qkv, positions.contiguous(), q_norm_w if q_norm_w is not None else inv_freq,
        k_norm_w if k_norm_w is not None else inv_freq, inv_freq, q, k, v,
        slots if slots is not None else positions, rows,
        float(rope_scale), float(eps), HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_HALF=next_pow2(head_dim // 2),
        HAS_NORM=q_norm_w is not None, HAS_SLOTS=slots is not None, num_warps=2,
    )


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    inv_freq: torch.Tensor,
    rope_scale: float,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [M, (Hq+2Hkv)*D]``, ``positions [M]`` int64 -> q [M, Hq, D], k, v [M, Hkv, D];
    the norm weights are both given (Qwen3) or both ``None`` (no q/k norm)."""
    rows = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    qkv = qkv.contiguous()
    q = qkv.new_empty((rows, num_heads, head_dim))
    k = qkv.new_empty((rows, num_kv_heads, head_dim))
    v = qkv.new_empty((rows, num_kv_heads, head_dim))
    _launch_qk_norm_rope(qkv, positions, q_norm_w, k_norm_w, inv_freq, rope_scale, eps,
                         num_heads, num_kv_heads, q, k, v, None)
    return q, k, v


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    inv_freq: torch.Tensor,
    rope_scale: float,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """:func:`qk_norm_rope` with K and V written into one layer's paged cache at ``slots``
    (same contract as ``reference.qk_norm_rope_store``); one launch. Returns q."""
    rows = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim)
                or not cache.is_contiguous() or cache.dtype != qkv.dtype
                or cache.device != qkv.device):
            raise ValueError(f"{name}: expected a contiguous [pages, page_size, {num_kv_heads}, "
                             f"{head_dim}] {qkv.dtype} tensor on {qkv.device}")
    if slots.shape != (rows,) or slots.dtype != torch.int64:
        raise ValueError(f"slots: expected [{rows}] int64, got {list(slots.shape)} {slots.dtype}")
    qkv = qkv.contiguous()
    q = qkv.new_empty((rows, num_heads, head_dim))
    _launch_qk_norm_rope(qkv, positions, q_norm_w, k_norm_w, inv_freq, rope_scale, eps,
                         num_heads, num_kv_heads, q, k_cache, v_cache, slots.contiguous())
    return q


@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_kernel(gu_ptr, out_ptr, num_rows, INNER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INNER
    g = tl.load(gu_ptr + row * (2 * INNER) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * (2 * INNER) + INNER + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference rounds silu(g) and up(x) to the activation dtype before the product.
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * INNER + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[M, 2I]`` (gate then up) -> ``silu(gate) * up`` [M, I]."""
    rows, width = gate_up.shape
    inner = width // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty((rows, inner))
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inner, block))](
            gate_up, out, rows, INNER=inner, BLOCK=block, num_warps=4
        )
    return out


__all__ = ["add_rms_norm", "qk_norm_rope", "qk_norm_rope_store", "silu_mul"]
