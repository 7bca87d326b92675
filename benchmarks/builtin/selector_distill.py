"""The selector's distillation on the shipped B = 8 DFlash2 drafter, on the CPU.

Continues `drafter-b8` twice on the same sampled (T = 1) rollouts of the shipped target, with
the same seed and steps, once without and once with ``selector_distill_weight``, then measures
the shipped drafter and both results on the shipped held-out prompts: greedy τ, T = 1 τ with
argmax drafts, and T = 1 τ with drafts sampled from the selector.

Rollout prompts come from files of the corpus site in the build's training split, so the
corpus packages must be installed (``python -m blockdraft.training.builtin.corpus_site SITE``).

    python benchmarks/builtin/selector_distill.py --corpus-site SITE [--steps 150] [--rollouts 384]
        [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import blockdraft
from blockdraft.training.builtin.presets import PRESETS
from blockdraft.training.builtin.target import load_target
from blockdraft.training.data import collect_python_sources, encode_stream, split_heldout
from blockdraft.training.evaluate import evaluate_drafter
from blockdraft.training.loop import DrafterTrainConfig, train_drafter
from blockdraft.training.rollouts import rollout_stream

PRETRAINED = Path(__file__).resolve().parents[2] / "python" / "blockdraft" / "pretrained"


def sampled_rollouts(target: Any, tokenizer: Any, site: Path, num: int, eos: int) -> torch.Tensor:
    """``num`` T = 1 rollouts (64 prompt + 256 new tokens) from 1,500 training-split files."""
    files = collect_python_sources([site], max_chars=10**9)
    train, _ = split_heldout(files, PRESETS["h200"].heldout_every)
    random.Random(1).shuffle(train)
    stream = encode_stream([f.text for f in train[:1500]], tokenizer, eos)
    return rollout_stream(target, stream, eos, num=num, prompt_len=64, new_tokens=256, temperature=1.0, seed=11,
                          batch=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-site", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rollouts", type=int, default=384)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "blockdraft-selector-distill",
                    help="rollouts and runs (the rollouts are reused by a later run)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(PRETRAINED / "target")
    eos = int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    mask = int(tokenizer.convert_tokens_to_ids("<|mask|>"))
    target = load_target(PRETRAINED / "target", torch.device("cpu"), torch.float32)
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"sampled-{args.rollouts}.pt"
    if not data.is_file():
        t = time.perf_counter()
        torch.save(sampled_rollouts(target, tokenizer, args.corpus_site, args.rollouts, eos), data)
        print(f"{args.rollouts} sampled rollouts in {time.perf_counter() - t:.0f} s")
    stream = torch.load(data, weights_only=True)
    drafters = {"shipped drafter-b8": PRETRAINED / "drafter-b8"}
    p = PRESETS["h200"]
    for weight in (0.0, 1.0):
        cfg = DrafterTrainConfig(num_layers=p.drafter_layers, block_size=8, mask_token_id=mask,
                                 target_layer_ids=list(p.target_layer_ids), seq_len=256, num_seqs=8, num_anchors=32,
                                 steps=args.steps, lr=2e-4, warmup_steps=5, log_every=10, save_dtype="float32",
                                 distill_weight=0.5, dflash2=dict(p.dflash2), selector_distill_weight=weight,
                                 init_from=str(PRETRAINED / "drafter-b8"), seed=3)
        res = train_drafter(target, stream, cfg, args.work / f"selector-distill-{weight:g}", progress=True)
        print(f"selector_distill_weight {weight:g}: {res.steps} steps in {res.seconds:.0f} s, "
              f"loss {res.final_loss:.3f}")
        drafters[f"continued, selector_distill_weight {weight:g}"] = res.drafter_dir
    heldout = json.loads((PRETRAINED / "heldout_prompts.json").read_text(encoding="utf-8"))
    prompts = [q["ids"] for q in heldout["prompts"]]
    for name, path in drafters.items():
        drafter = blockdraft.load_drafter(path, device="cpu", dtype=torch.float32)
        rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=128, temperatures=(0.0, 1.0),
                               compare_target=False, stop_token_ids=[eos], sampled_drafts=True)
        print(f"{name}: " + ", ".join(f"{k} tau {v:.2f}" for k, v in rep.tau.items()), flush=True)


if __name__ == "__main__":
    main()
