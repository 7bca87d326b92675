# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""DFlash2: grouped dynamic causal convolution and the candidate-selector walk."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, next_pow2

_BLOCK_H = 256


@triton.jit
def dynamic_conv_kernel(
    x_ptr,  # [n, B, H] contiguous
    dyn_ptr,  # [n, B, K, G] (strides sd0..sd3), G = H / GROUP_SIZE
    base_ptr,  # [K, H] contiguous
    out_ptr,  # [n, B, H] contiguous
    hidden,
    sd0, sd1, sd2, sd3,
    LENGTH: tl.constexpr,
    TAPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # seq * LENGTH + t
    seq = pid // LENGTH
    t = pid % LENGTH
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    h_mask = h < hidden
    g = h // GROUP_SIZE
    acc = tl.zeros([BLOCK_H], tl.float32)
    for o in tl.static_range(TAPS):
        live = h_mask & (t >= o)  # taps reaching before the block start read zeros
        x = tl.load(x_ptr + (pid - o) * hidden + h, mask=live, other=0.0).to(tl.float32)
        b = tl.load(base_ptr + o * hidden + h, mask=live, other=0.0).to(tl.float32)
        d = tl.load(dyn_ptr + seq * sd0 + t * sd1 + o * sd2 + g * sd3, mask=live,
                    other=0.0).to(tl.float32)
        acc += (b + d) * x
    tl.store(out_ptr + pid * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def dynamic_conv(
    hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Triton grouped dynamic causal conv; same contract as ``reference.dynamic_conv``.

    hidden [n, B, H] contiguous; dynamic [n, B, K, H / group_size] (any strides, e.g. a slice
    of the kernel projection); base [K, H] contiguous -> [n, B, H] in hidden's dtype.
    """
    check("hidden", hidden, shape=[None, None, None], dtypes=FLOAT_DTYPES, contiguous=True)
    n, length, size = hidden.shape
    if group_size < 1 or size % group_size:
        raise ValueError(f"group_size: {group_size} must divide hidden size {size}")
    check("base", base, shape=[None, size], dtypes=FLOAT_DTYPES, device=hidden.device,
          contiguous=True)
    taps = base.shape[0]
    check("dynamic", dynamic, shape=[n, length, taps, size // group_size], dtypes=FLOAT_DTYPES,
          device=hidden.device)
    out = torch.empty_like(hidden)
    if out.numel() == 0:
        return out
    dynamic_conv_kernel[(n * length, triton.cdiv(size, _BLOCK_H))](
        hidden, dynamic, base, out, size, *dynamic.stride(),
        LENGTH=length, TAPS=taps, GROUP_SIZE=group_size, BLOCK_H=_BLOCK_H, num_warps=4,
    )
    return out


@triton.jit
def selector_walk_kernel(
    unary_ptr,  # [n, P, K] contiguous
    cand_ptr,  # [n, P, K] int64 contiguous
    h_ptr,  # [n, P, r] contiguous
    pred_ptr,  # [V, r] contiguous
    succ_ptr,  # [V, r] contiguous
    anchor_ptr,  # [n] int64
    u_ptr,  # [n, P] fp32 (used when SAMPLING)
    path_ptr,  # [n, P] int64
    q_ptr,  # [n, P, K] fp32 (written when SAMPLING)
    inv_temperature,
    NUM_POS: tl.constexpr,
    NUM_CAND: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SAMPLING: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K).to(tl.int64)
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    k_mask = k < NUM_CAND
    r_mask = r < RANK
    prev = tl.load(anchor_ptr + seq)
    for p in range(0, NUM_POS):
        row = seq * NUM_POS + p
        h = tl.load(h_ptr + row * RANK + r, mask=r_mask, other=0.0).to(tl.float32)
        pred = tl.load(pred_ptr + prev * RANK + r, mask=r_mask, other=0.0).to(tl.float32)
        cands = tl.load(cand_ptr + row * NUM_CAND + k, mask=k_mask, other=0)
        succ = tl.load(succ_ptr + cands[:, None] * RANK + r[None, :],
                       mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        unary = tl.load(unary_ptr + row * NUM_CAND + k, mask=k_mask, other=0.0).to(tl.float32)
        scores = unary + tl.sum(succ * (pred * h)[None, :], axis=1)
        scores = tl.where(k_mask, scores, float("-inf"))
        if SAMPLING:
            z = scores * inv_temperature
            e = tl.where(k_mask, tl.exp(z - tl.max(z, axis=0)), 0.0)
            q = e / tl.sum(e, axis=0)
            tl.store(q_ptr + row * NUM_CAND + k, q, mask=k_mask)
            cdf = tl.cumsum(q, axis=0)
            u = tl.load(u_ptr + row)
            below = (cdf <= u * tl.sum(q, axis=0)) & k_mask
            last = tl.max(tl.where(k_mask & (q > 0), k, 0), axis=0)
            index = tl.minimum(tl.sum(below.to(tl.int64), axis=0), last)
        else:
            top = tl.max(scores, axis=0)
            index = tl.min(tl.where(k_mask & (scores == top), k, BLOCK_K), axis=0)
        prev = tl.sum(tl.where(k == index, cands, 0), axis=0)
        tl.store(path_ptr + row, prev)


def selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    hidden_proj: torch.Tensor,
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    anchor: torch.Tensor,
    temperature: float,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton selector walk; same contract as ``reference.selector_walk``.

    unary [n, P, K]; candidates [n, P, K] int64; hidden_proj [n, P, r]; codebooks [V, r];
    anchor [n] int64; uniforms [n, P] fp32 (required when ``temperature > 0``).
    """
    check("unary", unary, shape=[None, None, None], dtypes=FLOAT_DTYPES, contiguous=True)
    n, num_pos, num_cand = unary.shape
    dev = unary.device
    check("candidates", candidates, shape=[n, num_pos, num_cand], dtypes=[torch.int64],
          device=dev, contiguous=True)
    check("hidden_proj", hidden_proj, shape=[n, num_pos, None], dtypes=FLOAT_DTYPES, device=dev,
          contiguous=True)
    rank = hidden_proj.shape[2]
    check("pred_codebook", pred_codebook, shape=[None, rank], dtypes=FLOAT_DTYPES, device=dev,
          contiguous=True)
    check("succ_codebook", succ_codebook, shape=[pred_codebook.shape[0], rank],
          dtypes=FLOAT_DTYPES, device=dev, contiguous=True)
    check("anchor", anchor, shape=[n], dtypes=[torch.int64], device=dev, contiguous=True)
    sampling = temperature > 0
    if sampling:
        if uniforms is None:
            raise ValueError("uniforms: required when temperature > 0")
        check("uniforms", uniforms, shape=[n, num_pos], dtypes=[torch.float32], device=dev,
              contiguous=True)
    path = torch.empty((n, num_pos), dtype=torch.int64, device=dev)
    q = torch.empty((n, num_pos, num_cand), dtype=torch.float32, device=dev) if sampling else None
    if n == 0 or num_pos == 0:
        return path, q
    selector_walk_kernel[(n,)](
        unary, candidates, hidden_proj, pred_codebook, succ_codebook, anchor,
        uniforms if uniforms is not None else unary, path, q if q is not None else unary,
        1.0 / temperature if sampling else 1.0,
        NUM_POS=num_pos, NUM_CAND=num_cand, RANK=rank, BLOCK_K=max(2, next_pow2(num_cand)),
        BLOCK_R=max(2, next_pow2(rank)), SAMPLING=sampling, num_warps=4,
    )
    return path, q
