# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Weight-streaming GEMMs for a few rows: ``y = x @ W.T (+ bias)`` with ``x [M, K]``, ``M <=``
:data:`MAX_ROWS`, and two fused variants (gate/up + SwiGLU, lm_head + argmax).

At decode and verify sizes (1 to 16 rows) a projection is bound by reading its weight once;
the work is how fast ``W`` streams. Each program owns ``BLOCK_N`` output columns and streams
their ``[BLOCK_N, BLOCK_K]`` weight tiles once, multiplying each with every row (the rows are
padded to 16 for ``tl.dot``, computed as ``W_tile @ x.T`` so the weight tile is the MMA's wide
operand; for 1 to 4 rows a broadcast multiply-sum is the alternative the config can pick).
When the column tiles alone are too few programs to keep every multiprocessor streaming, the
``K`` range is split: each split writes fp32 partial sums and a second tiny kernel adds them
in split order (deterministic: the same bits on every run, so greedy output is reproducible).

Every launch shape (block sizes, split count, grid) is a function of ``(M bucket, N, K)`` and
the device's multiprocessor count only, so a captured CUDA graph serves every later call:
:func:`config_for` reads :data:`DEFAULT_CONFIGS` (measured by ``kernels/bench_gemm.py``) and
falls back to a rule; :func:`set_config_override` forces one config (the benchmark's sweep).

References (same math, unfused): ``reference.linear``, ``reference.linear_silu_mul``,
``reference.linear_argmax``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from ._validate import check, interpreting, next_pow2, sm_count
from .reference import SKINNY_MAX_ROWS

MAX_ROWS = SKINNY_MAX_ROWS
"""The most rows of ``x`` these kernels take (a verify block of 16, or 16 decoding sequences)."""

Kind = Literal["linear", "swiglu", "argmax"]
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_EPI_LINEAR, _EPI_SWIGLU, _EPI_ARGMAX = 0, 1, 2

ARGMAX_COMBINE_BLOCK = 1024
"""Tile winners the argmax's combine reads per loop step (more tiles than this loop)."""
_NO_COL = tl.constexpr(2**62)  # larger than any column index


@dataclass(frozen=True)
class GemmConfig:
    """The launch shape of one skinny GEMM.

    Attributes:
        block_n: output columns per program (a power of two >= 16).
        block_k: the reduction tile (a power of two >= 16).
        split_k: wanted ``K`` splits (trimmed so that no split is empty; 1 = no split; the
            argmax variant never splits).
        num_warps / num_stages: Triton's launch options (``num_stages`` pipelines the weight
            loads).
        dot: ``tl.dot`` on rows padded to 16; ``False``: a broadcast multiply-sum over the
            rows (only for at most 4 rows).
    """

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    dot: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, not {v}")
        if self.split_k < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"split_k and num_stages must be >= 1, num_warps a power of two "
                             f"up to 16: {self}")


# The best of `kernels/bench_gemm.py --quick --rows 1,16` on an H200 (kernels/RESULTS.md,
# "Skinny GEMMs"): the Qwen3-8B projections at 1 and 16 rows; % of the copy bandwidth.
DEFAULT_CONFIGS: dict[tuple[Kind, int, int, int], GemmConfig] = {
    ("linear", 1, 6144, 4096): GemmConfig(block_n=128, block_k=128, split_k=5, num_warps=8, num_stages=3),
    ("linear", 16, 6144, 4096): GemmConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    ("linear", 1, 4096, 4096): GemmConfig(block_n=128, block_k=128, split_k=4, num_warps=8, num_stages=3),
    ("linear", 16, 4096, 4096): GemmConfig(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4),
    ("linear", 1, 24576, 4096): GemmConfig(block_n=128, block_k=128, split_k=4, num_warps=8, num_stages=3),
    ("linear", 16, 24576, 4096): GemmConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    ("linear", 1, 4096, 12288): GemmConfig(block_n=128, block_k=128, split_k=4, num_warps=8, num_stages=3),
    ("linear", 16, 4096, 12288): GemmConfig(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4),
    ("linear", 1, 151936, 4096): GemmConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3),
    ("linear", 16, 151936, 4096): GemmConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3),
    ("swiglu", 1, 24576, 4096): GemmConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3),
    ("swiglu", 16, 24576, 4096): GemmConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3),
    ("argmax", 1, 151936, 4096): GemmConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3),
    ("argmax", 16, 151936, 4096): GemmConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
}
"""Measured configs by ``(kind, M bucket, N, K)`` (``N``: the weight's rows, ``2I`` for the
fused gate/up); M buckets are 1, 2, 4, 8, 16. Shapes not listed follow :func:`rule_config`."""

_override: GemmConfig | None = None


def set_config_override(config: GemmConfig | None) -> GemmConfig | None:
    """Force ``config`` on every later launch (``None``: back to :func:`config_for`'s choice);
    returns the previous override. For benchmarks: a captured graph keeps the config it was
    captured with."""
    global _override
    prev, _override = _override, config
    return prev


def m_bucket(rows: int) -> int:
    """The row count a config is chosen for: the next power of two (1, 2, 4, 8, 16)."""
    return next_pow2(max(1, rows))


def rule_config(kind: Kind, rows: int, n: int, k: int, sms: int) -> GemmConfig:
    """The default launch shape where :data:`DEFAULT_CONFIGS` has none: 64-column x 128-deep
    tiles (16 KB of bf16 weight per tile, 4 stages in flight), and ``K`` split until the
    programs cover about two waves of ``sms`` multiprocessors, keeping at least 4 tiles per
    split so the pipeline's prologue stays a small share."""
    del rows  # the weight stream, not the rows, sets the shape at these sizes
    block_k = min(128, max(16, next_pow2(k)))
    block_n = 64
    tiles = triton.cdiv(n // 2 if kind == "swiglu" else n, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1 if kind == "argmax" else max(1, min(steps // 4, triton.cdiv(2 * sms, tiles)))
    return GemmConfig(block_n=block_n, block_k=block_k, split_k=split)


_cached_rule = functools.lru_cache(maxsize=1024)(rule_config)


def config_for(kind: Kind, rows: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """The launch shape for ``rows`` rows against an ``[n, k]`` weight on ``device``: the
    override if one is set, else the measured table, else :func:`rule_config`."""
    if _override is not None:
        return _override
    bucket = m_bucket(rows)
    got = DEFAULT_CONFIGS.get((kind, bucket, n, k))
    return got if got is not None else _cached_rule(kind, bucket, n, k, sm_count(device))


@triton.jit
def _tile_product(acc, w, x, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
                  IEEE: tl.constexpr):
    # acc [BN, BM] += w [BN, BK] @ x.T [BK, BM], in fp32.
    if USE_DOT:
        if IEEE:  # fp32 weights: full fp32 products, not TF32
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    else:
        prod = w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _k_step(acc, acc_u, w_tile, x_tile, k0, k_hi, offs_k, up_offset, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr, EPI: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    # One BLOCK_K step: the weight tile (and, for gate/up, the up tile up_offset further on)
    # streamed once (evict-first: it is not read again), times every row. k0 is a multiple of
    # BLOCK_K: with 16-aligned rows the loads are full-width vectors.
    k0 = tl.multiple_of(k0, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_tile + k0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0)
    else:
        k_ok = (k0 + offs_k) < k_hi
        w = tl.load(w_tile + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=k_ok[None, :], other=0.0)
    acc = _tile_product(acc, w, x, BLOCK_M, USE_DOT, IEEE)
    if EPI == 1:
        if EVEN_K:
            u = tl.load(w_tile + up_offset + k0, eviction_policy="evict_first")
        else:
            u = tl.load(w_tile + up_offset + k0, mask=k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc_u = _tile_product(acc_u, u, x, BLOCK_M, USE_DOT, IEEE)
    return acc, acc_u


@triton.jit(do_not_specialize=["M", "split_steps"])
def _skinny_kernel(
    x_ptr,  # [M, K] (row stride stride_xm, unit column stride)
    w_ptr,  # [N_W, K] (row stride stride_wn), N_W = OUT_N (2 * OUT_N for SWIGLU)
    b_ptr,  # [N_W] (read only with HAS_BIAS and without SPLIT)
    y_ptr,  # [M, OUT_N] output (EPI linear / swiglu without SPLIT)
    ws_ptr,  # fp32 [splits, M, N_W] partial sums (SPLIT)
    pv_ptr,  # fp32 [M, tiles] best value per tile (EPI argmax)
    pi_ptr,  # int64 [M, tiles] its column
    M,
    OUT_N,
    K,
    stride_xm,
    stride_wn,
    split_steps,  # BLOCK_K tiles per split
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPI: tl.constexpr,  # 0 linear, 1 gate/up + SwiGLU, 2 argmax over the columns
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_live = offs_n < OUT_N
    m_live = offs_m < M
    # Out-of-range columns and rows read the last valid one (no masks in the streaming loop);
    # their results are never stored.
    n_rows = tl.minimum(offs_n, OUT_N - 1).to(tl.int64)
    m_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    w_tile = w_ptr + n_rows[:, None] * stride_wn + offs_k[None, :]
    x_tile = x_ptr + m_rows[:, None] * stride_xm + offs_k[None, :]
    k_lo = pid_k * split_steps * BLOCK_K
    k_hi = tl.minimum(k_lo + split_steps * BLOCK_K, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if INTERPRET:
        # The CPU interpreter cannot take tensor loop bounds in range(); a while loop is the
        # same iteration (but is not software-pipelined on the GPU, hence two spellings).
        k0 = k_lo
        while k0 < k_hi:
            acc, acc_u = _k_step(acc, acc_u, w_tile, x_tile, k0, k_hi, offs_k, OUT_N * stride_wn,
                                 BLOCK_M, BLOCK_K, EPI, EVEN_K, USE_DOT, IEEE)
            k0 += BLOCK_K
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc, acc_u = _k_step(acc, acc_u, w_tile, x_tile, k0, k_hi, offs_k, OUT_N * stride_wn,
                                 BLOCK_M, BLOCK_K, EPI, EVEN_K, USE_DOT, IEEE)
    live = n_live[:, None] & m_live[None, :]
    out_ty = x_ptr.dtype.element_ty
    if SPLIT:
        width = OUT_N * 2 if EPI == 1 else OUT_N
        part = ws_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * width + offs_n[:, None]
        tl.store(part, acc, mask=live)
        if EPI == 1:
            tl.store(part + OUT_N, acc_u, mask=live)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n_rows).to(tl.float32)[:, None]
            if EPI == 1:
                acc_u += tl.load(b_ptr + OUT_N + n_rows).to(tl.float32)[:, None]
        if EPI == 2:
            # The logits as the unfused path has them (rounded to the activation dtype), then
            # per row the largest and its lowest column.
            v = tl.where(live, acc.to(out_ty).to(tl.float32), float("-inf"))
            best = tl.max(v, axis=0)
            col = tl.min(tl.where(v == best[None, :], offs_n[:, None].to(tl.int64), _NO_COL),
                         axis=0)
            tiles = tl.num_programs(0)
            tl.store(pv_ptr + offs_m * tiles + pid_n, best, mask=m_live)
            tl.store(pi_ptr + offs_m * tiles + pid_n, col, mask=m_live)
        else:
            if EPI == 1:
                acc = _swiglu(acc, acc_u, x_ptr)
            dst = y_ptr + offs_m[None, :].to(tl.int64) * OUT_N + offs_n[:, None]
            tl.store(dst, acc.to(out_ty), mask=live)


@triton.jit
def _swiglu(g, u, out_ptr):
    # As the unfused path rounds: gate and up to the activation dtype (out_ptr's, the GEMM's
    # output), then silu(gate) to it, then the product.
    out_ty = out_ptr.dtype.element_ty
    g = g.to(out_ty).to(tl.float32)
    u = u.to(out_ty).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
    return a * u


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(ws_ptr, b_ptr, y_ptr, M, OUT_N, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    # Sum the splits' partials in split order (fixed: the same bits every run), add the bias
    # once, apply the epilogue, round once.
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = cols < OUT_N
    width = OUT_N * 2 if SWIGLU else OUT_N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        base = ws_ptr + (s * M + row) * width + cols
        acc += tl.load(base, mask=live, other=0.0)
        if SWIGLU:
            acc_u += tl.load(base + OUT_N, mask=live, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=live, other=0.0).to(tl.float32)
        if SWIGLU:
            acc_u += tl.load(b_ptr + OUT_N + cols, mask=live, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    if SWIGLU:
        acc = _swiglu(acc, acc_u, y_ptr)
    tl.store(y_ptr + row * OUT_N + cols, acc.to(out_ty), mask=live)


@triton.jit
def _argmax_combine_kernel(pv_ptr, pi_ptr, out_ptr, TILES: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row over the tiles' winners: each lane moves to a later tile only on a
    # strictly larger value (keeping its lowest column among equals), then the lanes' best
    # value is taken at its lowest column, so ties resolve as torch.argmax does.
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], _NO_COL, tl.int64)
    for t0 in range(0, TILES, BLOCK):
        live = t0 + idx < TILES
        v = tl.load(pv_ptr + row * TILES + t0 + idx, mask=live, other=float("-inf"))
        c = tl.load(pi_ptr + row * TILES + t0 + idx, mask=live, other=_NO_COL)
        take = (v > best) | (live & (best_col == _NO_COL))
        best = tl.where(take, v, best)
        best_col = tl.where(take, c, best_col)
    m = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == m, best_col, _NO_COL), axis=0))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           kind: Kind) -> tuple[torch.Tensor, int, int]:
    check("x", x, shape=(None, None), dtypes=_DTYPES)
    rows, k = x.shape
    check("weight", weight, shape=(None, k), dtypes=(x.dtype,), device=x.device,
          last_dim_contiguous=True)
    if rows > MAX_ROWS:
        raise ValueError(f"x: at most {MAX_ROWS} rows for the skinny GEMM, got {rows} "
                         f"(use torch.nn.functional.linear)")
    n = weight.shape[0]
    if kind == "swiglu" and n % 2:
        raise ValueError(f"weight: the fused gate/up weight needs an even row count, got {n}")
    if bias is not None:
        check("bias", bias, shape=(n,), dtypes=(x.dtype,), device=x.device, contiguous=True)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x, rows, n


def _launch(kind: Kind, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None, pv: torch.Tensor | None, pi: torch.Tensor | None) -> None:
    rows, k = x.shape
    n_w = weight.shape[0]
    out_n = n_w // 2 if kind == "swiglu" else n_w
    cfg = config_for(kind, rows, n_w, k, x.device)
    steps = max(1, triton.cdiv(k, cfg.block_k))  # K = 0: one empty step, the bias alone
    splits = 1 if kind == "argmax" else min(cfg.split_k, steps)
    per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, per_split)  # no empty split
    use_dot = cfg.dot or rows > 4
    block_m = 16 if use_dot else next_pow2(rows)
    epi = {"linear": _EPI_LINEAR, "swiglu": _EPI_SWIGLU, "argmax": _EPI_ARGMAX}[kind]
    tiles = triton.cdiv(out_n, cfg.block_n)
    ws = (torch.empty((splits, rows, n_w), dtype=torch.float32, device=x.device)
          if splits > 1 else x)
    dummy = ws
    _skinny_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else dummy, out if out is not None else dummy, ws,
        pv if pv is not None else dummy, pi if pi is not None else dummy,
        rows, out_n, k, x.stride(0), weight.stride(0), per_split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EPI=epi,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, EVEN_K=k > 0 and k % cfg.block_k == 0,
        USE_DOT=use_dot, IEEE=x.dtype == torch.float32, INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        assert out is not None
        block = 1024
        _combine_kernel[(triton.cdiv(out_n, block), rows)](
            ws, bias if bias is not None else ws, out, rows, out_n, SPLITS=splits, BLOCK=block,
            HAS_BIAS=bias is not None, SWIGLU=kind == "swiglu", num_warps=4,
        )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N])`` -> ``[M, N]`` in ``x``'s dtype (fp32
    accumulation), for ``M <=`` :data:`MAX_ROWS`.

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, or mismatched shapes, dtypes or devices.
    """
    x, rows, n = _check(x, weight, bias, "linear")
    out = x.new_empty((rows, n))
    if rows and n:
        _launch("linear", x, weight, bias, out, None, None)
    return out


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` -> ``[M, I]`` for the fused ``weight [2I, K]`` (gate
    rows, then up rows; ``bias [2I]`` likewise), without writing the ``[M, 2I]`` product.

    Raises:
        ValueError: as :func:`linear`, or an odd weight row count.
    """
    x, rows, n = _check(x, weight, bias, "swiglu")
    out = x.new_empty((rows, n // 2))
    if rows and n:
        _launch("swiglu", x, weight, bias, out, None, None)
    return out


def linear_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``argmax(x @ weight.T, dim=1)`` -> ``[M]`` int64 without writing the ``[M, V]``
    logits: the logits are rounded to ``x``'s dtype as the unfused product would be, and
    ties go to the lowest column as in ``torch.argmax``. NaN logits are not supported.

    Raises:
        ValueError: as :func:`linear`, or an empty vocabulary.
    """
    x, rows, n = _check(x, weight, None, "argmax")
    if n == 0:
        raise ValueError("weight: an argmax over an empty vocabulary")
    out = torch.empty((rows,), dtype=torch.int64, device=x.device)
    if rows:
        cfg = config_for("argmax", rows, n, x.shape[1], x.device)
        tiles = triton.cdiv(n, cfg.block_n)
        pv = torch.empty((rows, tiles), dtype=torch.float32, device=x.device)
        pi = torch.empty((rows, tiles), dtype=torch.int64, device=x.device)
        _launch("argmax", x, weight, None, None, pv, pi)
        block = min(ARGMAX_COMBINE_BLOCK, next_pow2(tiles))
        _argmax_combine_kernel[(rows,)](pv, pi, out, TILES=tiles, BLOCK=block, num_warps=4)
    return out


__all__ = [
    "ARGMAX_COMBINE_BLOCK",
    "DEFAULT_CONFIGS",
    "MAX_ROWS",
    "GemmConfig",
    "config_for",
    "linear",
    "linear_argmax",
    "linear_silu_mul",
    "m_bucket",
    "rule_config",
    "set_config_override",
]
