"""Where the speculative steps go: a drafter's acceptance at every position against the walk.

For each prompt the target writes its greedy continuation (the text greedy speculative decoding
outputs). One teacher-forced pass of the drafter (``block_loss``, the training forward) then
gives, at every position of the continuation, how many drafts the target would accept if a
block started there. Two summaries of the same numbers:

- **uniform-anchor tau**: 1 + the mean over every position: what the training progress bar
  estimates (its anchors are uniform);
- **walk tau**: start at the first generated token, accept the leading correct drafts, start the
  next block at the token after them, and so on: the steps greedy speculative decoding takes.
  It equals the engine's greedy tau except at each prompt's last step, where the engine drafts
  a shorter block, and it ignores stop tokens.

Also: row-1 accuracy and the target's unsureness of the anchor token (``token_hardness``: 1 - its
probability) at the walk's anchors and at all positions, and how many tokens each walk step
produced. CPU, fp32.

    python benchmarks/builtin/acceptance_walk.py [--pair DIR] [--drafters b16,b8] [--new-tokens 128]
        [--corpus-site SITE]   # also 16 prompts from files of the training split
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from pathlib import Path
from typing import Any

import torch

from blockdraft.checkpoint import load_drafter
from blockdraft.training.builtin.target import load_target
from blockdraft.training.data import collect_python_sources, split_heldout
from blockdraft.training.evaluate import heldout_prompts
from blockdraft.training.objective import block_loss, loss_weights, target_features, token_hardness
from blockdraft.training.rollouts import rollout

PRETRAINED = Path(__file__).resolve().parents[2] / "python" / "blockdraft" / "pretrained"


def training_prompts(site: Path, tokenizer: Any, count: int, length: int, every: int) -> list[list[int]]:
    """Prompts as the held-out ones are made (``heldout_prompts``), from files of ``site`` in the
    build's training split (``split_heldout(files, every)``), in a fixed shuffled order."""
    files = collect_python_sources([site], max_chars=10**9)
    train, _ = split_heldout(files, every)
    random.Random(0).shuffle(train)
    return heldout_prompts([f.text for f in train], tokenizer, count, length)


@torch.no_grad()
def walk(target: Any, drafter: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The summaries in the module docstring for one drafter over ``prompts`` (one length)."""
    c = drafter.config
    b = c.block_size
    prompt = torch.tensor(prompts)
    p_len = prompt.shape[1]
    seq = torch.cat((prompt, rollout(target, prompt, new_tokens + b - 1)), dim=1)
    ctx, labels, logits = target_features(target, seq, tuple(c.target_layer_ids), "target", keep_logits=True)
    assert logits is not None
    hardness = token_hardness(logits, seq)
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    # Anchors at every generated position that can start a step: P .. P + N - 2.
    anchors = torch.arange(p_len, p_len + new_tokens - 1)[None]
    steps: list[int] = []
    leads: list[int] = []
    row1_walk: list[int] = []
    row1_all: list[int] = []
    hard_walk: list[float] = []
    hard_all: list[float] = []
    for i in range(seq.shape[0]):
        _, correct = block_loss(drafter, ctx[i : i + 1], seq[i : i + 1], labels[i : i + 1], anchors, embed, head,
                                loss_weights(b))
        lead = correct[0].long().cumprod(-1).sum(-1).tolist()
        leads += lead
        row1_all += correct[0, :, 0].long().tolist()
        hard_all += hardness[i, anchors[0]].tolist()
        a, end = p_len, p_len + new_tokens
        while a + 1 < end:
            produced = min(lead[a - p_len] + 1, end - 1 - a)
            steps.append(produced)
            row1_walk.append(int(correct[0, a - p_len, 0]))
            hard_walk.append(float(hardness[i, a]))
            a += produced
    return {
        "walk_tau": sum(steps) / len(steps),
        "uniform_anchor_tau": 1 + sum(leads) / len(leads),
        "row1_at_walk_anchors": sum(row1_walk) / len(row1_walk),
        "row1_at_all_positions": sum(row1_all) / len(row1_all),
        "hardness_at_walk_anchors": sum(hard_walk) / len(hard_walk),
        "hardness_at_all_positions": sum(hard_all) / len(hard_all),
        "steps": len(steps),
        "tokens_per_step": dict(sorted(collections.Counter(steps).items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=PRETRAINED, help="a pair directory (default: the shipped pair)")
    ap.add_argument("--drafters", default="b16,b8", help="drafter-NAME directories of the pair")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--corpus-site", type=Path, default=None,
                    help="also measure prompts from training files of this corpus site")
    ap.add_argument("--heldout-every", type=int, default=40, help="the build's held-out split")
    args = ap.parse_args()
    torch.manual_seed(0)
    target = load_target(args.pair / "target", torch.device("cpu"), torch.float32)
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(args.pair / "target")
    held = [q["ids"] for q in json.loads((args.pair / "heldout_prompts.json").read_text(encoding="utf-8"))["prompts"]]
    sets = {"held-out prompts": held}
    if args.corpus_site is not None:
        sets["training-file prompts"] = training_prompts(args.corpus_site, tokenizer, len(held), len(held[0]),
                                                         args.heldout_every)
    for name in args.drafters.split(","):
        drafter = load_drafter(args.pair / f"drafter-{name}", device="cpu", dtype=torch.float32)
        for label, prompts in sets.items():
            r = walk(target, drafter, prompts, args.new_tokens)
            print(f"{name}, {len(prompts)} {label} x {args.new_tokens} tokens: walk tau {r['walk_tau']:.2f}, "
                  f"uniform-anchor tau {r['uniform_anchor_tau']:.2f}, row-1 accuracy at walk anchors "
                  f"{r['row1_at_walk_anchors']:.2f} / at all positions {r['row1_at_all_positions']:.2f}, target's "
                  f"1 - p(anchor) {r['hardness_at_walk_anchors']:.3f} / {r['hardness_at_all_positions']:.3f}, "
                  f"{r['steps']} steps; tokens per step {r['tokens_per_step']}", flush=True)


if __name__ == "__main__":
    main()
