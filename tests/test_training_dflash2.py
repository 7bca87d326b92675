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
from tinypair import tiny_target
from training_support import assert_matches_reference_and_target

import blockdraft
from blockdraft.models import DFlash2Drafter
from blockdraft.models.layers import grouped_dynamic_conv
from blockdraft.training.recipe import (
    DrafterTrainConfig,
    block_loss,
    drafter_config_dict,
    loss_weights,
    new_drafter,
    target_features,
    train_drafter,
)
from blockdraft.training.selector import selector_loss, teacher_predecessors

VOCAB = 64
MASK = VOCAB - 1
SIZES = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


def _stream(n: int = 4000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 40, (n // 8,), generator=gen)
    return torch.cat([torch.arange(int(s), int(s) + 8) % (VOCAB - 2) for s in starts])


def _random_dflash2(target: Any, block: int = 4, seed: int = 1) -> DFlash2Drafter:
    """A DFlash2 drafter whose convolutions and selector all act (not the identity start)."""
    raw = drafter_config_dict(target.config, num_layers=2, block_size=block, mask_token_id=MASK, dflash2=SIZES)
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
    raw = drafter_config_dict(target.config, num_layers=2, block_size=4, mask_token_id=MASK, dflash2=SIZES)
    drafter = new_drafter(raw, seed=3)
    plain_raw = drafter_config_dict(target.config, num_layers=2, block_size=4, mask_token_id=MASK)
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
    raw = drafter_config_dict(target.config, num_layers=1, block_size=4, mask_token_id=MASK)
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
