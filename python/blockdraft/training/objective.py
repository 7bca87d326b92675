"""The DFlash drafter training objective: anchors, the block attention mask, the loss.

The target is frozen. Per step, ``n`` token windows of length ``T`` go through the target once;
the hidden states of the ``target_layer_ids`` layers are the drafter's context, and the target's
greedy choices (teacher-forced on the window) are the labels. In every window ``A`` anchor
positions are drawn; each anchor ``a`` makes one block: the clean token at ``a`` followed by
``B - 1`` MASK tokens at positions ``a .. a + B - 1``. All ``A`` blocks of a window go through
the drafter in one pass, with a boolean attention mask in which a block row sees

* the context rows at positions strictly before its anchor (exactly what inference has: the
  anchor is the last verified token, whose hidden state is not yet known), and
* every row of its own block (bidirectional), and no row of any other block.

Block row ``k`` (1..B-1) predicts the token at ``a + k`` through the target's ``lm_head``; the
cross-entropy of row ``k`` is weighted by ``exp(-(k - 1) / gamma)``, since a draft token only
counts when every earlier one was accepted. The target's embeddings and ``lm_head`` are shared
and frozen; only the drafter's layers, ``fc`` and norms learn.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from blockdraft.models import DFlash2Drafter, DFlashDrafter
from blockdraft.training.selector import selector_distill_loss, selector_loss, teacher_predecessors

LabelMode = Literal["target", "corpus"]
# Published decay constants; other block sizes use B / 2.
_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The loss decay gamma for block size B (7 for 16, 5 for 10, 4 for 8, else B / 2)."""
    return _GAMMAS.get(block_size, block_size / 2)


def loss_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """``exp(-(k - 1) / gamma)`` for block rows k = 1..B-1: [B-1] fp32."""
    g = default_gamma(block_size) if gamma is None else gamma
    if g <= 0:
        raise ValueError(f"gamma must be > 0, not {g}")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / g)


def sample_anchors(n: int, length: int, num_anchors: int, block_size: int, gen: torch.Generator, *,
                   focus: float = 0.0, hardness: Tensor | None = None) -> Tensor:
    """Distinct sorted anchor positions in ``[1, length - block_size]`` per window: [n, A] int64.

    Position 0 is never an anchor (a block needs at least one context row before it), and the
    last anchor leaves room for a whole block inside the window.

    With ``focus`` > 0, ``round(focus * A)`` anchors of each window are drawn with probability
    proportional to ``hardness`` [n, length] (CPU, >= 0: how unsure the target was of the token
    at each position, :func:`token_hardness`) and the rest uniformly from the positions left.
    At inference a block starts at the token where the previous block's draft failed, where the
    target is on average less sure of its token than at a uniform position; focused anchors put
    more of the training there (docs/training.md, "Where the steps go").
    """
    span = length - block_size
    if span < 1:
        raise ValueError(f"window length {length} is too short for blocks of {block_size}")
    if not 0.0 <= focus <= 1.0:
        raise ValueError(f"focus must be in [0, 1], not {focus}")
    a = min(num_anchors, span)
    if focus == 0.0:
        rows = [torch.randperm(span, generator=gen)[:a].sort().values + 1 for _ in range(n)]
        return torch.stack(rows)
    if hardness is None or hardness.shape != (n, length):
        raise ValueError(f"focus > 0 needs hardness of shape {(n, length)}")
    hard = round(focus * a)
    rows = []
    for i in range(n):
        # A small floor keeps every position drawable (multinomial needs enough nonzero weights).
        w = hardness[i, 1 : span + 1].float().clamp_min(0) + 1e-4
        picked = torch.multinomial(w, hard, replacement=False, generator=gen) if hard else w.new_zeros(0).long()
        free = torch.ones(span, dtype=torch.bool)
        free[picked] = False
        others = free.nonzero().flatten()
        rest = others[torch.randperm(others.numel(), generator=gen)[: a - hard]]
        rows.append(torch.cat((picked, rest)).sort().values + 1)
    return torch.stack(rows)


def token_hardness(logits: Tensor, tokens: Tensor) -> Tensor:
    """``1 - p(token)`` at every position of ``tokens`` [n, T] under the target's distribution
    after the prefix before it (``logits`` [n, T, V], the target's over the same windows);
    position 0 has no prefix and gets 0. Returns [n, T] fp32 on ``tokens``' device."""
    probs = torch.softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    out[:, 1:] = 1.0 - probs
    return out


def block_attention_mask(anchors: Tensor, length: int, block_size: int) -> Tensor:
    """Which keys each block row may see: [n, A*B, T + A*B] bool.

    Keys are the ``T`` context rows (positions 0..T-1) followed by the ``A*B`` block rows; row
    ``i`` of block ``j`` sees context positions ``< anchors[:, j]`` and the rows of block ``j``.
    """
    n, a = anchors.shape
    device = anchors.device
    row_anchor = anchors.repeat_interleave(block_size, dim=1)
    ctx_visible = torch.arange(length, device=device)[None, None, :] < row_anchor[:, :, None]
    block_of = torch.arange(a, device=device).repeat_interleave(block_size)
    own_block = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)
    return torch.cat((ctx_visible, own_block), dim=2)



def block_loss(
    drafter: DFlashDrafter,
    ctx_rows: Tensor,
    tokens: Tensor,
    labels: Tensor,
    anchors: Tensor,
    embed_weight: Tensor,
    head_weight: Tensor,
    weights: Tensor,
    *,
    soft_logits: Tensor | None = None,
    distill_weight: float = 0.0,
    selector_weight: float = 1.0,
    selector_distill_weight: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The recipe's loss for ``n`` windows.

    Args:
        ctx_rows: [n, T, k*H] target hidden states of the chosen layers.
        tokens: [n, T] the window's tokens (anchors take theirs from here).
        labels: [n, T] the token each position should hold (``-100`` where unknown).
        anchors: [n, A] from :func:`sample_anchors`.
        embed_weight: [V_in, H] the target's input embeddings (frozen).
        head_weight: [V, H] the target's ``lm_head`` (frozen).
        weights: [B-1] per-row loss weights.
        soft_logits: [n, T, V] the target's logits for each position (its distribution after
            the prefix before it); needed when ``distill_weight`` > 0.
        distill_weight: weight of the distillation term, the cross-entropy of the drafter's
            distribution against the target's softmax at T = 1 (what sampled drafts need).
        selector_weight: DFlash2 only: weight of :func:`~blockdraft.training.selector.selector_loss`.
        selector_distill_weight: DFlash2 only: weight of
            :func:`~blockdraft.training.selector.selector_distill_loss` (what sampled DFlash2
            drafts need); needs ``soft_logits``.
    Returns:
        (scalar loss, [n, A, B-1] bool: the drafted token of row k equals its label; for
        DFlash2, the selector's pick given correct earlier rows).
    """
    c = drafter.config
    if c.mask_token_id is None:
        raise ValueError("the drafter config has no mask_token_id")
    n, length = tokens.shape
    a = anchors.shape[1]
    b = c.block_size
    dev = tokens.device
    offsets = torch.arange(b, device=dev)
    positions = anchors[:, :, None] + offsets  # [n, A, B]
    block_ids = torch.full((n, a, b), c.mask_token_id, dtype=torch.int64, device=dev)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    embeds = F.embedding(block_ids.reshape(n, a * b), embed_weight)

    fused = drafter.fuse_context(ctx_rows)  # [n, T, H]
    ctx_pos = torch.arange(length, device=dev).repeat(n)
    ctx_kv = drafter.context_kv(fused.reshape(n * length, -1), ctx_pos)
    visible = block_attention_mask(anchors, length, b)[:, None]  # [n, 1, R, T+R]
    group = c.num_heads // c.num_kv_heads
    scale = c.head_dim**-0.5

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ck, cv = ctx_kv[layer]
        keys = torch.cat((ck.reshape(n, length, c.num_kv_heads, c.head_dim).to(k.dtype), k), dim=1)
        values = torch.cat((cv.reshape(n, length, c.num_kv_heads, c.head_dim).to(v.dtype), v), dim=1)
        # Norm weights promote q/k to fp32 under autocast; attend in one (the autocast) dtype.
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
        qh = q.transpose(1, 2).to(dt)
        kh = keys.transpose(1, 2).repeat_interleave(group, dim=1).to(dt)
        vh = values.transpose(1, 2).repeat_interleave(group, dim=1).to(dt)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale)
        return out.transpose(1, 2)

    hidden = drafter.forward_block(embeds, positions.reshape(n, a * b), attend, segment=b)
    hidden = hidden.reshape(n, a, b, -1)[:, :, 1:]
    logits = drafter.logits(hidden, head_weight).float()  # [n, A, B-1, V]
    row_pos = positions[:, :, 1:].reshape(n, -1)
    target = labels.gather(1, row_pos).reshape(n, a, b - 1)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat_logits, target.reshape(-1), reduction="none", ignore_index=-100)
    valid = (target != -100).float()
    w = weights.to(dev)
    loss = (ce.reshape(n, a, b - 1) * w * valid).sum() / (w * valid).sum().clamp_min(1e-6)
    sel_distill = selector_distill_weight if isinstance(drafter, DFlash2Drafter) else 0.0
    probs: Tensor | None = None
    if distill_weight > 0 or sel_distill > 0:
        if soft_logits is None:
            raise ValueError("distillation needs the target's logits (soft_logits)")
        # The target's distribution for position p is its softmax after the prefix before p.
        rows = soft_logits.gather(1, (row_pos - 1)[:, :, None].expand(-1, -1, soft_logits.shape[-1]))
        probs = torch.softmax(rows.float(), dim=-1).reshape(-1, soft_logits.shape[-1])
        if distill_weight > 0:
            soft = F.cross_entropy(flat_logits, probs, reduction="none").reshape(n, a, b - 1)
            loss = loss + distill_weight * (soft * w).sum() / (w.sum() * n * a)
    if isinstance(drafter, DFlash2Drafter):
        rows_hidden = hidden.reshape(n * a, b - 1, -1)
        rows_logits = logits.reshape(n * a, b - 1, -1)
        prev = teacher_predecessors(block_ids[:, :, :1], target)
        sel, picks = selector_loss(drafter.candidate_selector, rows_hidden, rows_logits,
                                   prev.reshape(n * a, b - 1), target.reshape(n * a, b - 1), w)
        loss = loss + selector_weight * sel
        if probs is not None and sel_distill > 0:
            text_prev = tokens.gather(1, positions[:, :, :-1].reshape(n, -1)).reshape(n * a, b - 1)
            loss = loss + sel_distill * selector_distill_loss(
                drafter.candidate_selector, rows_hidden, rows_logits, text_prev,
                probs.reshape(n * a, b - 1, -1), w)
        drafted = picks.reshape(n, a, b - 1)
    else:
        drafted = logits.argmax(-1)
    correct = (drafted == target) & (target != -100)
    return loss, correct


def target_features(
    target: Any, tokens: Tensor, layer_ids: tuple[int, ...], label_mode: LabelMode, *, keep_logits: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One frozen target pass: (ctx rows [n, T, k*H], labels [n, T], logits [n, T, V] or None).

    Layer id ``i`` is ``hidden_states[i + 1]``. With ``label_mode="target"`` the label of
    position ``p`` is the target's greedy choice after ``tokens[:, :p]``; with ``"corpus"`` it is
    ``tokens[:, p]``. Position 0 has no label from the target (``-100``). The logits come back
    only with ``keep_logits`` (the distillation term needs them).
    """
    with torch.no_grad():
        out = target(
            input_ids=tokens,
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=0 if label_mode == "target" or keep_logits else 1,
        )
        hs = out.hidden_states
        ctx = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        logits = out.logits if keep_logits else None
        if label_mode == "corpus":
            return ctx, tokens.clone(), logits
        labels = torch.full_like(tokens, -100)
        labels[:, 1:] = out.logits[:, :-1].argmax(-1)
        return ctx, labels, logits

