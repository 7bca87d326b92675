"""How sure a built-in target is of its own greedy choices, against how well it predicts code.

For each pair directory (``target/`` and ``heldout_prompts.json``, the layout of
``blockdraft/pretrained``), CPU, fp32:

- **own continuations**: the target writes its greedy continuation of each held-out prompt;
  the mean probability it gave each token it chose, and the mean distinct-4-gram ratio of the
  continuations (the loop metric; 1 = no 4-gram repeats);
- **held-out code**: teacher-forced on the first ``--code-tokens`` tokens of held-out standard
  library files of this interpreter (whole files held out by content hash, as the builds do),
  the mean probability of the target's argmax and its next-token accuracy.

A drafter is accepted when it names the target's argmax several tokens ahead, so the first
figure bounds how easy the target is to draft for; the second separates a target that is
unsure because it predicts code badly from one that is unsure on text it predicts well.

    python benchmarks/builtin/target_sureness.py PAIR [PAIR ...] [--new-tokens 128] [--files 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from blockdraft.training.builtin.target import load_target
from blockdraft.training.data import collect_python_sources, python_source_roots, split_heldout
from blockdraft.training.evaluate import distinct_ngram_ratio, heldout_metrics, target_only_greedy
from blockdraft.training.objective import token_hardness


@torch.inference_mode()
def own_continuations(model: Any, prompts: list[list[int]], eos: int, new_tokens: int) -> dict[str, float]:
    chosen: list[float] = []
    loops: list[float] = []
    for prompt in prompts:
        out = target_only_greedy(model, prompt, new_tokens, [eos])
        ids = torch.tensor([prompt + out])
        chosen += (1.0 - token_hardness(model(ids).logits, ids)[0, len(prompt):]).tolist()
        loops.append(distinct_ngram_ratio(out))
    return {"p_own_choice": statistics.fmean(chosen), "distinct_4gram": statistics.fmean(loops)}


@torch.inference_mode()
def heldout_code(model: Any, tokenizer: Any, texts: list[str], code_tokens: int) -> dict[str, float]:
    """:func:`heldout_metrics` over each text's first ``code_tokens`` + 1 tokens, pooled by token."""
    runs = [heldout_metrics(model, torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"][: code_tokens + 1]),
                            len(t), seq_len=code_tokens + 1) for t in texts]
    count = sum(r["tokens"] for r in runs)
    return {k: sum(r[k] * r["tokens"] for r in runs) / count for k in ("p_argmax", "accuracy")}


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", type=Path, nargs="+")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--files", type=int, default=32, help="held-out standard library files")
    ap.add_argument("--code-tokens", type=int, default=512)
    args = ap.parse_args()
    files = collect_python_sources(python_source_roots()[:1], max_chars=30_000_000)
    _, held = split_heldout(files, 40)
    texts = [f.text for f in held if len(f.text) > 8 * args.code_tokens][: args.files]
    for pair in args.pairs:
        tokenizer: Any = AutoTokenizer.from_pretrained(pair / "target")
        model = load_target(pair / "target", torch.device("cpu"), torch.float32)
        prompts = [q["ids"] for q in json.loads((pair / "heldout_prompts.json").read_text())["prompts"]]
        row = {"pair": str(pair), **own_continuations(model, prompts, int(tokenizer.eos_token_id), args.new_tokens),
               **heldout_code(model, tokenizer, texts, args.code_tokens)}
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
