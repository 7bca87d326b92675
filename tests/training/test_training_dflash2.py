"""DFlash2 training and the distillation term on CPU with a tiny random target: the training
forward equals the inference forward block by block (convolutions stay inside each block), the
selector's teacher-forced picks are its inference picks, the loss falls, and the checkpoint
loads in blockdraft and in the public dflash classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import blockdraft
from blockdraft.models import DFlash2Drafter
from blockdraft.models.layers import grouped_dynamic_conv
from blockdraft.pair import DrafterShape
from blockdraft.training.drafter import new_drafter
from blockdraft.training.loop import DrafterTrainConfig, train_drafter
from blockdraft.training.objective import block_loss, loss_weights, target_features
from blockdraft.training.selector import (
    selector_distill_loss,
    selector_loss,
    selector_scores,
    teacher_predecessors,
)

from support.tinypair import tiny_target
from support.training_support import assert_matches_reference_and_target

VOCAB = 64
MASK = VOCAB - 1
SIZES = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


def _stream(n: int = 4000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 40, (n // 8,), generator=gen)
    return torch.cat([torch.arange(int(s), int(s) + 8) % (VOCAB - 2) for s in starts])


def _random_dflash2(target: Any, block: int = 4, seed: int = 1) -> DFlash2Drafter:
    """A DFlash2 drafter whose convolutions and selector all act (not the identity start)."""
    shape = DrafterShape.for_target(target.config, num_layers=2, block_size=block, mask_token_id=MASK, dflash2=SIZES)
    raw = shape.config_dict()
    drafter = new_drafter(raw, seed=seed)
    assert isinstance(drafter, DFlash2Drafter)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "codebook" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return drafter


def test_segmented_convolution_equals_one_block_at_a_time() -> None:
    gen = torch.Generator().manual_seed(0)
    n, blocks, b, h, k, g = 2, 3, 4, 32, 3, 8
    hidden = torch.randn(n, blocks * b, h, generator=gen)
    dynamic = torch.randn(n, blocks * b, k, h // g, generator=gen)
    base = torch.randn(k, h, generator=gen)
    got = grouped_dynamic_conv(hidden, dynamic, base, g, segment=b)
    for j in range(blocks):
        rows = slice(j * b, (j + 1) * b)
        want = grouped_dynamic_conv(hidden[:, rows], dynamic[:, rows], base, g)
        assert torch.allclose(got[:, rows], want, atol=1e-6)
    # Without the segment the taps run across block boundaries and the result differs.
    assert not torch.allclose(grouped_dynamic_conv(hidden, dynamic, base, g), got)
    with pytest.raises(ValueError, match="do not split"):
        grouped_dynamic_conv(hidden, dynamic, base, g, segment=5)


def test_fresh_dflash2_drafter_starts_as_its_dflash_part() -> None:
    """Identity convolutions and a selector that adds nothing: picks are the argmax."""
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    shape = DrafterShape.for_target(target.config, num_layers=2, block_size=4, mask_token_id=MASK, dflash2=SIZES)
    raw = shape.config_dict()
    drafter = new_drafter(raw, seed=3)
    plain_raw = DrafterShape.for_target(target.config, num_layers=2, block_size=4, mask_token_id=MASK).config_dict()
    plain = new_drafter(plain_raw, seed=3)
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k in plain.state_dict()})
    ctx = torch.randn(7, drafter.config.num_context_layers * drafter.config.hidden_size)
    emb = torch.randn(4, drafter.config.hidden_size)
    with torch.no_grad():
        a = drafter.reference_forward(ctx, torch.arange(7), emb, torch.arange(7, 11))
        b = plain.reference_forward(ctx, torch.arange(7), emb, torch.arange(7, 11))
        assert torch.allclose(a, b, atol=1e-6)
        head = target.lm_head.weight
        draft = drafter.draft(a[None, 1:], torch.tensor([5]), head)
        assert torch.equal(draft.tokens, drafter.logits(a[None, 1:], head).argmax(-1))


def test_dflash2_training_forward_equals_inference_and_picks_are_the_selector_walk() -> None:
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    drafter = _random_dflash2(target)
    b = 4
    tokens = _stream()[:18][None]
    anchors = torch.tensor([[2, 7, 12]])
    ctx, labels, _ = target_features(target, tokens, drafter.config.target_layer_ids, "target")
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    w = loss_weights(b)
    for j in range(anchors.shape[1]):
        a = int(anchors[0, j])
        block = torch.tensor([int(tokens[0, a])] + [MASK] * (b - 1))
        with torch.no_grad():
            hidden = drafter.reference_forward(ctx[0, :a], torch.arange(a), F.embedding(block, emb),
                                               torch.arange(a, a + b))
            draft = drafter.draft(hidden[None, 1:], block[:1], head)
            logits = drafter.logits(hidden[None, 1:], head).float()
        # Teacher-forced with the inference walk's own tokens, the selector picks the same tokens.
        walked = draft.tokens[0]
        prev = teacher_predecessors(block[None, :1], walked[None])
        _, picks = selector_loss(drafter.candidate_selector, hidden[None, 1:], logits, prev, walked[None], w)
        assert torch.equal(picks[0], walked)

        # The one-pass training loss of block j alone equals the loss from the inference forward.
        only = torch.full_like(labels, -100)
        only[0, a + 1 : a + b] = labels[0, a + 1 : a + b]
        got, correct = block_loss(drafter, ctx, tokens, only, anchors, emb, head, w)
        rows = labels[0, a + 1 : a + b]
        token_ce = (F.cross_entropy(logits[0], rows, reduction="none") * w).sum() / w.sum()
        sel, want_picks = selector_loss(drafter.candidate_selector, hidden[None, 1:], logits,
                                        teacher_predecessors(block[None, :1], rows[None]), rows[None], w)
        assert torch.allclose(got, token_ce + sel, rtol=1e-5, atol=1e-5), (j, got, token_ce + sel)
        assert torch.equal(correct[0, j], want_picks[0] == rows)


def test_selector_loss_ignores_rows_whose_label_is_not_a_candidate() -> None:
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    sel = _random_dflash2(target).candidate_selector
    hidden = torch.randn(2, 3, 32)
    logits = torch.randn(2, 3, VOCAB)
    top = torch.topk(logits, sel.top_k, dim=-1).indices
    outside = torch.topk(logits, VOCAB, dim=-1).indices[..., -1]
    labels = top[..., 0].clone()
    prev = teacher_predecessors(torch.zeros(2, 1, dtype=torch.int64), labels)
    w = torch.ones(3)
    base, _ = selector_loss(sel, hidden, logits, prev, labels, w)
    # Row (0, 2) now has a label outside the candidates and unknown at (1, 1): both drop out.
    changed = labels.clone()
    changed[0, 2] = outside[0, 2]
    changed[1, 1] = -100
    masked, _ = selector_loss(sel, hidden, logits, prev, changed, w)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 2] = keep[1, 1] = False
    kept, _ = selector_loss(sel, hidden[:, :], logits, prev, torch.where(keep, labels, -100), w)
    assert torch.allclose(masked, kept) and not torch.allclose(masked, base)


def test_distillation_term_is_the_cross_entropy_against_the_target_softmax() -> None:
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    raw = DrafterShape.for_target(target.config, num_layers=1, block_size=4, mask_token_id=MASK).config_dict()
    drafter = new_drafter(raw, seed=2)
    tokens = _stream()[:16][None]
    anchors = torch.tensor([[3, 9]])
    ctx, labels, soft = target_features(target, tokens, drafter.config.target_layer_ids, "target",
                                         keep_logits=True)
    assert soft is not None
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    w = loss_weights(4)
    hard, _ = block_loss(drafter, ctx, tokens, labels, anchors, emb, head, w)
    both, _ = block_loss(drafter, ctx, tokens, labels, anchors, emb, head, w, soft_logits=soft, distill_weight=0.5)
    terms = []
    for a in anchors[0].tolist():
        block = torch.tensor([int(tokens[0, a])] + [MASK] * 3)
        with torch.no_grad():
            hidden = drafter.reference_forward(ctx[0, :a], torch.arange(a), F.embedding(block, emb),
                                               torch.arange(a, a + 4))
        logp = torch.log_softmax(drafter.logits(hidden[1:], head).float(), -1)
        p = torch.softmax(soft[0, a : a + 3].float(), -1)  # the target after positions a .. a+2
        terms.append((-(p * logp).sum(-1) * w).sum() / w.sum())
    assert torch.allclose(both - hard, 0.5 * torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="soft_logits"):
        block_loss(drafter, ctx, tokens, labels, anchors, emb, head, w, distill_weight=0.5)


def test_selector_distillation_is_over_the_inference_q_with_the_texts_predecessors() -> None:
    """The selector's training distribution on given predecessors is the q its sampled walk
    draws from; the term block_loss adds is the cross-entropy of that q (predecessors: the
    window's own tokens) against the target's softmax restricted to the candidates."""
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    drafter = _random_dflash2(target)
    sel = drafter.candidate_selector
    b = 4
    tokens = _stream(seed=3)[:18][None]
    anchors = torch.tensor([[2, 7, 12]])
    ctx, labels, soft = target_features(target, tokens, drafter.config.target_layer_ids, "target", keep_logits=True)
    assert soft is not None
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    w = loss_weights(b)
    terms = []
    for a in anchors[0].tolist():
        block = torch.tensor([int(tokens[0, a])] + [MASK] * (b - 1))
        with torch.no_grad():
            hidden = drafter.reference_forward(ctx[0, :a], torch.arange(a), F.embedding(block, emb),
                                               torch.arange(a, a + b))
            logits = drafter.logits(hidden[None, 1:], head).float()
            draft = drafter.draft(hidden[None, 1:], block[:1], head, temperature=1.0,
                                  generator=torch.Generator().manual_seed(a))
        assert draft.q is not None
        walked = teacher_predecessors(block[None, :1], draft.tokens)
        scores, candidates = selector_scores(sel, hidden[None, 1:], logits, walked)
        assert torch.equal(candidates.sort(-1).values, draft.candidates.sort(-1).values)
        # Same candidates in the same order (one topk), so q lines up entry by entry.
        torch.testing.assert_close(torch.softmax(scores, -1), draft.q, rtol=1e-5, atol=1e-6)
        text_prev = tokens[:, a : a + b - 1]
        scores, candidates = selector_scores(sel, hidden[None, 1:], logits, text_prev)
        p = torch.softmax(soft[0, a : a + b - 1].float(), -1).gather(-1, candidates[0])
        p = p / p.sum(-1, keepdim=True)
        ce = -(p * torch.log_softmax(scores[0], -1)).sum(-1)
        terms.append((ce * w).sum() / w.sum())
    base, _ = block_loss(drafter, ctx, tokens, labels, anchors, emb, head, w)
    with_term, _ = block_loss(drafter, ctx, tokens, labels, anchors, emb, head, w, soft_logits=soft,
                              selector_distill_weight=0.7)
    torch.testing.assert_close(with_term - base, 0.7 * torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="soft_logits"):
        block_loss(drafter, ctx, tokens, labels, anchors, emb, head, w, selector_distill_weight=0.7)


def test_selector_distillation_is_least_where_q_is_the_targets_share_of_the_candidates() -> None:
    """Over q on the candidates, acceptance sum(min(p, q)) peaks at p restricted and
    renormalised; the loss is then that distribution's entropy, and another q scores higher."""
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    sel = _random_dflash2(target).candidate_selector
    hidden, logits = torch.randn(2, 3, 32), torch.randn(2, 3, VOCAB)
    prev = torch.randint(0, VOCAB, (2, 3))
    scores, candidates = selector_scores(sel, hidden, logits, prev)
    q = torch.softmax(scores.detach(), -1)
    # A target distribution whose share of the candidates is exactly q (40 % of its mass).
    probs = torch.full((2, 3, VOCAB), 0.6 / (VOCAB - sel.top_k))
    probs.scatter_(-1, candidates, 0.4 * q)
    w = torch.tensor([1.0, 0.5, 0.25])
    at_q = selector_distill_loss(sel, hidden, logits, prev, probs, w)
    entropy = -(q * q.log()).sum(-1)
    w_rows = w[None].expand(2, -1)
    torch.testing.assert_close(at_q, (entropy * w_rows).sum() / w_rows.sum(), rtol=1e-5, atol=1e-6)
    # Another q on the same candidates (other rows, same logits) is further from the target.
    moved = selector_distill_loss(sel, hidden + torch.randn(2, 3, 32), logits, prev, probs, w)
    assert float(moved.detach()) > float(at_q.detach()) + 1e-3


def _sampled_acceptance(drafter: DFlash2Drafter, target: Any) -> torch.Tensor:
    """Per block row, the mean acceptance probability sum_c min(p(c), q(c)) of T = 1 drafts
    sampled from the selector, given the earlier rows right, over fresh windows."""
    from blockdraft.training.data import sample_windows

    tokens = sample_windows(_stream(seed=5), 8, 24, torch.Generator().manual_seed(99))
    ctx, _, soft = target_features(target, tokens, drafter.config.target_layer_ids, "target", keep_logits=True)
    assert soft is not None
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    b = drafter.config.block_size
    rows = []
    for i in range(tokens.shape[0]):
        for a in range(2, tokens.shape[1] - b):
            block = torch.tensor([int(tokens[i, a])] + [MASK] * (b - 1))
            with torch.no_grad():
                hidden = drafter.reference_forward(ctx[i, :a], torch.arange(a), F.embedding(block, emb),
                                                   torch.arange(a, a + b))
                logits = drafter.logits(hidden[None, 1:], head).float()
                scores, cand = selector_scores(drafter.candidate_selector, hidden[None, 1:], logits,
                                               tokens[i : i + 1, a : a + b - 1])
            p = torch.softmax(soft[i, a : a + b - 1].float(), -1).gather(-1, cand[0])
            rows.append(torch.minimum(p, torch.softmax(scores[0], -1)).sum(-1))
    return torch.stack(rows).mean(0)


def test_selector_distillation_raises_the_acceptance_of_sampled_drafts(tmp_path: Path) -> None:
    """Same data, steps and seed: with the selector's distillation, T = 1 drafts sampled from the
    selector are accepted more often at every block row."""
    target, stream = tiny_target(vocab=VOCAB), _stream()
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    got = {}
    for weight in (0.0, 1.0):
        cfg = DrafterTrainConfig(num_layers=1, block_size=4, mask_token_id=MASK, seq_len=24, num_seqs=4,
                                 num_anchors=6, steps=150, warmup_steps=2, lr=1e-2, save_dtype="float32",
                                 log_every=50, dflash2=SIZES, selector_distill_weight=weight)
        res = train_drafter(target, stream, cfg, tmp_path / str(weight), progress=False)
        drafter = blockdraft.load_drafter(res.drafter_dir)
        assert isinstance(drafter, DFlash2Drafter)
        got[weight] = _sampled_acceptance(drafter, target)
    assert bool((got[1.0] > got[0.0] + 0.005).all()), got


def test_dflash2_training_learns_and_loads_in_blockdraft_and_dflash(tmp_path: Path) -> None:
    from dflash.model import DFlash2DraftModel

    target, stream = tiny_target(vocab=VOCAB), _stream()
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
    cfg = DrafterTrainConfig(num_layers=1, block_size=4, mask_token_id=MASK, seq_len=24, num_seqs=4,
                             num_anchors=6, steps=40, warmup_steps=2, lr=1e-2, save_dtype="float32",
                             log_every=10, label_mode="corpus", dflash2=SIZES, distill_weight=0.2)
    res = train_drafter(target, stream, cfg, tmp_path, progress=False)
    assert res.history[-1]["loss"] < res.history[0]["loss"] - 1.0
    raw = json.loads((res.drafter_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in SIZES} == SIZES

    mine = blockdraft.load_drafter(res.drafter_dir)
    assert isinstance(mine, DFlash2Drafter)
    trained = mine.state_dict()
    assert trained["candidate_selector.successor_codebook"].abs().sum() > 0  # the selector learned
    ref = DFlash2DraftModel.from_pretrained(str(res.drafter_dir), dtype=torch.float32).eval()
    # The speculative loop with the trained drafter reproduces the target's greedy output.
    assert_matches_reference_and_target(mine, ref, target, _stream(seed=9)[:10].tolist())
