"""The DFlash2 candidate selector's training objective.

At inference the selector walks a block's rows left to right. Row ``k`` takes the top-K
lm_head candidates of the drafter's logits and picks

    argmax_c  logit(c) + sum_r Pred[prev, r] * h_r * Succ[c, r]

with ``h = hidden_projection(row)`` and ``prev`` the token picked for row ``k - 1`` (the anchor
for the first row). A pick only matters while every earlier pick was accepted, that is while
``prev`` equals the target's choice; so training teacher-forces ``prev`` with the label of the
previous position (the anchor for the first row), which makes the selector's training-time
choices exactly its inference-time choices on every accepted prefix.

The objective is a cross-entropy over the K candidates with the label's candidate as the
class, on rows whose label is among the candidates (a row whose label is not among them cannot
be drafted right by any selector; the token loss on the full logits handles it), weighted per
row like the token loss. The unary term is the drafter's own logit of each candidate and keeps
its gradient, so the selector loss also sharpens the drafter between close candidates; the
candidate set itself (top-K) is a non-differentiable choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from blockdraft.models import DFlash2Drafter
from blockdraft.models.layers import CandidateSelector


def teacher_predecessors(anchor_tokens: Tensor, labels: Tensor) -> Tensor:
    """The predecessor of every block row under teacher forcing.

    Args:
        anchor_tokens: [..., 1] the anchor token of each block.
        labels: [..., B-1] the labels of block rows 1..B-1 (``-100`` where unknown).
    Returns:
        [..., B-1] int64: the anchor for row 1, the label of row ``k - 1`` for row ``k``;
        unknown labels become token 0 (their rows carry no loss).
    """
    prev = torch.cat((anchor_tokens, labels[..., :-1]), dim=-1)
    return prev.clamp_min(0)


def selector_scores(
    selector: CandidateSelector, hidden: Tensor, logits: Tensor, prev: Tensor
) -> tuple[Tensor, Tensor]:
    """Scores of the top-K candidates of every row given its predecessor.

    Args:
        hidden: [..., T, H] drafter output rows.
        logits: [..., T, V] their logits.
        prev: [..., T] the predecessor token of each row.
    Returns:
        ``(scores [..., T, K], candidates [..., T, K])``.
    """
    candidates = torch.topk(logits.detach(), selector.top_k, dim=-1, sorted=False).indices
    unary = logits.gather(-1, candidates)
    pair = selector.pair_scores(selector.hidden_projection(hidden), prev, candidates)
    return unary + pair.to(unary.dtype), candidates


def selector_loss(
    selector: CandidateSelector,
    hidden: Tensor,
    logits: Tensor,
    prev: Tensor,
    labels: Tensor,
    weights: Tensor,
) -> tuple[Tensor, Tensor]:
    """The selector objective (module docstring) and the selector's teacher-forced picks.

    Args:
        hidden: [N, B-1, H]; logits: [N, B-1, V] fp32; prev: [N, B-1] from
            :func:`teacher_predecessors`; labels: [N, B-1] (``-100`` unknown); weights: [B-1].
    Returns:
        ``(scalar loss, picks [N, B-1])``; ``picks[i, k]`` is the token the selector drafts for
        row ``k`` when rows ``< k`` were drafted right.
    """
    scores, candidates = selector_scores(selector, hidden, logits, prev)
    hit = candidates == labels[..., None]
    usable = hit.any(-1) & (labels != -100)
    cls = hit.to(torch.int64).argmax(-1)
    ce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]).float(), cls.reshape(-1), reduction="none")
    w = weights.to(ce.device)[None, :] * usable.to(ce.dtype)
    loss = (ce.reshape(usable.shape) * w).sum() / w.sum().clamp_min(1e-6)
    picks = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    return loss, picks


def selector_distill_loss(
    selector: CandidateSelector,
    hidden: Tensor,
    logits: Tensor,
    prev: Tensor,
    target_probs: Tensor,
    weights: Tensor,
) -> Tensor:
    """The selector's distribution at T = 1 against the target's, over the K candidates.

    Drafts sampled from the selector's ``q = softmax(score)`` (zero outside the candidates) are
    accepted with probability ``sum_c min(p(c), q(c))``. Over ``q`` on the candidates, the
    largest value is the target's mass on them, reached by ``q = p`` restricted to the
    candidates and renormalised. So this is the cross-entropy of ``q`` against that
    distribution, per row, weighted like the token loss.

    Args:
        hidden: [N, B-1, H]; logits: [N, B-1, V] fp32.
        prev: [N, B-1] the token before each row in the training text: the anchor, then the
            window's own tokens. Sampled text is not the target's argmax, so the predecessors
            are the tokens the target's distributions were computed after.
        target_probs: [N, B-1, V] the target's softmax for each row's position.
        weights: [B-1].
    """
    scores, candidates = selector_scores(selector, hidden, logits, prev)
    p = target_probs.gather(-1, candidates).float()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    ce = -(p * F.log_softmax(scores.float(), dim=-1)).sum(-1)  # [N, B-1]
    w = weights.to(ce.device)[None, :].expand_as(ce)
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def init_dflash2_extras(drafter: DFlash2Drafter, seed: int) -> None:
    """Start a fresh DFlash2 drafter as its DFlash part.

    Each convolution passes its input through unchanged (static tap 0 is one, every other tap
    and the dynamic taps' projection zero), and the selector adds nothing to the unary logits
    (successor codebook zero). The predecessor codebook is random, so the successor codebook
    gets a gradient from the first step.
    """
    gen = torch.Generator().manual_seed(seed + 7919)
    convs = [conv for i in range(drafter.config.num_layers)
             for conv in (drafter.layer(i).attention_conv, drafter.layer(i).mlp_conv) if conv is not None]
    selector = drafter.candidate_selector
    with torch.no_grad():
        for conv in convs:
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0, :] = 1.0
            conv.kernel_projection.weight.zero_()
        selector.successor_codebook.zero_()
        pred = selector.predecessor_codebook
        pred.copy_(torch.randn(pred.shape, generator=gen).to(pred.dtype))


__all__ = ["init_dflash2_extras", "selector_distill_loss", "selector_loss", "selector_scores",
           "teacher_predecessors"]
