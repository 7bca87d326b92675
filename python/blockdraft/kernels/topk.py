# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Top-K of each logits row with the vocabulary split across programs.

``torch.topk`` runs one block per row: a handful of rows leaves most of the GPU idle and a
batch of rows 152K wide is slow. Here each of ``NUM_SPLITS`` programs per row keeps the best
``K`` of its slice of the vocabulary and a second tiny kernel merges the ``NUM_SPLITS * K``
partial winners. The split count is a function of shapes only, so a captured graph stays
valid.

Order is (value descending, id ascending): among equal values the lower id wins, at every
stage, so the chosen set is a function of the logits alone and the outputs come out sorted.
NaN logits are not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, next_pow2, sm_count

_NO_ID = tl.constexpr(2**31 - 1)  # an empty slot's id: ranks below every real id of equal value


@triton.jit
def _worst(buf_val, buf_id):
    # The kept entry that ranks last: the smallest value, and among those the largest id.
    # Slots past K hold +inf with id -1, so they are never the worst.
    w = tl.min(buf_val, axis=0)
    wi = tl.max(tl.where(buf_val == w, buf_id, -1), axis=0)
    return w, wi


@triton.jit
def _keep_tile(x, ids, buf_val, buf_id, slot, KP: tl.constexpr):
    # Moves the tile's entries that rank above the kept K's worst into the kept set, best
    # first; a tile with nothing good enough (the usual case once K good values are kept)
    # costs one max reduction. Taken entries become empty (-inf, _NO_ID), like padding.
    m = tl.max(x, axis=0)
    w, wi = _worst(buf_val, buf_id)
    go = m >= w
    while go:
        mi = tl.min(tl.where(x == m, ids, _NO_ID), axis=0)
        take = (m > w) | ((m == w) & (mi < wi))
        at = tl.min(tl.where((buf_val == w) & (buf_id == wi), slot, KP), axis=0)
        put = slot == tl.where(take, at, KP)
        buf_val = tl.where(put, m, buf_val)
        buf_id = tl.where(put, mi, buf_id)
        out = ids == tl.where(take, mi, -1)
        x = tl.where(out, float("-inf"), x)
        ids = tl.where(out, _NO_ID, ids)
        m = tl.max(x, axis=0)
        w, wi = _worst(buf_val, buf_id)
        go = take & (m >= w)
    return buf_val, buf_id


@triton.jit
def _tile(row_logits, base, lane, vocab, CHECK_RANGE: tl.constexpr):
    # The tile at id `base` as fp32 values and int32 ids; ids past the vocabulary are empty.
    # Each logit is read once, so it should not displace other data in L2.
    ids = base + lane
    if CHECK_RANGE:
        inside = ids < vocab
        x = tl.load(row_logits + ids, mask=inside, other=float("-inf"),
                    eviction_policy="evict_first").to(tl.float32)
        return x, tl.where(inside, ids, _NO_ID)
    x = tl.load(row_logits + ids, eviction_policy="evict_first").to(tl.float32)
    return x, ids


@triton.jit(do_not_specialize=["num_rows"])
def topk_partial_kernel(
    logits_ptr,  # [R, V] (row stride s_row, last dim contiguous)
    part_val_ptr,  # [R, NUM_SPLITS, K] fp32
    part_id_ptr,  # [R, NUM_SPLITS, K] int32 (_NO_ID for an empty slot)
    num_rows,
    vocab,
    s_row,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # ids per split, a multiple of BLOCK (shape-derived)
    K: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lane = tl.arange(0, BLOCK)  # int32: vocabularies are < 2^31 ids
    slot = tl.arange(0, KP)
    real = slot < K
    buf_val = tl.where(real, float("-inf"), float("inf"))
    buf_id = tl.where(real, _NO_ID, -1)
    row_logits = logits_ptr + row * s_row
    first = split * CHUNK
    for step in range(0, CHUNK // BLOCK):
        base = first + step * BLOCK
        if base + BLOCK <= vocab:
            x, ids = _tile(row_logits, base, lane, vocab, False)
        else:  # the ragged last tile (and tiles past the end in the last split)
            x, ids = _tile(row_logits, base, lane, vocab, True)
        buf_val, buf_id = _keep_tile(x, ids, buf_val, buf_id, slot, KP)
    out = (row * NUM_SPLITS + split) * K + slot
    tl.store(part_val_ptr + out, buf_val, mask=real)
    tl.store(part_id_ptr + out, buf_id, mask=real)


@triton.jit
def topk_combine_kernel(
    part_val_ptr,  # [R, NUM_SPLITS, K] fp32
    part_id_ptr,  # [R, NUM_SPLITS, K] int32
    val_ptr,  # [R, K] the logits' dtype
    id_ptr,  # [R, K] int64
    NUM_SPLITS: tl.constexpr,
    K: tl.constexpr,
    BLOCK_P: tl.constexpr,  # NUM_SPLITS * K rounded up to a power of two
):
    # K rounds of take-the-best over the partial winners, so the row comes out sorted.
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    inside = p < NUM_SPLITS * K
    x = tl.load(part_val_ptr + row * (NUM_SPLITS * K) + p, mask=inside, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * (NUM_SPLITS * K) + p, mask=inside, other=_NO_ID)
    for k in tl.static_range(K):
        m = tl.max(x, axis=0)
        mi = tl.min(tl.where(x == m, ids, _NO_ID), axis=0)
        tl.store(val_ptr + row * K + k, m.to(val_ptr.dtype.element_ty))
        tl.store(id_ptr + row * K + k, mi.to(tl.int64))
        out = ids == mi
        x = tl.where(out, float("-inf"), x)
        ids = tl.where(out, _NO_ID, ids)


def topk_block(vocab: int) -> tuple[int, int]:
    """``(ids per tile, warps)`` of the partial kernel: wide tiles for a real vocabulary
    (16 ids per thread, 16-byte loads), a small one where a wide tile would be mostly padding."""
    if vocab <= 2048:
        return 256, 2
    return 2048, 4


def topk_splits(num_rows: int, tiles: int, sms: int) -> int:
    """Vocabulary splits per row (a function of shapes only, so CUDA-graph safe): about four
    programs per SM in all for the rows rounded up to a power of two (a compile-time constant
    of a few values over every row count), never more splits than tiles."""
    return min(tiles, max(1, -(-4 * sms // next_pow2(num_rows))))


def topk(
    logits: torch.Tensor,
    k: int,
    *,
    num_splits: int | None = None,
    block: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-K; the contract of ``reference.topk``, with ties resolved to the lower ids
    and each row's K sorted by (value descending, id ascending).

    logits [..., V] (last dim contiguous) -> (values [..., k] in the logits' dtype, ids
    [..., k] int64). ``num_splits`` overrides the shape-derived split count and ``block`` the
    ``(ids per tile, warps)`` of :func:`topk_block` (for sweeps and tests).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError("logits: expected a tensor with a vocabulary dimension")
    lead, vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    check("logits", flat, shape=[None, None], dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if not 0 <= k <= vocab:
        raise ValueError(f"k: must be in [0, {vocab}], got {k}")
    if vocab >= 2**31 - 1:
        raise ValueError(f"logits: a vocabulary of {vocab} ids does not fit int32 ids")
    num_rows = flat.shape[0]
    values = torch.empty((num_rows, k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_rows, k), dtype=torch.int64, device=logits.device)
    if num_rows == 0 or k == 0:
        return values.view(*lead, k), ids.view(*lead, k)
    tile, warps = topk_block(vocab) if block is None else block
    if tile < 1 or tile & (tile - 1) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"block: must be (power-of-two ids, 1/2/4/8/16 warps), got {block}")
    tiles = triton.cdiv(vocab, tile)
    if num_splits is None:
        num_splits = topk_splits(num_rows, tiles, sm_count(logits.device))
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    chunk = triton.cdiv(tiles, num_splits) * tile
    num_splits = triton.cdiv(vocab, chunk)
    part_val = torch.empty((num_rows, num_splits, k), dtype=torch.float32, device=logits.device)
    part_id = torch.empty((num_rows, num_splits, k), dtype=torch.int32, device=logits.device)
    topk_partial_kernel[(num_rows, num_splits)](
        flat, part_val, part_id, num_rows, vocab, flat.stride(0), NUM_SPLITS=num_splits,
        CHUNK=chunk, K=k, KP=max(2, next_pow2(k)), BLOCK=tile, num_warps=warps,
    )
    topk_combine_kernel[(num_rows,)](
        part_val, part_id, values, ids, NUM_SPLITS=num_splits, K=k,
        BLOCK_P=max(2, next_pow2(num_splits * k)), num_warps=1 if num_splits * k <= 256 else 4,
    )
    return values.view(*lead, k), ids.view(*lead, k)
