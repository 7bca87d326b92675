# Triton ships no type information and @triton.jit kernels take untyped tensor/pointer
# arguments; the host launchers below are fully annotated.
# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Masked argmax over logits with a packed allowed-token bitmask.

The argmax splits the vocabulary across programs when there are few rows (decode: a handful of
rows must still fill the GPU) and reduces the per-split winners in a second tiny kernel; the
split count is a function of shapes only, so a captured graph stays valid.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._validate import FLOAT_DTYPES, check, next_pow2, sm_count

_NO_ID = tl.constexpr(1 << 62)  # "no allowed id seen yet"; larger than any vocabulary id
_NO_ID32 = tl.constexpr(2**31 - 1)  # the same inside the partial kernel (ids are int32 there)


@triton.jit
def _tile_logits(row_logits, base, tile_ids, vocab, CHECK_RANGE: tl.constexpr):
    # The logits of the [W, 32] tile at id `base` (ids past the vocabulary read as -inf),
    # streamed: each is read once, so it should not displace other data in L2.
    if CHECK_RANGE:
        return tl.load(row_logits + base + tile_ids, mask=(base + tile_ids) < vocab,
                       other=float("-inf"), eviction_policy="evict_first")
    return tl.load(row_logits + base + tile_ids, eviction_policy="evict_first")


@triton.jit
def _tile_bits(row_mask, base, word, num_words, HAS_MASK: tl.constexpr,
               CHECK_RANGE: tl.constexpr):
    # The tile's W mask words [W, 1] (unused without HAS_MASK).
    if HAS_MASK:
        w = base // 32 + word
        if CHECK_RANGE:
            return tl.load(row_mask + w, mask=w < num_words, other=0)
        return tl.load(row_mask + w)
    return word


@triton.jit
def _fold_tile(x, bits, best, best_it, it, bit_of_lane, HAS_MASK: tl.constexpr):
    # A lane moves to tile `it` only on an allowed, strictly larger value (so among equal
    # values it keeps its earliest id; NaN is never larger).
    x = x.to(tl.float32)
    take = x > best
    if HAS_MASK:
        take = take & ((bits & bit_of_lane) != 0)
    return tl.where(take, x, best), tl.where(take, it, best_it)


@triton.jit
def _argmax_step(row_logits, row_mask, base, it, best, best_it, word, bit_of_lane, tile_ids,
                 vocab, num_words, HAS_MASK: tl.constexpr, CHECK_RANGE: tl.constexpr,
                 UNROLL: tl.constexpr, TILE: tl.constexpr):
    # UNROLL (1 or 2) tiles from id `base` (tile indices it, it + 1): both tiles' loads are
    # issued before either is folded, so twice the bytes are in flight per lane.
    x0 = _tile_logits(row_logits, base, tile_ids, vocab, CHECK_RANGE)
    b0 = _tile_bits(row_mask, base, word, num_words, HAS_MASK, CHECK_RANGE)
    if UNROLL == 2:
        x1 = _tile_logits(row_logits, base + TILE, tile_ids, vocab, CHECK_RANGE)
        b1 = _tile_bits(row_mask, base + TILE, word, num_words, HAS_MASK, CHECK_RANGE)
    best, best_it = _fold_tile(x0, b0, best, best_it, it, bit_of_lane, HAS_MASK)
    if UNROLL == 2:
        best, best_it = _fold_tile(x1, b1, best, best_it, it + 1, bit_of_lane, HAS_MASK)
    return best, best_it


@triton.jit(do_not_specialize=["num_rows"])
def masked_argmax_partial_kernel(
    logits_ptr,  # [R, V] (row stride s_row, last dim contiguous)
    bitmask_ptr,  # [R, ceil(V/32)] int32 contiguous (unused without HAS_MASK)
    part_val_ptr,  # [R, NUM_SPLITS] fp32
    part_idx_ptr,  # [R, NUM_SPLITS] int64
    num_rows,
    vocab,
    num_words,
    s_row,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # ids per split, a multiple of BLOCK_W * 32 * UNROLL (shape-derived)
    HAS_MASK: tl.constexpr,
    BLOCK_W: tl.constexpr,  # bitmask words per tile: a tile is [BLOCK_W, 32] ids
    UNROLL: tl.constexpr,  # tiles per loop step (1 or 2)
):
    # Per lane: the largest allowed value above -inf and the tile it was first seen in; ids are
    # rebuilt at the end. Each mask word is loaded once per tile and tested against its lane's
    # bit; whole steps skip the range checks. Allowed ids whose logits are all -inf are found
    # by the combine kernel (this kernel reports "none" for them).
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    TILE: tl.constexpr = BLOCK_W * 32
    STEP: tl.constexpr = TILE * UNROLL
    word = tl.arange(0, BLOCK_W)[:, None]  # [W, 1]
    bit = tl.arange(0, 32)[None, :]  # [1, 32]
    bit_of_lane = tl.full([1, 32], 1, tl.int32) << bit
    tile_ids = word * 32 + bit  # [W, 32] int32 (vocabularies are < 2^31 ids)
    row_logits = logits_ptr + row * s_row
    row_mask = bitmask_ptr + row * num_words
    best = tl.full([BLOCK_W, 32], float("-inf"), tl.float32)
    best_it = tl.full([BLOCK_W, 32], -1, tl.int32)
    first = split * CHUNK
    for step in range(0, CHUNK // STEP):
        base = first + step * STEP
        if base + STEP <= vocab:
            best, best_it = _argmax_step(row_logits, row_mask, base, step * UNROLL, best,
                                         best_it, word, bit_of_lane, tile_ids, vocab, num_words,
                                         HAS_MASK, False, UNROLL, TILE)
        else:  # the ragged last step (and steps past the end in the last split)
            best, best_it = _argmax_step(row_logits, row_mask, base, step * UNROLL, best,
                                         best_it, word, bit_of_lane, tile_ids, vocab, num_words,
                                         HAS_MASK, True, UNROLL, TILE)
    seen = best_it >= 0
    ids = first + best_it * TILE + tile_ids
    top = tl.max(tl.max(tl.where(seen, best, float("-inf")), axis=1), axis=0)
    idx = tl.min(tl.min(tl.where(seen & (best == top), ids, _NO_ID32), axis=1), axis=0)
    tl.store(part_val_ptr + row * NUM_SPLITS + split, top)
    tl.store(
        part_idx_ptr + row * NUM_SPLITS + split,
        tl.where(idx == _NO_ID32, _NO_ID, idx.to(tl.int64)),
    )


@triton.jit
def masked_argmax_combine_kernel(
    part_val_ptr,  # [R, NUM_SPLITS] fp32
    part_idx_ptr,  # [R, NUM_SPLITS] int64
    bitmask_ptr,  # [R, ceil(V/32)] int32 contiguous (unused without HAS_MASK)
    out_ptr,  # [R] int64
    vocab,
    num_words,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S).to(tl.int64)
    s_mask = sp < NUM_SPLITS
    val = tl.load(part_val_ptr + row * NUM_SPLITS + sp, mask=s_mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * NUM_SPLITS + sp, mask=s_mask, other=_NO_ID)
    seen = idx != _NO_ID
    top = tl.max(tl.where(seen, val, float("-inf")), axis=0)
    best = tl.min(tl.where(seen & (val == top), idx, _NO_ID), axis=0)
    if best == _NO_ID:
        # No allowed id has a logit above -inf: the answer is the lowest allowed id (every
        # allowed logit is -inf), or -1 when nothing is allowed. Rare; a scan of the mask row.
        if HAS_MASK:
            word = tl.arange(0, 64)[:, None]
            bit = tl.arange(0, 32)[None, :]
            w0 = 0
            while w0 < num_words:  # a while loop: the CPU interpreter takes no runtime range()
                w = w0 + word
                bits = tl.load(bitmask_ptr + row * num_words + w, mask=w < num_words, other=0)
                ids = (w * 32 + bit).to(tl.int64)
                hit = (((bits >> bit) & 1) != 0) & (ids < vocab)
                best = tl.minimum(best, tl.min(tl.min(tl.where(hit, ids, _NO_ID), axis=1),
                                               axis=0))
                w0 += 64
        else:
            best = tl.where(vocab > 0, 0, _NO_ID).to(tl.int64)
    tl.store(out_ptr + row, tl.where(best == _NO_ID, -1, best))


def _check_inputs(logits: torch.Tensor, bitmask: torch.Tensor | None) -> tuple[int, int, int]:
    check("logits", logits, shape=[None, None], dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_rows, vocab = logits.shape
    num_words = math.ceil(vocab / 32)
    if bitmask is not None:
        check("bitmask", bitmask, shape=[num_rows, num_words], dtypes=[torch.int32],
              device=logits.device, contiguous=True)
    return num_rows, vocab, num_words


def argmax_tile(num_rows: int, vocab: int) -> tuple[int, int, int]:
    """``(mask words per tile, warps, tiles per loop step)`` of the argmax partial kernel,
    from the H200 sweeps in kernels/RESULTS.md: many rows (a batch's drafts) run best as many
    small programs (32 words = 1024 ids, 2 warps) that load two tiles per step (0.0638 ->
    0.0536 ms at 512 x 151936 with a mask); a few rows (one sequence's drafts) as wide ones
    (64 words, 8 warps, one tile per step: two measured no faster); small vocabularies
    get a tile that is not mostly padding. Rows are rounded up to a power of two, as in
    :func:`argmax_splits`."""
    if vocab <= 2048:
        return 16, 2, 1
    if next_pow2(num_rows) >= 256:
        return 32, 2, 2
    return 64, 8, 1


def argmax_splits(num_rows: int, tiles: int, sms: int) -> int:
    """Vocabulary splits per row (a function of shapes only, so CUDA-graph safe): about four
    programs per SM in all for the rows rounded up to a power of two (the count is a
    compile-time constant: a few values over every row count), at least 3 for many rows
    (1 or 2 splits measured up to 15% slower at 512 rows), never more splits than loop steps
    (``tiles``: steps of the tile shape)."""
    rows = next_pow2(num_rows)
    floor = 3 if rows >= 256 else 1
    return min(tiles, max(floor, -(-4 * sms // rows)))


def masked_argmax(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    *,
    num_splits: int | None = None,
    tile: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton masked argmax; same contract as ``reference.masked_argmax``.

    logits [R, V] (last dim contiguous); bitmask [R, ceil(V/32)] int32 or None -> [R] int64.
    ``num_splits`` overrides the shape-derived vocabulary split count and ``tile`` the
    ``(mask words per tile, warps[, tiles per step])`` of :func:`argmax_tile` (the kernel lab
    sweeps both; a step is 1 tile unless given).
    """
    num_rows, vocab, num_words = _check_inputs(logits, bitmask)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if vocab >= 2**31 - 1:
        raise ValueError(f"logits: a vocabulary of {vocab} ids does not fit int32 ids")
    shape = argmax_tile(num_rows, vocab) if tile is None else (*tile, 1)[:3]
    if len(shape) != 3:
        raise ValueError(f"tile: must be (words, warps[, tiles per step]), got {tile}")
    block_w, warps, unroll = shape
    if (block_w < 1 or block_w & (block_w - 1) or warps not in (1, 2, 4, 8, 16)
            or unroll not in (1, 2)):
        raise ValueError(
            f"tile: must be (power-of-two words, 1/2/4/8/16 warps[, 1/2 tiles per step]), "
            f"got {tile}"
        )
    step_ids = block_w * 32 * unroll
    steps = max(1, triton.cdiv(vocab, step_ids))
    if num_splits is None:
        num_splits = argmax_splits(num_rows, steps, sm_count(logits.device))
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    chunk = triton.cdiv(steps, num_splits) * step_ids
    num_splits = max(1, triton.cdiv(vocab, chunk))
    part_val = torch.empty((num_rows, num_splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((num_rows, num_splits), dtype=torch.int64, device=logits.device)
    mask_arg = bitmask if bitmask is not None else part_idx
    masked_argmax_partial_kernel[(num_rows, num_splits)](
        logits, mask_arg, part_val, part_idx, num_rows, vocab, num_words, logits.stride(0),
        NUM_SPLITS=num_splits, CHUNK=chunk, HAS_MASK=bitmask is not None, BLOCK_W=block_w,
        UNROLL=unroll, num_warps=warps,
    )
    masked_argmax_combine_kernel[(num_rows,)](
        part_val, part_idx, mask_arg, out, vocab, num_words, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), HAS_MASK=bitmask is not None,
        num_warps=1,
    )
    return out
