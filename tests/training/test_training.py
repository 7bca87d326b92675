"""The drafter training recipe on CPU with a tiny random target: the block mask, the loss
weights, labels, determinism, resume, and checkpoints that load in blockdraft and in dflash."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import blockdraft
from blockdraft.pair import DrafterShape
from blockdraft.training.data import sample_windows, step_generator
from blockdraft.training.drafter import new_drafter
from blockdraft.training.loop import DrafterTrainConfig, train_drafter
from blockdraft.training.objective import (
    block_attention_mask,
    block_loss,
    loss_weights,
    sample_anchors,
    target_features,
    token_hardness,
)

from support.tinypair import tiny_target
from support.training_support import assert_matches_reference_and_target
from support.words import word_tokenizer

VOCAB = 64
MASK = VOCAB - 1


def _stream(n: int = 4000, seed: int = 0) -> torch.Tensor:
    # A learnable stream: runs of a rising sequence with random restarts.
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 40, (n // 8,), generator=gen)
    return torch.cat([torch.arange(int(s), int(s) + 8) % (VOCAB - 2) for s in starts])


def _cfg(**kw: Any) -> DrafterTrainConfig:
    base: dict[str, Any] = dict(num_layers=1, block_size=4, mask_token_id=MASK, seq_len=24, num_seqs=2,
                                num_anchors=4, steps=6, warmup_steps=2, lr=3e-3, save_dtype="float32",
                                log_every=1, calibrate_steps=2)
    base.update(kw)
    return DrafterTrainConfig(**base)


@pytest.mark.parametrize(("block", "gamma"), [(8, 4.0), (10, 5.0), (16, 7.0)])
def test_loss_weights_follow_the_published_decay(block: int, gamma: float) -> None:
    w = loss_weights(block)
    assert w.shape == (block - 1,)
    for k in range(1, block):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / gamma), rel_tol=1e-6)
    assert torch.equal(loss_weights(block, 2.0), torch.exp(-torch.arange(block - 1, dtype=torch.float32) / 2.0))


def test_block_mask_sees_strictly_earlier_context_and_only_its_own_block() -> None:
    gen = torch.Generator().manual_seed(3)
    length, b = 20, 4
    anchors = sample_anchors(3, length, 5, b, gen)
    assert anchors.min() >= 1 and anchors.max() <= length - b
    mask = block_attention_mask(anchors, length, b)
    n, a = anchors.shape
    assert mask.shape == (n, a * b, length + a * b)
    for i in range(n):
        for row in range(a * b):
            blk, anchor = row // b, int(anchors[i, row // b])
            for key in range(length):
                assert bool(mask[i, row, key]) == (key < anchor)
            for key in range(a * b):
                assert bool(mask[i, row, length + key]) == (key // b == blk)


def _one_block_loss(drafter: Any, ctx: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                    anchors: torch.Tensor, target: Any, keep: int) -> torch.Tensor:
    """The recipe's loss counting only block ``keep`` of window 0 (other labels ignored)."""
    b = drafter.config.block_size
    only = torch.full_like(labels, -100)
    a = int(anchors[0, keep])
    only[0, a + 1 : a + b] = labels[0, a + 1 : a + b]
    emb = target.get_input_embeddings().weight
    loss, _ = block_loss(drafter, ctx, tokens, only, anchors, emb, target.lm_head.weight, loss_weights(b))
    return loss


def test_each_block_equals_the_inference_forward_and_ignores_the_rest() -> None:
    """Block j of the one-pass training forward = the drafter's inference path given only the
    context before its anchor; later context and other blocks never change it."""
    torch.manual_seed(0)
    target = tiny_target(vocab=VOCAB)
    raw = DrafterShape.for_target(target.config, num_layers=2, block_size=4, mask_token_id=MASK).config_dict()
    drafter = new_drafter(raw, seed=1)
    tokens = _stream()[:16][None]
    anchors = torch.tensor([[2, 6, 11]])
    ctx, labels, _ = target_features(target, tokens, drafter.config.target_layer_ids, "target")
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    b = 4
    w = loss_weights(b)
    for j in range(3):
        a = int(anchors[0, j])
        got = _one_block_loss(drafter, ctx, tokens, labels, anchors, target, j)
        block = torch.tensor([int(tokens[0, a])] + [MASK] * (b - 1))
        hidden = drafter.reference_forward(ctx[0, :a], torch.arange(a), F.embedding(block, emb),
                                           torch.arange(a, a + b))
        logits = drafter.logits(hidden[1:], head)
        ce = F.cross_entropy(logits, labels[0, a + 1 : a + b], reduction="none")
        want = (ce * w).sum() / w.sum()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (j, got, want)

        later = ctx.clone()
        later[0, a:] = torch.randn_like(later[0, a:])
        others = tokens.clone()
        for k in range(3):
            if k != j:
                others[0, int(anchors[0, k])] = (others[0, int(anchors[0, k])] + 7) % (VOCAB - 2)
        assert torch.equal(_one_block_loss(drafter, later, others, labels, anchors, target, j), got)
        earlier = ctx.clone()
        earlier[0, a - 1] += 1.0
        assert not torch.equal(_one_block_loss(drafter, earlier, tokens, labels, anchors, target, j), got)


def test_focused_anchors_go_where_the_target_was_unsure() -> None:
    """focus F draws round(F * A) anchors by hardness, the rest uniformly: distinct, sorted, in
    range, deterministic per generator state; focus 0 is the uniform draw unchanged."""
    n, length, b, a = 4, 40, 4, 8
    hardness = torch.zeros(n, length)
    hard_pos = torch.tensor([3, 9, 17, 22, 30])
    hardness[:, hard_pos] = 1.0
    for focus in (0.5, 1.0):
        anchors = sample_anchors(n, length, a, b, torch.Generator().manual_seed(1), focus=focus, hardness=hardness)
        again = sample_anchors(n, length, a, b, torch.Generator().manual_seed(1), focus=focus, hardness=hardness)
        assert torch.equal(anchors, again)
        assert anchors.shape == (n, a) and anchors.min() >= 1 and anchors.max() <= length - b
        assert bool((anchors[:, 1:] > anchors[:, :-1]).all())
        on_hard = torch.isin(anchors, hard_pos).sum(1)
        # round(F * A) = 4 or 8 draws by weight; the five hard positions hold almost all of it.
        assert bool((on_hard >= min(len(hard_pos), round(focus * a))).all())
    uniform = sample_anchors(n, length, a, b, torch.Generator().manual_seed(1))
    assert torch.equal(uniform, sample_anchors(n, length, a, b, torch.Generator().manual_seed(1), focus=0.0,
                                               hardness=hardness))
    assert float(torch.isin(uniform, hard_pos).float().mean()) < 0.5
    with pytest.raises(ValueError, match="hardness"):
        sample_anchors(n, length, a, b, torch.Generator(), focus=0.5)
    with pytest.raises(ValueError, match="focus"):
        sample_anchors(n, length, a, b, torch.Generator(), focus=1.5, hardness=hardness)


def test_token_hardness_is_one_minus_the_targets_probability_of_the_token() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 10, generator=gen)
    tokens = torch.randint(0, 10, (2, 6), generator=gen)
    hard = token_hardness(logits, tokens)
    assert hard.shape == (2, 6) and bool((hard[:, 0] == 0).all())
    for i in range(2):
        for t in range(1, 6):
            p = torch.softmax(logits[i, t - 1], -1)[tokens[i, t]]
            assert math.isclose(float(hard[i, t]), 1.0 - float(p), rel_tol=1e-5, abs_tol=1e-6)


def test_focused_training_runs_and_differs_from_uniform(tmp_path: Path) -> None:
    target, stream = tiny_target(vocab=VOCAB), _stream()
    train_drafter(target, stream, _cfg(anchor_focus=0.5), tmp_path / "focus", progress=False)
    train_drafter(target, stream, _cfg(), tmp_path / "uniform", progress=False)
    f, u = _weights(tmp_path / "focus"), _weights(tmp_path / "uniform")
    assert any(not torch.equal(f[k], u[k]) for k in f)


def test_labels_are_target_greedy_choices_or_corpus_tokens() -> None:
    target = tiny_target(vocab=VOCAB)
    tokens = _stream()[:12][None]
    ctx, labels, _ = target_features(target, tokens, (0, 2), "target")
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
    assert torch.equal(labels[0, 1:], out.logits[0, :-1].argmax(-1))
    assert int(labels[0, 0]) == -100
    assert torch.equal(ctx, torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1))
    _, corpus, _ = target_features(target, tokens, (0, 2), "corpus")
    assert torch.equal(corpus, tokens)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "drafter" / "model.safetensors"))


def test_same_seed_same_drafter_and_other_seed_differs(tmp_path: Path) -> None:
    target, stream = tiny_target(vocab=VOCAB), _stream()
    runs = [train_drafter(target, stream, _cfg(seed=s), tmp_path / f"r{i}", progress=False)
            for i, s in enumerate((5, 5, 6))]
    a, b, c = (_weights(tmp_path / f"r{i}") for i in range(3))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert runs[0].history == runs[1].history


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    target, stream = tiny_target(vocab=VOCAB), _stream()
    train_drafter(target, stream, _cfg(steps=8), tmp_path / "straight", progress=False)

    def crash(step: int, _stats: Any) -> None:
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, stream, _cfg(steps=8, save_every=4), tmp_path / "broken", progress=False,
                      on_step=crash)
    assert not (tmp_path / "broken" / "drafter").exists()
    res = train_drafter(target, stream, _cfg(steps=8, save_every=4), tmp_path / "broken", resume=True,
                        progress=False)
    assert res.steps == 8
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "broken")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="different settings"):
        train_drafter(target, stream, _cfg(steps=8, lr=1e-2), tmp_path / "broken", resume=True, progress=False)


def test_training_continues_from_a_saved_drafter(tmp_path: Path) -> None:
    """init_from starts from a saved drafter's weights: at learning rate 0 the result is that
    drafter; with learning, it moves on from there (not from a fresh start)."""
    target, stream = tiny_target(vocab=VOCAB), _stream()
    first = train_drafter(target, stream, _cfg(), tmp_path / "first", progress=False)
    saved = str(first.drafter_dir)
    train_drafter(target, stream, _cfg(lr=0.0, init_from=saved), tmp_path / "frozen", progress=False)
    a, b = _weights(tmp_path / "first"), _weights(tmp_path / "frozen")
    assert all(torch.equal(a[k], b[k]) for k in a)
    train_drafter(target, stream, _cfg(seed=1, init_from=saved), tmp_path / "more", progress=False)
    train_drafter(target, stream, _cfg(seed=1), tmp_path / "fresh", progress=False)
    more, fresh = _weights(tmp_path / "more"), _weights(tmp_path / "fresh")
    dist = sum(float((more[k] - a[k]).norm()) for k in a)
    assert dist > 0 and dist < sum(float((fresh[k] - a[k]).norm()) for k in a)
    # No weight depends on the block size: a B = 4 drafter starts a B = 6 one as it is.
    train_drafter(target, stream, _cfg(block_size=6, lr=0.0, init_from=saved), tmp_path / "b6", progress=False)
    b6 = _weights(tmp_path / "b6")
    assert all(torch.equal(a[k], b6[k]) for k in a)
    with pytest.raises(ValueError, match="intermediate_size"):
        train_drafter(target, stream, _cfg(intermediate_size=40, init_from=saved), tmp_path / "mlp40",
                      progress=False)
    with pytest.raises(ValueError, match="needs a DFlash2 drafter"):
        train_drafter(target, stream, _cfg(selector_distill_weight=1.0), tmp_path / "sd", progress=False)
    with pytest.raises(ValueError, match="anchor_focus"):
        train_drafter(target, stream, _cfg(anchor_focus=2.0), tmp_path / "af", progress=False)
    with pytest.raises(ValueError, match="exclude each other"):
        train_drafter(target, stream, _cfg(init_from=saved, init_from_target=True), tmp_path / "x",
                      progress=False)


@pytest.mark.parametrize("dflash2", [None, dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4,
                                                 selector_top_k=4)], ids=["dflash", "dflash2"])
def test_a_grown_drafter_drafts_what_the_saved_one_did_then_learns(tmp_path: Path, dflash2: Any) -> None:
    """init_from a drafter with fewer layers grows it: the extra layers add nothing until they
    learn, so at learning rate 0 every block's loss and drafted tokens equal the saved
    drafter's; trained, the new layers move. A drafter never starts from a deeper one."""
    from blockdraft.checkpoint import load_drafter

    target, stream = tiny_target(vocab=VOCAB), _stream()
    ids = [0, 1]  # fixed: the default target layers depend on the drafter's depth
    saved = train_drafter(target, stream, _cfg(dflash2=dflash2, target_layer_ids=ids), tmp_path / "one",
                          progress=False).drafter_dir
    train_drafter(target, stream, _cfg(num_layers=3, lr=0.0, init_from=str(saved), dflash2=dflash2,
                                       target_layer_ids=ids), tmp_path / "grown", progress=False)
    one = load_drafter(saved, device="cpu", dtype=torch.float32)
    grown = load_drafter(tmp_path / "grown" / "drafter", device="cpu", dtype=torch.float32)
    assert (one.config.num_layers, grown.config.num_layers) == (1, 3)
    gen = torch.Generator().manual_seed(5)
    tokens = sample_windows(stream, 3, 24, gen)
    ctx, labels, _ = target_features(target, tokens, tuple(one.config.target_layer_ids), "target")
    anchors = sample_anchors(3, 24, 4, 4, gen)
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    with torch.no_grad():
        loss_one, picks_one = block_loss(one, ctx, tokens, labels, anchors, embed, head, loss_weights(4))
        loss_grown, picks_grown = block_loss(grown, ctx, tokens, labels, anchors, embed, head, loss_weights(4))
    torch.testing.assert_close(loss_grown, loss_one, rtol=1e-5, atol=1e-6)
    assert torch.equal(picks_grown, picks_one)
    cfg = _cfg(num_layers=3, init_from=str(saved), dflash2=dflash2, target_layer_ids=ids)
    learned = train_drafter(target, stream, cfg, tmp_path / "learned", progress=False).drafter_dir
    w = _weights(learned.parent)
    assert float(w["layers.2.self_attn.o_proj.weight"].abs().sum()) > 0
    with pytest.raises(ValueError, match="num_layers"):
        train_drafter(target, stream, _cfg(init_from=str(learned), dflash2=dflash2, target_layer_ids=ids),
                      tmp_path / "shrunk", progress=False)


def test_training_learns_and_the_checkpoint_loads_in_blockdraft_and_dflash(tmp_path: Path) -> None:
    from dflash.model import DFlashDraftModel

    target, stream = tiny_target(vocab=VOCAB), _stream()
    with torch.no_grad():
        # A random head of std 0.02 gives logits too flat to learn through in a few steps.
        target.lm_head.weight.mul_(30.0)
    # Corpus labels on a rising stream: the continuation is a function of the anchor, learnable fast.
    res = train_drafter(target, stream, _cfg(steps=40, num_seqs=4, num_anchors=6, log_every=10, lr=1e-2,
                                             label_mode="corpus"), tmp_path, progress=False)
    assert res.history[-1]["loss"] < res.history[0]["loss"] - 1.0
    cfg = json.loads((res.drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == MASK

    mine = blockdraft.load_drafter(res.drafter_dir)
    ref = DFlashDraftModel.from_pretrained(str(res.drafter_dir), dtype=torch.float32).eval()
    assert ref.block_size == 4 and ref.mask_token_id == MASK
    assert list(ref.target_layer_ids) == list(mine.config.target_layer_ids)
    # The speculative loop with the trained drafter reproduces the target's greedy output.
    assert_matches_reference_and_target(mine, ref, target, _stream(seed=9)[:10].tolist())


def test_windows_and_anchors_depend_only_on_seed_and_step() -> None:
    stream = _stream()
    a = sample_windows(stream, 3, 16, step_generator(1, 7))
    b = sample_windows(stream, 3, 16, step_generator(1, 7))
    c = sample_windows(stream, 3, 16, step_generator(1, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_cli_train_drafter_adds_a_mask_token_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from blockdraft.cli import main

    tdir = tmp_path / "target"
    tiny_target(vocab=VOCAB).save_pretrained(tdir)
    word_tokenizer(VOCAB, eos=True).save_pretrained(tdir)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(f"w{(s + i) % 60}" for i in range(40))}) + "\n"
                              for s in range(10)))
    out = tmp_path / "run"
    args = ["train-drafter", "--target", str(tdir), "--corpus", str(corpus), "--out", str(out),
            "--block-size", "4", "--seq-len", "16", "--num-seqs", "2", "--num-anchors", "3",
            "--steps", "4", "--save-every", "2", "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    drafter = blockdraft.load_drafter(out / "drafter")
    assert drafter.config.mask_token_id == VOCAB  # a new row after the 64 existing tokens
    grown = json.loads((out / "target" / "config.json").read_text())
    assert grown["vocab_size"] == VOCAB + 1
    # Resuming against the grown target (now with its mask token) continues the saved run.
    resume = [a if a != str(tdir) else str(out / "target") for a in args] + ["--resume"]
    assert main(resume) == 0
    # On the target's own rollouts, continued from the drafter just trained.
    grown_args = [a if a != str(tdir) else str(out / "target") for a in args]
    roll = [*grown_args[: grown_args.index("--out") + 1], str(tmp_path / "roll"),
            *grown_args[grown_args.index("--out") + 2 :], "--rollouts", "6", "--rollout-prompt-tokens", "4",
            "--rollout-tokens", "12", "--init-from", str(out / "drafter"), "--anchor-focus", "0.5"]
    capsys.readouterr()
    assert main(roll) == 0
    assert "rollouts: 6 continuations by the target, 102 tokens" in capsys.readouterr().out
    saved_args = json.loads((tmp_path / "roll" / "training_args.json").read_text())
    assert saved_args["anchor_focus"] == 0.5 and saved_args["selector_distill_weight"] == 0.0
    assert main([*roll, "--rollout-tokens", "0"]) == 2
    assert "--rollout-tokens must be >= 1" in capsys.readouterr().err
