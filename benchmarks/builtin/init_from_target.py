"""Drafter training from the target's last layers against random weights, on the CPU.

Trains a B = 16, 2-layer DFlash drafter for the built-in target twice, the same steps and data
(3 M characters of the interpreter's standard library), once with ``init_from_target`` and once
from random weights, and prints the loss and tau estimate every 10 steps of each.

    python benchmarks/builtin/init_from_target.py [--steps 80]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from blockdraft import pretrained
from blockdraft.training.data import collect_python_sources, encode_stream, python_source_roots
from blockdraft.training.loop import DrafterTrainConfig, train_drafter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    target, _, tokenizer = pretrained.builtin_pair(device="cpu")
    files = collect_python_sources(python_source_roots()[:1], max_chars=3_000_000)
    stream = encode_stream([f.text for f in files], tokenizer, tokenizer.eos_token_id)
    mask = int(tokenizer.convert_tokens_to_ids("<|mask|>"))
    for start in ("target", "random"):
        cfg = DrafterTrainConfig(num_layers=2, block_size=16, mask_token_id=mask, target_layer_ids=[1, 4, 6],
                                 seq_len=256, num_seqs=4, num_anchors=16, steps=args.steps, lr=1e-3,
                                 warmup_steps=10, log_every=10, save_dtype="float32",
                                 init_from_target=start == "target")
        with tempfile.TemporaryDirectory() as out:
            res = train_drafter(target, stream, cfg, Path(out), progress=False)
        rows = ", ".join(f"{int(h['step'])}: {h['loss']:.3f}/{h['tau']:.2f}" for h in res.history)
        print(f"from {start}: step: loss/tau  {rows}")


if __name__ == "__main__":
    main()
