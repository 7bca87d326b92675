"""The built-in target's training step, eager against ``torch.compile``, on one GPU.

Builds the ``h200`` preset's target from random weights (seed 0) twice, the same weights, and
times training steps on random windows of the preset's batch (96 x 512 tokens, bf16 autocast,
AdamW, gradient clipping), first eagerly, then through ``torch.compile``. The compiled run's
first step, which compiles, is timed apart. Both runs see the same windows, so the losses of
their first steps are printed side by side as a check that they train the same model.

    python benchmarks/builtin/target_train_step.py [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockdraft.training.builtin.presets import PRESETS
from blockdraft.training.builtin.target import build_target
from blockdraft.training.optim import adamw, apply_gradients


def run(compiled: bool, steps: int, warmup: int, device: torch.device) -> dict[str, float | list[float]]:
    p = PRESETS["h200"]
    model = build_target(p, 0, 0).to(device).train()
    forward = torch.compile(model) if compiled else model
    opt = adamw(model, p.target_lr, 0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(2, p.vocab, (p.target_batch, p.target_seq_len), generator=gen).to(device)
               for _ in range(4)]
    losses: list[float] = []

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=tokens, labels=tokens, use_cache=False).loss
        apply_gradients(opt, loss, model, 1.0)
        if len(losses) < 3:
            losses.append(float(loss.detach()))

    t = time.perf_counter()
    step(0)
    torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t
    for i in range(1, warmup):
        step(i)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    torch.cuda.synchronize(device)
    per_step = (time.perf_counter() - t) / steps
    tokens = p.target_batch * p.target_seq_len
    return {"first_step_s": first_s, "ms_per_step": per_step * 1e3,
            "s_per_1m_tokens": per_step / tokens * 1e6, "first_losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "eager": run(False, args.steps, args.warmup, device),
           "compiled": run(True, args.steps, args.warmup, device)}
    out["speedup"] = out["eager"]["ms_per_step"] / out["compiled"]["ms_per_step"]  # type: ignore[index]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
