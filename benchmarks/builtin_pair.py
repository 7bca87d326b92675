"""The built-in pair's speed on this machine, warm, side by side in one run.

On the held-out prompts (128 new tokens each, greedy): speculative generation on blockdraft's
runtime, target-only decoding on the same runtime, and Hugging Face ``generate``, one prompt at
a time; then all 16 prompts at once against one at a time. The engine warms up first (as
`serve` and the CLI do) and each path runs once untimed first. On a CPU the figures follow the
host's speed: the record carries a yardstick beside them (the median time of one fp32
``[1, 256] x [256, 1536]`` GEMV: the fused gate/up shape of the first built-in target, kept
fixed so that records of every pair compare).
Prints a table and writes ``builtin_pair.json`` under the given directory (or ``$OUT``).

    python benchmarks/builtin_pair.py [OUT_DIR] [--device cpu|cuda] [--prompts N] [--new N] [--block-size 8|16]
        [--draft-length adaptive|K]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

import blockdraft
from blockdraft import pretrained
from blockdraft.devices import sync


def _timed(fn: Any, device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def yardstick_us() -> float:
    """Median microseconds of one fp32 ``[1, 256] x [256, 1536]`` GEMV on the host."""
    x, w = torch.randn(1, 256), torch.randn(1536, 256)
    times = []
    for i in range(600):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        if i >= 100:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=pretrained.DEFAULT_BLOCK_SIZE, choices=(8, 16),
                    help="which shipped drafter (default: the built-in default)")
    ap.add_argument("--draft-length", default=None,
                    help="'adaptive' or a fixed number of drafts per step (default: the engine's)")
    args = ap.parse_args()
    draft_length: Any = args.draft_length
    if draft_length not in (None, "adaptive"):
        draft_length = int(draft_length)
    dev = torch.device(args.device)
    target, drafter, _ = pretrained.builtin_pair(device=dev, dtype=torch.float32, block_size=args.block_size)
    prompts = pretrained.heldout_prompts()[: args.prompts]
    n = args.new
    longest = max(len(p) for p in prompts) + n
    engine = blockdraft.SpeculativeEngine(target, drafter, runtime="blockdraft",
                                          max_seq_len=longest, max_active=len(prompts),
                                          max_batch=len(prompts), draft_length=draft_length)
    engine.warmup()  # as `serve` and the CLI do: no compile or capture in the timed runs
    runtime = engine.runtime
    assert runtime is not None
    rec: dict[str, Any] = {"device": str(dev), "block_size": args.block_size,
                           "draft_length": engine.draft_length, "prompts": len(prompts), "new_tokens": n,
                           "host": platform.processor() or platform.machine(),
                           "cpus": os.cpu_count(), "torch": torch.__version__}
    if dev.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(dev)
    rec["yardstick_gemv_us"] = yardstick_us()

    def one_at_a_time(fn: Any) -> tuple[float, int, list[list[int]]]:
        fn(prompts[0])  # warm
        total_s, toks, outs = 0.0, 0, []
        for p in prompts:
            s, res = _timed(lambda p=p: fn(p), dev)
            total_s += s
            toks += sum(len(t) for t in res)
            outs.extend(res)
        return total_s, toks, outs

    spec_s, spec_toks, spec_out = one_at_a_time(
        lambda p: engine.generate([p], max_new_tokens=n).tokens)
    taus = engine.generate(prompts, max_new_tokens=n).stats.mean_tau
    dec_s, dec_toks, dec_out = one_at_a_time(
        lambda p: blockdraft.decode(runtime, [p], max_new_tokens=n).tokens)

    def hf(p: list[int]) -> list[list[int]]:
        ids = torch.tensor([p], device=dev)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        return [out[0, len(p):].tolist()]

    hf_s, hf_toks, hf_out = one_at_a_time(hf)
    engine.generate(prompts, max_new_tokens=n)  # warm the batched shapes
    batch_s, batch = _timed(lambda: engine.generate(prompts, max_new_tokens=n), dev)
    batch_toks = sum(len(t) for t in batch.tokens)
    rec.update({
        "speculative_tok_s": spec_toks / spec_s, "tau": taus,
        "runtime_decode_tok_s": dec_toks / dec_s, "hf_generate_tok_s": hf_toks / hf_s,
        "speedup_vs_runtime_decode": (spec_toks / spec_s) / (dec_toks / dec_s),
        "speedup_vs_hf_generate": (spec_toks / spec_s) / (hf_toks / hf_s),
        "batched_tok_s": batch_toks / batch_s,
        "batched_vs_one_at_a_time": (batch_toks / batch_s) / (spec_toks / spec_s),
        "identical_to_hf": sum(a == b for a, b in zip(spec_out, hf_out)),
        "decode_identical_to_hf": sum(a == b for a, b in zip(dec_out, hf_out)),
        "batched_identical_to_hf": sum(a == b for a, b in zip(batch.tokens, hf_out)),
    })
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "builtin_pair.json").write_text(json.dumps(rec, indent=1))
    print(f"built-in pair (B = {args.block_size}, draft length {engine.draft_length}) "
          f"on {rec.get('gpu', rec['host'])} ({dev}), "
          f"{len(prompts)} prompts x {n}:")
    for key in ("yardstick_gemv_us", "speculative_tok_s", "tau", "runtime_decode_tok_s", "hf_generate_tok_s",
                "speedup_vs_runtime_decode", "speedup_vs_hf_generate", "batched_tok_s",
                "batched_vs_one_at_a_time", "identical_to_hf", "decode_identical_to_hf",
                "batched_identical_to_hf"):
        v = rec[key]
        print(f"  {key}: {v:.2f}" if isinstance(v, float) else f"  {key}: {v}")


if __name__ == "__main__":
    main()
