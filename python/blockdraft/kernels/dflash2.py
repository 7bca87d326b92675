# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""DFlash2's two extra steps as single launches: the grouped dynamic causal convolution of a
block of rows, and the candidate selector's left-to-right walk for all sequences.

The plain-torch path runs the convolution as a loop of shift/multiply/add kernels per tap and
the walk as a handful of small kernels per block row; here each is one launch with fixed
shapes (graph-capturable: no host reads, no data-dependent control flow on the host). The
references (same signatures) are ``reference.dynamic_conv`` and ``reference.selector_walk``.
Only model shapes (block size, taps, group size, hidden size, candidates, rank) are compile-time
constants; the number of rows or sequences is a runtime value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, next_pow2


@triton.jit(do_not_specialize=["num_rows"])
def _dynamic_conv_kernel(
    x_ptr,  # [M, H] rows, M / BLOCK_ROWS blocks one after another
    taps_ptr,  # [M, K, G] dynamic per-group taps (strides TAP_ROW, TAP_K, 1)
    base_ptr,  # [K, H] static per-channel taps
    out_ptr,  # [M, H]
    num_rows,
    SIZE: tl.constexpr,  # H
    KERNEL: tl.constexpr,  # K
    GROUP: tl.constexpr,  # channels per dynamic tap
    BLOCK_ROWS: tl.constexpr,  # rows per block (the drafter's B)
    TAP_ROW: tl.constexpr,
    TAP_K: tl.constexpr,
    BLOCK: tl.constexpr,  # channels per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < SIZE
    j = row % BLOCK_ROWS  # the row's index inside its block: taps reach back at most j rows
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for o in tl.static_range(KERNEL):
        live = cmask & (j >= o)
        xs = tl.load(x_ptr + (row - o) * SIZE + cols, mask=live, other=0.0).to(tl.float32)
        w = tl.load(base_ptr + o * SIZE + cols, mask=cmask, other=0.0).to(tl.float32)
        d = tl.load(taps_ptr + row * TAP_ROW + o * TAP_K + cols // GROUP, mask=cmask,
                    other=0.0).to(tl.float32)
        acc += (w + d) * xs
    tl.store(out_ptr + row * SIZE + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def dynamic_conv(
    x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor, block: int, group_size: int
) -> torch.Tensor:
    """``x [M, H]`` (blocks of ``block`` rows), ``taps [M, K, G]`` (last dim contiguous),
    ``base [K, H]`` -> ``[M, H]``: see ``reference.dynamic_conv``; one launch."""
    rows, size = x.shape
    kernel = base.shape[0]
    check("x", x, dtypes=FLOAT_DTYPES)
    check("base", base, shape=[None, size], device=x.device)
    if size % group_size:
        raise ValueError(f"group_size {group_size} does not divide the hidden size {size}")
    check("taps", taps, shape=[rows, kernel, size // group_size], device=x.device,
          last_dim_contiguous=True)
    if block < 1 or rows % block:
        raise ValueError(f"{rows} rows do not split into blocks of {block}")
    x = x.contiguous()
    base = base.contiguous()
    out = torch.empty_like(x)
    chunk = min(1024, next_pow2(size))
    if rows:
        _dynamic_conv_kernel[(rows, triton.cdiv(size, chunk))](
            x, taps, base, out, rows, SIZE=size, KERNEL=kernel, GROUP=group_size,
            BLOCK_ROWS=block, TAP_ROW=taps.stride(0), TAP_K=taps.stride(1), BLOCK=chunk,
            num_warps=4,
        )
    return out


@triton.jit(do_not_specialize=["num_seqs"])
def _selector_walk_kernel(
    unary_ptr,  # [n, T, K] candidates' logits
    cand_ptr,  # [n, T, K] int64 candidate ids
    proj_ptr,  # [n, T, R] hidden_projection of the rows
    pred_ptr,  # [V, R] predecessor codebook
    succ_ptr,  # [V, R] successor codebook
    anchor_ptr,  # [n] int64 the token before row 0
    noise_ptr,  # [n, T, K] fp32 Gumbel draws (read when SAMPLED)
    tok_ptr,  # [n, T] int64 chosen tokens
    q_ptr,  # [n, T, K] fp32 softmax(score / temperature) (written when SAMPLED)
    num_seqs,
    temperature,
    STEPS: tl.constexpr,  # T
    TOP_K: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SAMPLED: tl.constexpr,
):
    # One program per sequence. A row's predecessor is one of the previous row's K candidates
    # (the anchor for row 0), so each row's pairwise scores for every possible predecessor, a
    # [K, K] table, need no choice made before: the rows' loads and tables are independent of
    # the walk (unrolled, they overlap), and the walk itself only picks a table row per step.
    seq = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    kmask = ks < TOP_K
    rmask = rs < RANK
    kr_mask = kmask[:, None] & rmask[None, :]
    anchor = tl.load(anchor_ptr + seq)
    first_pred = tl.load(pred_ptr + anchor * RANK + rs, mask=rmask, other=0.0).to(tl.float32)
    prev_cand = tl.zeros((BLOCK_K,), dtype=tl.int64)
    index = 0  # the previous row's choice, as an index into prev_cand
    for t in tl.static_range(STEPS):
        row = seq * STEPS + t
        cand = tl.load(cand_ptr + row * TOP_K + ks, mask=kmask, other=0)
        unary = tl.load(unary_ptr + row * TOP_K + ks, mask=kmask, other=0.0).to(tl.float32)
        h = tl.load(proj_ptr + row * RANK + rs, mask=rmask, other=0.0).to(tl.float32)
        succ = tl.load(succ_ptr + cand[:, None] * RANK + rs[None, :], mask=kr_mask,
                       other=0.0).to(tl.float32)
        if t == 0:
            pair = tl.sum(succ * (first_pred * h)[None, :], axis=1)
        else:
            pred = tl.load(pred_ptr + prev_cand[:, None] * RANK + rs[None, :], mask=kr_mask,
                           other=0.0).to(tl.float32)  # [K prev, R]
            # table[j, k]: sum_r pred[prev_cand[j], r] * h[r] * succ[cand[k], r]
            table = tl.sum((pred * h[None, :])[:, None, :] * succ[None, :, :], axis=2)
            pair = tl.sum(tl.where(ks[:, None] == index, table, 0.0), axis=0)
        score = unary + pair
        if SAMPLED:
            z = score / temperature
            zmax = tl.max(tl.where(kmask, z, float("-inf")), axis=0)
            e = tl.where(kmask, tl.exp(z - zmax), 0.0)
            tl.store(q_ptr + row * TOP_K + ks, e / tl.sum(e, axis=0), mask=kmask)
            g = tl.load(noise_ptr + row * TOP_K + ks, mask=kmask, other=0.0).to(tl.float32)
            pick = tl.where(kmask, z + g, float("-inf"))
        else:
            pick = tl.where(kmask, score, float("-inf"))
        best = tl.max(pick, axis=0)
        # the first index holding the best value (the reference's argmax)
        index = tl.min(tl.where(pick == best, ks, BLOCK_K), axis=0)
        tl.store(tok_ptr + row, tl.sum(tl.where(ks == index, cand, 0), axis=0))
        prev_cand = cand


def selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    projected: torch.Tensor,
    pred: torch.Tensor,
    succ: torch.Tensor,
    anchors: torch.Tensor,
    noise: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See ``reference.selector_walk`` (same arguments and results); one launch, one program
    per sequence."""
    n, steps, top_k = candidates.shape
    rank = pred.shape[1]
    dev = candidates.device
    check("candidates", candidates, dtypes=[torch.int64])
    check("unary", unary, shape=[n, steps, top_k], dtypes=FLOAT_DTYPES, device=dev)
    check("projected", projected, shape=[n, steps, rank], dtypes=FLOAT_DTYPES, device=dev)
    check("pred", pred, shape=[None, rank], dtypes=FLOAT_DTYPES, device=dev, contiguous=True)
    check("succ", succ, shape=list(pred.shape), dtypes=FLOAT_DTYPES, device=dev, contiguous=True)
    check("anchors", anchors, shape=[n], dtypes=[torch.int64], device=dev)
    if noise is not None:
        check("noise", noise, shape=[n, steps, top_k], dtypes=[torch.float32], device=dev)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 with noise, not {temperature}")
    tokens = torch.empty((n, steps), dtype=torch.int64, device=dev)
    q = torch.empty((n, steps, top_k), dtype=torch.float32, device=dev) if noise is not None else None
    if n and steps:
        _selector_walk_kernel[(n,)](
            unary.contiguous(), candidates.contiguous(), projected.contiguous(), pred, succ,
            anchors.contiguous(), noise.contiguous() if noise is not None else unary,
            tokens, q if q is not None else unary, n, float(temperature),
            STEPS=steps, TOP_K=top_k, RANK=rank, BLOCK_K=next_pow2(top_k),
            BLOCK_R=next_pow2(rank), SAMPLED=noise is not None, num_warps=2,
        )
    return tokens, q


__all__ = ["dynamic_conv", "selector_walk"]
