"""Where a speculative step's time goes on one CUDA GPU (default: qwen3-8b random pair, bf16):

    python benchmarks/profile_step.py [OUT_DIR] [--context 4096] [--batches 1,32] [--steps 20]
        [--shape qwen3-8b|tiny|builtin] [--device cuda]

Per batch size n (n requests of --context random tokens, graphs warmed up, then steady-state
``engine.step()`` calls):

- the device: a ``torch.profiler`` trace of --steps steps, every kernel's time summed by name,
  and the device's busy time per step next to the step's wall time (the rest is the device
  waiting for the host);
- the host: the same steps with every CUDA-graph replay doing nothing (``bench.spec``'s
  ``no_replays``), under ``cProfile``; the functions with the most own time.

Writes OUT_DIR/profile.md (default: a new directory under ${TMPDIR:-/tmp}/blockdraft-bench).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from blockdraft import bench, pretrained
from blockdraft.bench.spec import no_replays
from blockdraft.devices import sync
from blockdraft.engine import SpeculativeEngine
from blockdraft.pair import SHAPES, random_drafter, random_target


def engine_at(target: Any, drafter: Any, ctx: int, n: int, steps: int, gen: torch.Generator,
              dev: torch.device) -> SpeculativeEngine:
    block = drafter.config.block_size
    vocab = target.config.vocab_size
    new_tokens = (3 * steps + 16) * block
    engine = SpeculativeEngine(target, drafter, runtime="blockdraft",
                               max_seq_len=ctx + new_tokens + block, max_active=n, max_batch=min(n, 32))
    for _ in range(n):
        engine.submit(torch.randint(0, vocab - 1, (ctx,), generator=gen).tolist(),
                      max_new_tokens=new_tokens)
    for _ in range(6):  # admission, prefill, graph capture, warm-up
        engine.step()
    sync(dev)
    return engine


def device_profile(engine: SpeculativeEngine, steps: int, dev: torch.device) -> tuple[list[str], float, float]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(dev)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    per_kernel: dict[str, float] = defaultdict(float)
    busy_us = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time
            busy_us += ev.device_time
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    lines = ["| kernel | µs per step | share of device time |", "| --- | --- | --- |"]
    for name, us in rows:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {us / steps:.1f} | {us / max(busy_us, 1e-9):.1%} |")
    return lines, wall_ms, busy_us / steps / 1e3


def host_profile(engine: SpeculativeEngine, steps: int, dev: torch.device) -> tuple[list[str], float]:
    prof = cProfile.Profile()
    with no_replays():
        sync(dev)
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        sync(dev)
        us = (time.perf_counter() - t0) * 1e6 / steps
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return ["```", *buf.getvalue().strip().splitlines()[-32:], "```"], us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shape", default="qwen3-8b", choices=[*sorted(SHAPES), "builtin"],
                    help="a random pair's shape (bf16), or the built-in trained pair (fp32)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(args.out) if args.out else bench.default_out_dir(f"{args.shape}-profile")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    pair = "the built-in pair, fp32" if args.shape == "builtin" else f"{args.shape} random pair, bf16"
    doc = [f"# Speculative step profile: {pair}, context {args.context}", "",
           f"{gpu}, torch {torch.__version__}", ""]
    with torch.inference_mode():
        if args.shape == "builtin":
            target, drafter, _ = pretrained.builtin_pair(device=dev, dtype=torch.float32)
        else:
            shape = SHAPES[args.shape]
            target = random_target(shape, dev, torch.bfloat16, 0)
            drafter = random_drafter(shape, dev, torch.bfloat16, 1)
        for n in (int(b) for b in args.batches.split(",")):
            engine = engine_at(target, drafter, args.context, n, args.steps, gen, dev)
            kernels, wall_ms, busy_ms = device_profile(engine, args.steps, dev)
            host, host_us = host_profile(engine, args.steps, dev)
            engine.close()
            torch.cuda.empty_cache()
            doc += [f"## batch {n}", "",
                    f"Step wall time under the profiler {wall_ms:.3f} ms; device busy {busy_ms:.3f} ms "
                    f"per step; host work alone (replays off, under cProfile) {host_us:.1f} µs per step.",
                    "", *kernels, "", "Host work, own time (cProfile):", "", *host, ""]
            (out / "profile.md").write_text("\n".join(doc) + "\n")
    print("\n".join(doc))


if __name__ == "__main__":
    main()
