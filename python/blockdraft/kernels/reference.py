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

PAD_SLOT = -1
"""Slot value of a row that must not be written (same value as ``blockdraft.PAD_SLOT``)."""


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
    k_caches / v_caches: [L, num_blocks, block_size, Hkv, D] or a sequence of L tensors
    [num_blocks, block_size, Hkv, D]; slot_pos [num_blocks * block_size] int32 gets each
    written slot's position.
    """
    k_list, v_list = _layer_caches(k_caches), _layer_caches(v_caches)
    num_layers = kv.shape[1]
    for r in range(kv.shape[0]):
        slot = int(slots[r])
        if slot < 0:  # PAD_SLOT
            continue
        block_size = k_list[0].shape[1]
        block, offset = divmod(slot, block_size)
        cos, sin = rope_cos_sin(positions[r : r + 1], inv_freq, rope_scale)
        for layer in range(num_layers):
            k = kv[r, layer, 0].to(torch.float32)  # [Hkv, D]
            v = kv[r, layer, 1]
            variance = k.pow(2).mean(dim=-1, keepdim=True)
            k = k * torch.rsqrt(variance + eps) * k_norm_w[layer].to(torch.float32)
            k = k * cos + rotate_half(k) * sin
            k_list[layer][block, offset] = k.to(k_list[layer].dtype)
            v_list[layer][block, offset] = v.to(v_list[layer].dtype)
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
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_pos: torch.Tensor,
    slot_pos: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    causal_block: bool = False,
) -> torch.Tensor:
    """Attention of each sequence's B block queries over its paged context plus its own block.

    q [n, B, Hq, D]; k_blk, v_blk [n, B, Hkv, D]; k_cache, v_cache [num_blocks, block_size,
    Hkv, D]; block_tables [n, max_blocks] int32; ctx_lens [n] int32 (context row ``t`` of
    sequence ``s`` lives in slot ``block_tables[s, t // block_size] * block_size + t %
    block_size``); q_pos [n, B] int64 (block key ``j`` has the position of query ``j``);
    slot_pos [num_blocks * block_size] int32 (positions of context keys).

    Visibility of key position ``kp`` from query position ``qp``: ``kp <= qp`` if
    ``causal_block``; with a sliding window W, ``qp - kp < W`` and, when not causal,
    ``kp - qp < W``. Returns [n, B, Hq, D] in q's dtype.
    """
    n, num_q, num_heads, _ = q.shape
    group = num_heads // k_blk.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for s in range(n):
        ctx = int(ctx_lens[s])
        tokens = torch.arange(ctx, device=q.device)
        slots = block_tables[s, tokens // block_size].to(torch.int64) * block_size + (
            tokens % block_size
        )
        k_ctx = k_cache.reshape(-1, *k_cache.shape[2:])[slots]
        v_ctx = v_cache.reshape(-1, *v_cache.shape[2:])[slots]
        keys = torch.cat([k_ctx, k_blk[s]], dim=0).to(torch.float32)  # [ctx + B, Hkv, D]
        values = torch.cat([v_ctx, v_blk[s]], dim=0).to(torch.float32)
        k_pos = torch.cat([slot_pos[slots].to(torch.int64), q_pos[s].to(torch.int64)])
        visible = _visible(q_pos[s].to(torch.int64), k_pos, sliding_window, causal_block)
        for h in range(num_heads):
            qh = q[s, :, h].to(torch.float32)  # [B, D]
            kh = keys[:, h // group]  # [ctx + B, D]
            vh = values[:, h // group]
            scores = (qh @ kh.T) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            out[s, :, h] = (torch.softmax(scores, dim=-1) @ vh).to(q.dtype)
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


def acc_slide(accs: Sequence[torch.Tensor], src_starts: Sequence[int], keeps: Sequence[int]) -> None:
    """Move rows ``[src_starts[i], src_starts[i] + keeps[i])`` of ``accs[i]`` to ``[0, keeps[i])``.

    Ranges may overlap; the result is as if the source rows were copied out first.
    """
    for acc, src, keep in zip(accs, src_starts, keeps):
        kept = [acc[src + j].clone() for j in range(keep)]
        for j in range(keep):
            acc[j] = kept[j]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32 -> [R, V] bool: bit ``j`` of word ``w`` allows id ``32 * w + j``."""
    ids = torch.arange(vocab, device=bitmask.device)
    words = bitmask.to(torch.int64)[:, ids // 32]
    return ((words >> (ids % 32)) & 1).to(torch.bool)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """logits [R, V], bitmask [R, ceil(V/32)] int32 or None -> [R] int64.

    The allowed id with the largest logit; ties go to the lowest id (like ``torch.argmax``).
    A row with no allowed id gives -1. NaN logits are not supported.
    """
    num_rows, vocab = logits.shape
    allowed = (
        torch.ones(num_rows, vocab, dtype=torch.bool, device=logits.device)
        if bitmask is None
        else unpack_bitmask(bitmask, vocab)
    )
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    for r in range(num_rows):
        ids = allowed[r].nonzero()[:, 0]
        if ids.numel() == 0:
            out[r] = -1
            continue
        values = logits[r, ids].to(torch.float32)
        best = values.max()
        out[r] = ids[(values == best).nonzero()[0, 0]]
    return out


def sample_uniforms(
    num_rows: int, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """The [R] fp32 uniforms in [0, 1) that every sampler here turns into a token."""
    return torch.rand(num_rows, generator=generator, device=device, dtype=torch.float32)


def pick_by_uniform(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF over ``probs`` [K] (in the given order): first index whose running sum
    exceeds ``u * sum(probs)``; the last nonzero index if rounding leaves none."""
    total = float(probs.sum())
    running = 0.0
    last = 0
    for i in range(probs.shape[0]):
        p = float(probs[i])
        if p <= 0.0:
            continue
        running += p
        last = i
        if u * total < running:
            return i
    return last


def masked_sample(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one allowed token per row; return (tokens [R] int64, q_prob [R] fp32).

    Distribution: softmax(logits / temperature) over allowed ids, restricted to the ``top_k``
    most likely (0 = all), then to the smallest prefix (by probability, descending, ties to
    the lower id) whose mass before each kept token is ``< top_p``, renormalised. ``q_prob``
    is the chosen token's probability under that final distribution. The token is drawn by
    inverse CDF over that same order with one uniform per row from ``sample_uniforms``.
    ``temperature <= 0`` is greedy: masked_argmax with q_prob 1. Rows with no allowed id give
    token -1 and q_prob 0.
    """
    num_rows, vocab = logits.shape
    if temperature <= 0:
        tokens = masked_argmax(logits, bitmask)
        return tokens, (tokens >= 0).to(torch.float32)
    u = sample_uniforms(num_rows, logits.device, generator)
    allowed = (
        torch.ones(num_rows, vocab, dtype=torch.bool, device=logits.device)
        if bitmask is None
        else unpack_bitmask(bitmask, vocab)
    )
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    q_prob = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    for r in range(num_rows):
        ids = allowed[r].nonzero()[:, 0]
        if ids.numel() == 0:
            tokens[r], q_prob[r] = -1, 0.0
            continue
        probs = torch.softmax(logits[r, ids].to(torch.float32) / temperature, dim=0)
        order = torch.sort(probs, descending=True, stable=True).indices
        probs, ids = probs[order], ids[order]
        if 0 < top_k < probs.shape[0]:
            probs, ids = probs[:top_k], ids[:top_k]
            probs = probs / probs.sum()
        if top_p < 1.0:
            keep = (probs.cumsum(0) - probs) < top_p
            probs = torch.where(keep, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        i = pick_by_uniform(probs, float(u[r]))
        tokens[r], q_prob[r] = ids[i], probs[i]
    return tokens, q_prob


def dynamic_conv(
    hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """DFlash2 grouped dynamic causal convolution along the block, zero before its start.

    hidden [n, B, H]; dynamic [n, B, K, H / group_size]; base [K, H] -> [n, B, H]:
    ``out[s, t, h] = sum_{o < K, o <= t} (base[o, h] + dynamic[s, t, o, h // group_size])
    * hidden[s, t - o, h]``.
    """
    n, length, hidden_size = hidden.shape
    taps = base.shape[0]
    x = hidden.to(torch.float32)
    out = torch.zeros(n, length, hidden_size, dtype=torch.float32, device=hidden.device)
    group_of = torch.arange(hidden_size, device=hidden.device) // group_size
    for t in range(length):
        for o in range(min(taps, t + 1)):
            coeff = base[o].to(torch.float32) + dynamic[:, t, o][:, group_of].to(torch.float32)
            out[:, t] += coeff * x[:, t - o]
    return out.to(hidden.dtype)


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
    """DFlash2 candidate-selector walk over P positions, left to right.

    unary [n, P, K] (the top-K logits); candidates [n, P, K] int64 (their ids); hidden_proj
    [n, P, r]; pred_codebook, succ_codebook [V, r]; anchor [n] int64 (first predecessor).
    ``score[k] = unary[k] + sum_r pred[prev, r] * h[r] * succ[cand_k, r]``. Greedy
    (``temperature <= 0``): argmax, ties to the lower candidate index. Sampling: ``q =
    softmax(score / temperature)``, index by inverse CDF in candidate order with
    ``uniforms`` [n, P]. Returns (path [n, P] int64, q [n, P, K] fp32 or None when greedy).
    """
    n, num_pos, k = unary.shape
    path = torch.empty(n, num_pos, dtype=torch.int64, device=unary.device)
    sampling = temperature > 0
    q_all = torch.empty(n, num_pos, k, dtype=torch.float32, device=unary.device) if sampling else None
    for s in range(n):
        prev = int(anchor[s])
        for p in range(num_pos):
            pred = pred_codebook[prev].to(torch.float32) * hidden_proj[s, p].to(torch.float32)
            succ = succ_codebook[candidates[s, p]].to(torch.float32)  # [K, r]
            scores = unary[s, p].to(torch.float32) + succ @ pred
            if q_all is not None and uniforms is not None:
                q = torch.softmax(scores / temperature, dim=0)
                q_all[s, p] = q
                index = pick_by_uniform(q, float(uniforms[s, p]))
            else:
                index = int(torch.argmax(scores))
            prev = int(candidates[s, p, index])
            path[s, p] = prev
    return path, q_all


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
    block table in columns ``table_col .. table_col + width``; embed ``[V, H]`` ->
    ``(ctx lens [m] int32, tables [m, width] int32, embeds [m, B, H] dtype, positions [m, B]
    int64)``: the blocks ``[anchor, mask_id x (B-1)]`` embedded, at positions ``anchor
    position + 0..B-1``.
    """
    lens = meta[:, 0].to(torch.int32)
    tables = meta[:, table_col : table_col + width].to(torch.int32)
    embeds, q_pos = embed_blocks(meta[:, 1], meta[:, 2], embed, mask_id, block, dtype)
    return lens, tables, embeds, q_pos


def embed_blocks(
    anchors: torch.Tensor,
    starts: torch.Tensor,
    embed: torch.Tensor,
    mask_id: int,
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors and their positions ``[n]`` -> the blocks ``[anchor, mask_id x (B-1)]`` embedded
    with ``embed [V, H]`` as ``[n, B, H]`` ``dtype``, and their positions ``[n, B]`` int64."""
    n = anchors.shape[0]
    ids = torch.full((n, block), mask_id, dtype=torch.int64, device=anchors.device)
    ids[:, 0] = anchors
    q_pos = starts[:, None] + torch.arange(block, dtype=torch.int64, device=anchors.device)[None, :]
    return torch.nn.functional.embedding(ids, embed).to(dtype), q_pos
