# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""ctx K/V store: per-layer ``k_norm`` + RoPE on K, then K and V into the paged caches.

The input is the result of one GEMM of the fused ctx rows against every drafter layer's stacked
``k_proj``/``v_proj`` weights, so all layers are written by one launch (grid: rows x layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, next_pow2


@triton.jit(do_not_specialize=["num_rows"])
def ctx_kv_store_kernel(
    kv_ptr,  # [R, L, 2, Hkv, D] contiguous
    pos_ptr,  # [R] int64
    slot_ptr,  # [R] int64, negative = skip
    w_ptr,  # [L, D] k_norm weight
    inv_freq_ptr,  # [D/2] fp32
    k_cache_ptr,  # [num_pages, page_size, Hkv, D] of layer `layer0` (contiguous per layer)
    v_cache_ptr,  # [num_pages, page_size, Hkv, D] of layer `layer0` (contiguous per layer)
    slot_pos_ptr,  # [num_pages * page_size] int32
    num_rows,
    layer0,
    cache_layer_stride,  # elements between consecutive layers' caches (0 when one layer)
    rope_scale,
    eps,
    NUM_LAYERS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    layer_in_launch = tl.program_id(1).to(tl.int64)
    layer = layer0 + layer_in_launch
    half: tl.constexpr = HEAD_DIM // 2

    slot = tl.load(slot_ptr + row)
    valid = slot >= 0
    pos = tl.load(pos_ptr + row)

    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF).to(tl.int64)
    mask = valid & (heads[:, None] < NUM_HEADS) & (dims[None, :] < half)
    head_elems = NUM_HEADS * HEAD_DIM

    k_base = kv_ptr + (row * NUM_LAYERS + layer) * (2 * head_elems)
    v_base = k_base + head_elems
    offs1 = heads[:, None] * HEAD_DIM + dims[None, :]  # first half of each head
    offs2 = offs1 + half

    k1 = tl.load(k_base + offs1, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_base + offs2, mask=mask, other=0.0).to(tl.float32)
    var = (tl.sum(k1 * k1, axis=1) + tl.sum(k2 * k2, axis=1)) / HEAD_DIM  # [BLOCK_H]
    rstd = 1.0 / tl.sqrt(var + eps)
    dmask = dims < half
    w1 = tl.load(w_ptr + layer * HEAD_DIM + dims, mask=dmask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + layer * HEAD_DIM + half + dims, mask=dmask, other=0.0).to(tl.float32)
    k1 = k1 * rstd[:, None] * w1[None, :]
    k2 = k2 * rstd[:, None] * w2[None, :]

    inv_freq = tl.load(inv_freq_ptr + dims, mask=dmask, other=0.0)
    angle = pos.to(tl.float32) * inv_freq
    cos = (tl.cos(angle) * rope_scale)[None, :]
    sin = (tl.sin(angle) * rope_scale)[None, :]
    out1 = k1 * cos - k2 * sin
    out2 = k2 * cos + k1 * sin

    dst = slot * head_elems + layer_in_launch * cache_layer_stride
    k_dst = k_cache_ptr + dst
    tl.store(k_dst + offs1, out1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + offs2, out2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v1 = tl.load(v_base + offs1, mask=mask, other=0.0)
    v2 = tl.load(v_base + offs2, mask=mask, other=0.0)
    v_dst = v_cache_ptr + dst
    tl.store(v_dst + offs1, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs2, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(slot_pos_ptr + slot, pos.to(tl.int32), mask=valid & (layer == 0))


def ctx_kv_store(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_norm_w: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    eps: float,
    k_caches: torch.Tensor | Sequence[torch.Tensor],
    v_caches: torch.Tensor | Sequence[torch.Tensor],
    slot_pos: torch.Tensor,
) -> None:
    """Triton ctx K/V store; same contract as ``reference.ctx_kv_store``.

    kv [R, L, 2, Hkv, D]; positions, slots [R] int64; k_norm_w [L, D]; inv_freq [D/2] fp32;
    k_caches / v_caches: one tensor [L, num_pages, page_size, Hkv, D] (one launch) or a
    sequence of L tensors [num_pages, page_size, Hkv, D] (one launch per layer);
    slot_pos [num_pages * page_size] int32.
    """
    check("kv", kv, shape=[None, None, 2, None, None], dtypes=FLOAT_DTYPES, contiguous=True)
    num_rows, num_layers, _, num_heads, head_dim = kv.shape
    dev = kv.device
    if head_dim % 2:
        raise ValueError(f"kv: head dim {head_dim} must be even for rotate-half RoPE")
    check("positions", positions, shape=[num_rows], dtypes=[torch.int64], device=dev,
          contiguous=True)
    check("slots", slots, shape=[num_rows], dtypes=[torch.int64], device=dev, contiguous=True)
    check("k_norm_w", k_norm_w, shape=[num_layers, head_dim], dtypes=FLOAT_DTYPES, device=dev,
          contiguous=True)
    check("inv_freq", inv_freq, shape=[head_dim // 2], dtypes=[torch.float32], device=dev,
          contiguous=True)
    if isinstance(k_caches, torch.Tensor) != isinstance(v_caches, torch.Tensor):
        raise ValueError("v_caches: must be the same kind (tensor or sequence) as k_caches")
    launches: list[tuple[torch.Tensor, torch.Tensor, int, int, int]] = []
    if isinstance(k_caches, torch.Tensor) and isinstance(v_caches, torch.Tensor):
        check("k_caches", k_caches, shape=[num_layers, None, None, num_heads, head_dim],
              dtypes=FLOAT_DTYPES, device=dev, contiguous=True)
        check("v_caches", v_caches, shape=list(k_caches.shape), dtypes=[k_caches.dtype],
              device=dev, contiguous=True)
        cache_shape = k_caches.shape[1:]
        launches.append((k_caches, v_caches, 0, num_layers, k_caches.stride(0)))
    else:
        k_list, v_list = list(k_caches), list(v_caches)
        if len(k_list) != num_layers or len(v_list) != num_layers:
            raise ValueError(f"k_caches/v_caches: expected {num_layers} layers, got "
                             f"{len(k_list)}/{len(v_list)}")
        check("k_caches[0]", k_list[0], shape=[None, None, num_heads, head_dim],
              dtypes=FLOAT_DTYPES, device=dev, contiguous=True)
        cache_shape = k_list[0].shape
        for i in range(num_layers):
            for nm, t in ((f"k_caches[{i}]", k_list[i]), (f"v_caches[{i}]", v_list[i])):
                check(nm, t, shape=list(cache_shape), dtypes=[k_list[0].dtype], device=dev,
                      contiguous=True)
            launches.append((k_list[i], v_list[i], i, 1, 0))
    num_slots = cache_shape[0] * cache_shape[1]
    check("slot_pos", slot_pos, shape=[num_slots], dtypes=[torch.int32], device=dev,
          contiguous=True)
    if num_rows == 0:
        return
    for k_c, v_c, layer0, layers_here, layer_stride in launches:
        ctx_kv_store_kernel[(num_rows, layers_here)](
            kv, positions, slots, k_norm_w, inv_freq, k_c, v_c, slot_pos,
            num_rows, layer0, layer_stride, float(rope_scale), float(eps),
            NUM_LAYERS=num_layers, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_H=next_pow2(num_heads), BLOCK_HALF=next_pow2(head_dim // 2),
            num_warps=4,
        )
