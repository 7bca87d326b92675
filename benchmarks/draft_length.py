"""Adaptive draft length against a fixed one, and against target-only decoding, in one run.

Two workloads (greedy, warm: each engine runs the workload once untimed first):

- ``builtin``: the built-in pair (fp32), ``--concurrent`` requests at once (the held-out
  prompts, cycled), ``--new`` tokens each; tokens/s and tau with every draft the block holds
  (``K = B - 1``) and with the adaptive policy, and whether their outputs are identical.
- ``random``: the random pair of ``--shape`` (qwen3-8b) (bf16, tau about 1: the drafter accepts almost nothing),
  one request of a ``--context``-token prompt; ms per step of ``K = B - 1``, of the adaptive
  policy and of target-only decoding on the same runtime.

Prints a table and writes ``draft_length.json`` under the given directory (or ``$OUT``).

    python benchmarks/draft_length.py [OUT_DIR] [--workloads builtin,random] [--concurrent 32]
        [--new 128] [--context 4096] [--shape qwen3-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import blockdraft
from blockdraft import pair, pretrained
from blockdraft.bench import environment
from blockdraft.devices import sync
from blockdraft.engine.generate import pool_sizes


def _engine(target: Any, drafter: Any, prompts: list[list[int]], new: int, draft_length: Any) -> Any:
    block = int(drafter.config.block_size)
    target_pages, drafter_pages = pool_sizes([len(p) for p in prompts], new, block)
    return blockdraft.SpeculativeEngine(
        target, drafter, runtime="blockdraft", max_seq_len=max(len(p) for p in prompts) + new,
        max_active=len(prompts), max_batch=min(len(prompts), 32), target_pages=target_pages,
        num_pages=drafter_pages, draft_length=draft_length,
    )


def _run(engine: Any, prompts: list[list[int]], new: int, device: torch.device) -> dict[str, Any]:
    engine.generate(prompts, max_new_tokens=new)  # compiles, captures
    sync(device)
    t0 = time.perf_counter()
    res = engine.generate(prompts, max_new_tokens=new)
    sync(device)
    wall = time.perf_counter() - t0
    toks = sum(len(t) for t in res.tokens)
    steps = max(len(a) for a in res.stats.acceptance_lengths)
    decode_s = wall - max(res.stats.ttft_s)
    return {"draft_length": engine.draft_length, "tok_s": toks / wall, "tau": res.stats.mean_tau,
            "steps": steps, "ms_per_step": decode_s * 1e3 / max(1, steps - 1), "tokens": res.tokens}


def builtin(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    target, drafter, _ = pretrained.builtin_pair(device=device, dtype=torch.float32)
    held = pretrained.heldout_prompts()
    prompts = [held[i % len(held)] for i in range(args.concurrent)]
    block = int(drafter.config.block_size)
    rows = [_run(_engine(target, drafter, prompts, args.new, k), prompts, args.new, device)
            for k in (block - 1, "adaptive")]
    fixed, adaptive = rows
    return {"concurrent": args.concurrent, "new_tokens": args.new, "block_size": block,
            "fixed": {k: v for k, v in fixed.items() if k != "tokens"},
            "adaptive": {k: v for k, v in adaptive.items() if k != "tokens"},
            "adaptive_vs_fixed": adaptive["tok_s"] / fixed["tok_s"],
            "identical": sum(a == b for a, b in zip(fixed["tokens"], adaptive["tokens"]))}


def random(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = pair.SHAPES[args.shape]
    with torch.inference_mode():
        target, drafter = pair.random_pair(shape, device=device, dtype=torch.bfloat16, seed=0)
    prompt = [(31 * j + 7) % (shape.vocab - 1) for j in range(args.context)]
    block = int(drafter.config.block_size)
    out: dict[str, Any] = {"context": args.context, "new_tokens": args.new, "block_size": block}
    for key, k in (("fixed", block - 1), ("adaptive", "adaptive")):
        engine = _engine(target, drafter, [prompt], args.new, k)
        row = _run(engine, [prompt], args.new, device)
        out[key] = {k2: v for k2, v in row.items() if k2 != "tokens"}
        out[key + "_tokens"] = row["tokens"][0]
        if key == "fixed":
            runtime = engine.runtime
            blockdraft.decode(runtime, [prompt], max_new_tokens=args.new)
            sync(device)
            t0 = time.perf_counter()
            dec = blockdraft.decode(runtime, [prompt], max_new_tokens=args.new)
            sync(device)
            wall = time.perf_counter() - t0
            out["decode"] = {"ms_per_step": (wall - dec.stats.ttft_s[0]) * 1e3 / (args.new - 1)}
            out["decode_tokens"] = dec.tokens[0]
        engine.close()
    # bf16 rows of different counts round differently: on a random pair's near-even logits an
    # argmax can flip; the first differing position says where.
    toks = {k: out.pop(k + "_tokens") for k in ("fixed", "adaptive", "decode")}
    for a, b in (("fixed", "decode"), ("adaptive", "decode"), ("adaptive", "fixed")):
        diff = [i for i, (x, y) in enumerate(zip(toks[a], toks[b])) if x != y]
        out[f"{a}_vs_{b}_first_difference"] = diff[0] if diff else None
    out["adaptive_vs_decode"] = out["adaptive"]["ms_per_step"] / out["decode"]["ms_per_step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default="builtin,random")
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--shape", default="qwen3-8b", help="the random pair's shape")
    args = ap.parse_args()
    device = torch.device(args.device)
    rec: dict[str, Any] = {"environment": environment(device)}
    for name in args.workloads.split(","):
        rec[name] = {"builtin": builtin, "random": random}[name](args, device)
        print(name, json.dumps(rec[name], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_length.json").write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    main()
