"""The built-in pair sampling (temperature > 0), warm, on this machine.

On the held-out prompts (new tokens each, seeded): speculative generation with greedy drafts
and with sampled drafts (``sampled_drafts=True``), and target-only decoding on the same
runtime, one prompt at a time; then all prompts at once. Every timed call runs once untimed
first, so no compile or capture is timed. The tokens differ from run to run of other code (each
draw is seeded, not the same across implementations), so the record carries τ beside the
speed. For an A/B of two versions of the package, run it once with each on ``PYTHONPATH``.

    python benchmarks/sampled_pair.py [OUT_DIR] [--device cpu|cuda] [--prompts N] [--new N]
        [--temperature T] [--top-p P] [--tag NAME]

Prints a table and writes ``sampled_pair[-TAG].json`` under the given directory (or ``$OUT``).
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
from blockdraft import pretrained
from blockdraft.devices import sync


def target_only(runtime: Any, prompts: list[list[int]], n: int, params: Any, timed: Any) -> float:
    """Target-only sampled decoding on ``runtime``, one prompt at a time: tokens/s."""
    total_s, toks = 0.0, 0
    for i, p in enumerate(prompts):
        s, res = timed(lambda p=p, i=i: blockdraft.decode(
            runtime, [p], max_new_tokens=n, sampling=params, generator=torch.Generator().manual_seed(i)))
        total_s += s
        toks += sum(len(t) for t in res.tokens)
    return toks / total_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    target, drafter, _ = pretrained.builtin_pair(device=dev, dtype=torch.float32)
    prompts = pretrained.heldout_prompts()[: args.prompts]
    n = args.new
    params = blockdraft.SamplingParams(temperature=args.temperature, top_p=args.top_p)
    longest = max(len(p) for p in prompts) + n
    rec: dict[str, Any] = {"device": str(dev), "prompts": len(prompts), "new_tokens": n,
                           "temperature": args.temperature, "top_p": args.top_p, "torch": torch.__version__}
    if dev.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(dev)

    def timed(fn: Any) -> tuple[float, Any]:
        fn()  # untimed: compiles and captures happen here
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        return time.perf_counter() - t0, out

    for name, sampled in (("greedy_drafts", False), ("sampled_drafts", True)):
        engine = blockdraft.SpeculativeEngine(target, drafter, runtime="blockdraft", max_seq_len=longest,
                                              max_active=len(prompts), max_batch=len(prompts),
                                              sampled_drafts=sampled)
        total_s, toks, taus = 0.0, 0, []
        for i, p in enumerate(prompts):
            s, res = timed(lambda p=p, i=i, engine=engine: engine.generate(
                [p], max_new_tokens=n, sampling=params, generator=torch.Generator().manual_seed(i)))
            total_s += s
            toks += sum(len(t) for t in res.tokens)
            taus.append(res.stats.mean_tau)
        batch_s, batch = timed(lambda engine=engine: engine.generate(
            prompts, max_new_tokens=n, sampling=params, generator=torch.Generator().manual_seed(0)))
        rec[name] = {"one_at_a_time_tok_s": toks / total_s, "tau": sum(taus) / len(taus),
                     "batched_tok_s": sum(len(t) for t in batch.tokens) / batch_s,
                     "batched_tau": batch.stats.mean_tau}
        if not sampled:
            rec["target_only_tok_s"] = target_only(engine.runtime, prompts, n, params, timed)
        engine.close()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sampled_pair{'-' + args.tag if args.tag else ''}.json").write_text(json.dumps(rec, indent=1))
    print(f"built-in pair sampling at T {args.temperature}, top-p {args.top_p} on {rec.get('gpu', dev)}, "
          f"{len(prompts)} prompts x {n} ({args.tag or 'this code'}):")
    for name in ("greedy_drafts", "sampled_drafts"):
        r = rec[name]
        print(f"  {name}: one at a time {r['one_at_a_time_tok_s']:.0f} tok/s (tau {r['tau']:.2f}), "
              f"all at once {r['batched_tok_s']:.0f} tok/s (tau {r['batched_tau']:.2f})")
    print(f"  target-only decode on the runtime, one at a time: {rec['target_only_tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
