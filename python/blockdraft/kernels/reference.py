"""Plain-torch references for every kernel in this package.

These are the definitions the Triton kernels are tested against and the ``backend="torch"``
implementation on any device. They are written to be obviously right (explicit loops over
sequences and rows, fp32 arithmetic, one cast at the end), not fast. Never change a reference
to make a kernel pass.

Notation: ``R`` rows, ``L`` drafter layers, ``Hq``/``Hkv`` query and K/V heads, ``D`` head dim,
``B`` block size (queries per sequence), ``n`` sequences, ``V`` vocabulary size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockdraft.models.layers import embed_blocks
from blockdraft.sampling import allowed_ids

PAD_SLOT = -1
"""Slot value of a row that must not be written (same value as ``blockdraft.core.PAD_SLOT``)."""


def _layer_caches(caches: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return [caches[i] for i in range(caches.shape[0])]
    return list(caches)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotate-half RoPE, in fp32.

    positions [R] int -> (cos [R, D], sin [R, D]), each the ``[R, D/2]`` angle table repeated
    twice along the last dim and multiplied by ``rope_scale`` (HF ``attention_scaling``).
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * rope_scale, emb.sin() * rope_scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: ``cat(-x2, x1)`` where ``x1, x2`` are the two halves of D."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


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
    """Write the context rows' K (RMS-normed per head, then RoPE) and V into the paged caches.

    kv [R, L, 2, Hkv, D] (index 0 = K, 1 = V); positions [R] int64; slots [R] int64
    (negative slots, i.e. ``PAD_SLOT``, are skipped); k_norm_w [L, D]; inv_freq [D/2] fp32;
    k_caches / v_caches: [L, num_pages, page_size, Hkv, D] or a sequence of L tensors
    [num_pages, page_size, Hkv, D]; slot_pos [num_pages * page_size] int32 gets each
    written slot's position.
    """
    k_list, v_list = _layer_caches(k_caches), _layer_caches(v_caches)
    num_layers = kv.shape[1]
    for r in range(kv.shape[0]):
        slot = int(slots[r])
        if slot < 0:  # PAD_SLOT
            continue
        page_size = k_list[0].shape[1]
        page, offset = divmod(slot, page_size)
        cos, sin = rope_cos_sin(positions[r : r + 1], inv_freq, rope_scale)
        for layer in range(num_layers):
            k = kv[r, layer, 0].to(torch.float32)  # [Hkv, D]
            v = kv[r, layer, 1]
            variance = k.pow(2).mean(dim=-1, keepdim=True)
            k = k * torch.rsqrt(variance + eps) * k_norm_w[layer].to(torch.float32)
            k = k * cos + rotate_half(k) * sin
            k_list[layer][page, offset] = k.to(k_list[layer].dtype)
            v_list[layer][page, offset] = v.to(v_list[layer].dtype)
        slot_pos[slot] = int(positions[r])


def _visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None, causal_block: bool
) -> torch.Tensor:
    """[Nq] x [Nk] positions -> [Nq, Nk] bool: which keys each query attends to."""
    qp = q_pos[:, None]
    kp = k_pos[None, :]
    visible = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal_block:
        visible &= kp <= qp
    if sliding_window is not None:
        visible &= (qp - kp) < sliding_window
        if not causal_block:
            visible &= (kp - qp) < sliding_window
    return visible


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
) -> torch.Tensor:
    """Attention of each sequence's B block queries over its paged context plus its own block.

    q [n, B, Hq, D]; k_blk, v_blk [n, B, Hkv, D]; k_cache, v_cache [num_pages, page_size,
    Hkv, D]; page_tables [n, max_pages] int32; ctx_lens [n] int32 (context row ``t`` of
    sequence ``s`` lives in slot ``page_tables[s, t // page_size] * page_size + t %
    page_size``); q_pos [n, B] int64 (block key ``j`` has the position of query ``j``);
    slot_pos [num_pages * page_size] int32 (positions of context keys).

    Visibility of key position ``kp`` from query position ``qp``: ``kp <= qp`` if
    ``causal_block``; with a sliding window W, ``qp - kp < W`` and, when not causal,
    ``kp - qp < W``. Returns [n, B, Hq, D] in q's dtype.
    """
    n, num_q, num_heads, _ = q.shape
    group = num_heads // k_blk.shape[2]
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for s in range(n):
        ctx = int(ctx_lens[s])
        tokens = torch.arange(ctx, device=q.device)
        slots = page_tables[s, tokens // page_size].to(torch.int64) * page_size + (
            tokens % page_size
        )
        k_ctx = k_cache.reshape(-1, *k_cache.shape[2:])[slots]
        v_ctx = v_cache.reshape(-1, *v_cache.shape[2:])[slots]
        keys = torch.cat([k_ctx, k_blk[s]], dim=0).to(torch.float32)  # [ctx + B, Hkv, D]
        values = torch.cat([v_ctx, v_blk[s]], dim=0).to(torch.float32)
        k_pos = torch.cat([slot_pos[slots].to(torch.int64), q_pos[s].to(torch.int64)])
        visible = _visible(q_pos[s].to(torch.int64), k_pos, sliding_window, causal_block)
        # query head h reads K/V head h // group
        keys = keys.repeat_interleave(group, dim=1)  # [ctx + B, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("bhd,thd->hbt", q[s].to(torch.float32), keys) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[s] = torch.einsum("hbt,thd->bhd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


def acc_append(
    accs: Sequence[torch.Tensor],
    rows: torch.Tensor,
    row_counts: Sequence[int],
    dst_starts: Sequence[int],
) -> None:
    """Copy rows into accumulators: sequence ``i`` takes the next ``row_counts[i]`` rows of
    ``rows`` [R, C] (in order) into ``accs[i]`` [W_i, C] at rows ``[dst_starts[i], ...)``."""
    cursor = 0
    for acc, count, start in zip(accs, row_counts, dst_starts):
        for j in range(count):
            acc[start + j] = rows[cursor + j]
        cursor += count


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [M, H]`` (+ ``y [M, H]``) -> ``(h + y, rms_norm(h + y) * weight)``, each [M, H].

    The sum is rounded to ``h``'s dtype (the residual stream is kept in the activation dtype);
    the norm is fp32 math with one cast at the end. ``y=None``: no add (``h`` is returned as
    the first element).
    """
    if y is not None:
        h = (h.to(torch.float32) + y.to(torch.float32)).to(h.dtype)
    hf = h.to(torch.float32)
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, (hf * rstd * weight.to(torch.float32)).to(h.dtype)


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """[M, heads, D] fp32 -> per-head RMSNorm times ``weight`` [D] (``None``: unchanged)."""
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)


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
    """``qkv [M, (Hq+2Hkv)*D]`` (q heads, then k, then v), ``positions [M]`` int64 ->
    ``q [M, Hq, D]``, ``k, v [M, Hkv, D]`` in ``qkv``'s dtype: q and k RMS-normed per head with
    their weights ``[D]`` (``None``: no norm, as in Llama), then rotate-half RoPE at
    ``positions``; v split off unchanged. fp32 math, one cast."""
    m = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    x = qkv.to(torch.float32).reshape(m, num_heads + 2 * num_kv_heads, d)
    q = _head_rms_norm(x[:, :num_heads], q_norm_w, eps)
    k = _head_rms_norm(x[:, num_heads : num_heads + num_kv_heads], k_norm_w, eps)
    cos, sin = rope_cos_sin(positions, inv_freq, rope_scale)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    v = qkv.reshape(m, num_heads + 2 * num_kv_heads, d)[:, num_heads + num_kv_heads :]
    return q.to(qkv.dtype), k.to(qkv.dtype), v.contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[M, 2I]`` (gate columns, then up) -> ``silu(gate) * up`` ``[M, I]``, each factor
    rounded to the activation dtype before the product (as ``F.silu(gate) * up`` computes)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


SKINNY_MAX_ROWS = 16
"""The most rows the Triton ``linear`` / ``linear_silu_mul`` / ``linear_argmax`` take (the
weight-streaming kernels of ``skinny_gemm``); the references take any number."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T (+ bias [N])`` -> ``[M, N]`` in ``x``'s dtype."""
    return torch.nn.functional.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]``, fused ``weight [2I, K]`` (gate rows, then up rows; ``bias [2I]``
    likewise) -> ``silu(x @ gate.T) * (x @ up.T)`` ``[M, I]``: :func:`linear`, then
    :func:`silu_mul`."""
    return silu_mul(linear(x, weight, bias))


def linear_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K]``, ``weight [V, K]`` -> ``[M]`` int64: the argmax of each row's logits (in
    ``x``'s dtype), ties to the lowest id as ``torch.argmax``."""
    return torch.argmax(linear(x, weight), dim=1)


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
    """:func:`qk_norm_rope`, with K and V written into one layer's paged cache
    ``[num_pages, page_size, Hkv, D]`` at ``slots [M]`` int64 (slot ``s`` is row ``s %
    page_size`` of page ``s // page_size``; ``PAD_SLOT`` rows are not written). Returns
    ``q [M, Hq, D]``."""
    q, k, v = qk_norm_rope(qkv, positions, q_norm_w, k_norm_w, inv_freq, rope_scale, eps,
                           num_heads, num_kv_heads)
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    keep = slots != PAD_SLOT
    k_flat[slots[keep]] = k[keep].to(k_cache.dtype)
    v_flat[slots[keep]] = v[keep].to(v_cache.dtype)
    return q


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
) -> torch.Tensor:
    """New rows over their sequences' paged K/V, causal by position.

    ``q [R, Hq, D]`` holds the new rows of ``n`` sequences back to back: sequence ``i``'s are
    rows ``q_starts[i] .. q_starts[i + 1] - 1`` (``q_starts [n + 1]`` int32), at ``positions
    [R]`` int64. Sequence ``i``'s keys are positions ``0 .. kv_lens[i] - 1`` (``[n]`` int32),
    key ``p`` in row ``p % page_size`` of page ``page_tables[i, p // page_size]`` of
    ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]`` (the new rows' own K/V already
    written there). A row at position ``t`` sees the keys at positions ``p <= t``, and with a
    ``sliding_window`` only those with ``t - p < sliding_window``. Query head ``h`` uses K/V
    head ``h // (Hq / Hkv)``. Returns ``[R, Hq, D]`` in ``q``'s dtype; fp32 math.
    ``max_rows`` (the most new rows of any sequence) sizes the kernel's grid; the reference
    needs no bound.
    """
    num_rows, num_heads, _ = q.shape
    page = k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(page_tables.shape[0]):
        r0, r1 = int(q_starts[i]), int(q_starts[i + 1])
        if r1 == r0:
            continue
        kv_len = int(kv_lens[i])
        keys = torch.arange(kv_len, device=q.device)
        slots = page_tables[i, keys // page].to(torch.int64) * page + keys % page
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].to(torch.float32)  # [T, Hkv, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].to(torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [T, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[r0:r1].to(torch.float32)  # [r, Hq, D]
        scores = torch.einsum("rhd,thd->hrt", qs, k) * scale
        qp = positions[r0:r1].to(torch.int64)
        visible = keys[None, :] <= qp[:, None]
        if sliding_window is not None:
            visible = visible & (qp[:, None] - keys[None, :] < sliding_window)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[r0:r1] = torch.einsum("hrt,thd->rhd", probs, v).to(q.dtype)
    return out


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """logits [R, V], bitmask [R, ceil(V/32)] int32 or None -> [R] int64.

    The allowed id with the largest logit; ties go to the lowest id (like ``torch.argmax``,
    which returns the first of equal maxima). A row with no allowed id gives -1. NaN logits
    are not supported.
    """
    num_rows, vocab = logits.shape
    allowed = (
        torch.ones(num_rows, vocab, dtype=torch.bool, device=logits.device)
        if bitmask is None
        else allowed_ids(bitmask, vocab)
    )
    scores = logits.to(torch.float32).masked_fill(~allowed, float("-inf"))
    best = torch.argmax(scores, dim=1)
    # A row whose allowed logits are all -inf ties at -inf: its lowest allowed id wins (the
    # argmax above may have landed on a disallowed id, also -inf after the mask).
    all_minus_inf = scores.max(dim=1).values == float("-inf")
    best = torch.where(all_minus_inf, torch.argmax(allowed.to(torch.int8), dim=1), best)
    return torch.where(allowed.any(dim=1), best, torch.full_like(best, -1))


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (values [..., k] in the logits' dtype, ids [..., k] int64): the ``k``
    largest logits of each row, in no promised order (``torch.topk(sorted=False)``). Which of
    equal values at the k-th place are chosen is torch's choice here; the Triton op takes the
    lowest ids.
    """
    values, ids = torch.topk(logits, k, dim=-1, sorted=False)
    return values, ids


def block_inputs(
    meta: torch.Tensor,
    table_col: int,
    width: int,
    embed: torch.Tensor,
    mask_id: int,
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft forward's inputs from the graph metadata (see :mod:`blockdraft.graphs`).

    meta ``[m, C]`` int64, per row ``[ctx len, anchor token, anchor position, ...]`` with the
    page table in columns ``table_col .. table_col + width``; embed ``[V, H]`` ->
    ``(ctx lens [m] int32, tables [m, width] int32, embeds [m, B, H] dtype, positions [m, B]
    int64)``: the blocks ``[anchor, mask_id x (B-1)]`` embedded, at positions ``anchor
    position + 0..B-1``.
    """
    lens = meta[:, 0].to(torch.int32)
    tables = meta[:, table_col : table_col + width].to(torch.int32)
    embeds, q_pos = embed_blocks(meta[:, 1], meta[:, 2], embed, mask_id, block, dtype)
    return lens, tables, embeds, q_pos


def dynamic_conv(
    x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor, block: int, group_size: int
) -> torch.Tensor:
    """DFlash2's grouped dynamic causal convolution over blocks of ``block`` rows.

    x ``[M, H]``: ``M / block`` blocks of ``block`` rows, one after another; taps ``[M, K, G]``
    (any strides) the dynamic per-group taps of each output row (``G = H / group_size``);
    base ``[K, H]`` the static per-channel taps -> ``[M, H]`` in ``x``'s dtype::

        out[t, c] = sum_{o < K, o <= j(t)} (base[o, c] + taps[t, o, c // group_size]) * x[t - o, c]

    where ``j(t)`` is row ``t``'s index inside its block (taps never reach the block before).
    """
    rows, size = x.shape
    kernel = base.shape[0]
    if rows % block:
        raise ValueError(f"{rows} rows do not split into blocks of {block}")
    xf = x.to(torch.float32)
    out = torch.zeros((rows, size), dtype=torch.float32, device=x.device)
    group_of = torch.arange(size, device=x.device) // group_size
    for t in range(rows):
        for o in range(min(kernel, t % block + 1)):
            weight = base[o].to(torch.float32) + taps[t, o].to(torch.float32)[group_of]
            out[t] += weight * xf[t - o]
    return out.to(x.dtype)


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
    """DFlash2's candidate-selector walk, left to right along each sequence's ``T`` rows.

    unary ``[n, T, K]`` the candidates' logits, candidates ``[n, T, K]`` int64 their ids,
    projected ``[n, T, R]`` the rows' ``hidden_projection``, pred / succ ``[V, R]`` the
    codebooks, anchors ``[n]`` int64 the token before row 0. Row ``t`` scores candidate ``k``
    ``unary[t, k] + sum_r pred[prev, r] * projected[t, r] * succ[cand[t, k], r]`` (fp32), with
    ``prev`` the token chosen for row ``t - 1`` (the anchor for row 0).

    ``noise`` ``None``: the best score is chosen (the first among equals). Otherwise ``noise``
    ``[n, T, K]`` fp32 Gumbel draws: the row's distribution is ``q = softmax(score /
    temperature)`` and the choice ``argmax(score / temperature + noise)`` (a draw from ``q``).

    Returns:
        ``(tokens [n, T] int64, q [n, T, K] fp32 or None when greedy)``.
    """
    n, steps, _ = candidates.shape
    tokens = torch.empty((n, steps), dtype=torch.int64, device=candidates.device)
    q_all = (torch.empty(candidates.shape, dtype=torch.float32, device=candidates.device)
             if noise is not None else None)
    prev = anchors  # [n]: every sequence's walk in step, row by row
    for t in range(steps):
        cand = candidates[:, t]  # [n, K]
        pair = pred[prev].to(torch.float32) * projected[:, t].to(torch.float32)  # [n, R]
        score = unary[:, t].to(torch.float32) + (succ[cand].to(torch.float32) * pair[:, None, :]).sum(-1)
        if noise is None:
            index = torch.argmax(score, dim=-1)
        else:
            assert q_all is not None
            z = score / temperature
            q_all[:, t] = torch.softmax(z, dim=-1)
            index = torch.argmax(z + noise[:, t].to(torch.float32), dim=-1)
        prev = cand.gather(1, index[:, None])[:, 0]
        tokens[:, t] = prev
    return tokens, q_all
