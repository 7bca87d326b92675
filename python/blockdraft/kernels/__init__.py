"""The drafter's hot-path kernels, each with a plain-torch reference.

Every launcher takes ``backend``: ``"triton"`` runs the Triton kernel (CUDA tensors, or CPU
tensors under ``TRITON_INTERPRET=1``), ``"torch"`` runs the reference in
``blockdraft.kernels.reference`` on any device, and ``None`` picks ``"triton"`` for CUDA tensors
when Triton is importable, else ``"torch"``. Both backends agree within dtype tolerance; the
sampling launchers draw their randomness identically, so they pick the same tokens.

Shapes (``R`` rows, ``L`` layers, ``Hq``/``Hkv`` heads, ``D`` head dim, ``B`` block size, ``n``
sequences, ``V`` vocab): see each function and ``docs/design/interfaces.md``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from . import reference
from ._validate import interpreting
from .reference import PAD_SLOT

logger = logging.getLogger(__name__)

Backend = Literal["triton", "torch"]

__all__ = [
    "PAD_SLOT",
    "Backend",
    "acc_append",
    "acc_slide",
    "block_attention",
    "block_inputs",
    "ctx_kv_store",
    "dynamic_conv",
    "masked_argmax",
    "masked_sample",
    "reference",
    "selector_walk",
    "triton_available",
]

_TRITON_MODULES = (
    "kv_store", "paged_attention", "accumulator", "selection", "dflash2", "graph_inputs",
)
_triton_mods: dict[str, ModuleType] = {}
_triton_error: str | None = None


def _load_triton() -> str | None:
    """Import the Triton kernel modules once; return why they are unavailable, if they are."""
    global _triton_error
    if _triton_mods or _triton_error is not None:
        return _triton_error
    try:
        for name in _TRITON_MODULES:
            _triton_mods[name] = importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:  # no triton on this platform
        _triton_mods.clear()
        _triton_error = f"triton kernels unavailable: {exc}"
        logger.info("%s; using the torch references", _triton_error)
    return _triton_error


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here."""
    return _load_triton() is None


def _kernel(backend: Backend | None, device: torch.device, module: str) -> ModuleType | None:
    """The Triton module to use, or None for the torch reference."""
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend: expected 'triton', 'torch' or None, got {backend!r}")
    if backend == "torch":
        return None
    if backend is None and device.type != "cuda" and not interpreting():
        return None
    error = _load_triton()
    if error is not None:
        if backend == "triton":
            raise RuntimeError(error)
        return None
    return _triton_mods[module]


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
    *,
    backend: Backend | None = None,
) -> None:
    """kv [R, L, 2, Hkv, D] -> K (k_norm + RoPE) and V written at ``slots`` of every layer's
    paged cache ([L, num_blocks, block_size, Hkv, D] or L tensors [num_blocks, block_size,
    Hkv, D]); ``slot_pos`` [num_blocks * block_size] int32 gets the positions. Negative slots
    (``PAD_SLOT``) are skipped."""
    mod = _kernel(backend, kv.device, "kv_store")
    fn = reference.ctx_kv_store if mod is None else mod.ctx_kv_store
    fn(kv, positions, slots, k_norm_w, inv_freq, rope_scale, eps, k_caches, v_caches, slot_pos)


def block_attention(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_pos: torch.Tensor,
    slot_pos: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    causal_block: bool = False,
    backend: Backend | None = None,
) -> torch.Tensor:
    """q [n, B, Hq, D] over paged ctx K/V plus the block's k_blk/v_blk [n, B, Hkv, D]
    -> [n, B, Hq, D]. See ``reference.block_attention`` for the exact rule."""
    mod = _kernel(backend, q.device, "paged_attention")
    if mod is None:
        return reference.block_attention(
            q, k_blk, v_blk, k_cache, v_cache, block_tables, ctx_lens, q_pos, slot_pos,
            scale=scale, sliding_window=sliding_window, causal_block=causal_block)
    out: torch.Tensor = mod.block_attention(
        q, k_blk, v_blk, k_cache, v_cache, block_tables, ctx_lens, q_pos, slot_pos,
        scale=scale, sliding_window=sliding_window, causal_block=causal_block)
    return out


def acc_append(
    accs: Sequence[torch.Tensor],
    rows: torch.Tensor,
    row_counts: Sequence[int],
    dst_starts: Sequence[int],
    *,
    backend: Backend | None = None,
) -> None:
    """Sequence i's next ``row_counts[i]`` rows of ``rows`` [R, C] go to ``accs[i]`` [W_i, C]
    at ``dst_starts[i]``; one launch for the batch."""
    mod = _kernel(backend, rows.device, "accumulator")
    fn = reference.acc_append if mod is None else mod.acc_append
    fn(accs, rows, row_counts, dst_starts)


def acc_slide(
    accs: Sequence[torch.Tensor],
    src_starts: Sequence[int],
    keeps: Sequence[int],
    *,
    backend: Backend | None = None,
) -> None:
    """Rows ``[src_starts[i], src_starts[i] + keeps[i])`` of ``accs[i]`` move to the front
    (overlap-safe); one launch for the batch."""
    if len(accs) == 0:
        return
    mod = _kernel(backend, accs[0].device, "accumulator")
    fn = reference.acc_slide if mod is None else mod.acc_slide
    fn(accs, src_starts, keeps)


def masked_argmax(
    logits: torch.Tensor, bitmask: torch.Tensor | None = None, *, backend: Backend | None = None
) -> torch.Tensor:
    """logits [R, V], packed bitmask [R, ceil(V/32)] int32 (bit set = allowed) or None
    -> [R] int64; ties to the lowest id; -1 for a row with nothing allowed."""
    mod = _kernel(backend, logits.device, "selection")
    if mod is None:
        return reference.masked_argmax(logits, bitmask)
    out: torch.Tensor = mod.masked_argmax(logits, bitmask)
    return out


def block_inputs(
    meta: torch.Tensor,
    table_col: int,
    width: int,
    embed: torch.Tensor,
    mask_id: int,
    block: int,
    dtype: torch.dtype,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The graph path's metadata ``[m, C]`` int64 -> (ctx lens [m] int32, block tables
    [m, width] int32, embedded blocks [m, B, H], positions [m, B] int64); see
    ``reference.block_inputs``."""
    mod = _kernel(backend, meta.device, "graph_inputs")
    if mod is None:
        return reference.block_inputs(meta, table_col, width, embed, mask_id, block, dtype)
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = mod.block_inputs(
        meta, table_col, width, embed, mask_id, block, dtype
    )
    return out


def masked_sample(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one allowed token per row -> (tokens [R] int64, q_prob [R] fp32, the chosen
    token's draft probability). See ``reference.masked_sample``."""
    if top_k < 0:
        raise ValueError(f"top_k: must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    mod = _kernel(backend, logits.device, "selection")
    if mod is None:
        return reference.masked_sample(logits, bitmask, temperature, top_k, top_p, generator)
    result: tuple[torch.Tensor, torch.Tensor] = mod.masked_sample(
        logits, bitmask, temperature, top_k, top_p, generator)
    return result


def dynamic_conv(
    hidden: torch.Tensor,
    dynamic: torch.Tensor,
    base: torch.Tensor,
    group_size: int,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """DFlash2 grouped dynamic causal conv: hidden [n, B, H], dynamic [n, B, K, H/group_size],
    base [K, H] -> [n, B, H]."""
    mod = _kernel(backend, hidden.device, "dflash2")
    if mod is None:
        return reference.dynamic_conv(hidden, dynamic, base, group_size)
    out: torch.Tensor = mod.dynamic_conv(hidden, dynamic, base, group_size)
    return out


def selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    hidden_proj: torch.Tensor,
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    anchor: torch.Tensor,
    temperature: float,
    uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash2 selector walk -> (path [n, P] int64, q [n, P, K] fp32 or None when greedy).
    When sampling without ``uniforms``, draws them from ``generator`` ([n, P] fp32)."""
    if temperature > 0 and uniforms is None:
        uniforms = torch.rand(unary.shape[:2], generator=generator, device=unary.device,
                              dtype=torch.float32)
    mod = _kernel(backend, unary.device, "dflash2")
    fn = reference.selector_walk if mod is None else mod.selector_walk
    result: tuple[torch.Tensor, torch.Tensor | None] = fn(
        unary, candidates, hidden_proj, pred_codebook, succ_codebook, anchor, temperature,
        uniforms)
    return result
