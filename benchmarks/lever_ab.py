"""A lever's settings side by side on the speculative step, in one process on one pair.

The random pair of ``--shape`` is built once; then for each round, each setting of the lever
(an environment variable read when an engine is built) runs the ``spec`` section of
``blockdraft bench`` (:func:`blockdraft.bench.spec.bench_spec`: ms per step one by one and
back to back, target-only decode, host work) over every (context, batch) cell. Settings alternate within a round, so a
host or clock that drifts over the run moves both. Prints the medians over rounds per cell and
setting, with the host yardstick beside them, and writes ``lever_ab.json`` under the given
directory (or ``$OUT``).

    python benchmarks/lever_ab.py [OUT_DIR] --lever BLOCKDRAFT_DEVICE_DRAFTS=off,on
        [--contexts 4096,16384] [--batches 1,32] [--rounds 2] [--reps 10] [--warmup 3]
        [--shape qwen3-8b] [--max-seq-len N]

Other environment variables (``BLOCKDRAFT_DRAFT_LENGTH=15``, say) apply to every setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from blockdraft import bench, pair
from blockdraft.bench.config import BenchConfig
from blockdraft.bench.spec import bench_spec


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    ap.add_argument("--lever", required=True, help="NAME=setting,setting,...")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--contexts", type=_ints, default=[4096, 16384])
    ap.add_argument("--batches", type=_ints, default=[1, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="the engines' longest sequence (default: each cell's context and steps)")
    args = ap.parse_args()
    name, _, values = args.lever.partition("=")
    settings = [v.strip() for v in values.split(",") if v.strip()]
    if not name or len(settings) < 2:
        ap.error("--lever needs NAME=a,b (two settings or more)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = pair.SHAPES[args.shape]
    t0 = time.perf_counter()
    with torch.inference_mode():
        target, drafter = pair.random_pair(shape, device, dtype)
        cfg = BenchConfig(shape=args.shape, contexts=args.contexts, batches=args.batches,
                          reps=args.reps, warmup=args.warmup, sections=["spec"],
                          max_seq_len=args.max_seq_len)
        runs: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            for value in settings:
                os.environ[name] = value
                for rec in bench_spec(cfg, shape, drafter, target, device):
                    runs.append({"round": rnd, "setting": value, **rec})
        core = bench.bench_core_bookkeeping(16, shape, calls=20000)
    rows = ["| context | batch | " + " | ".join(f"step ms, {v}" for v in settings)
            + " | " + " | ".join(f"back to back ms, {v}" for v in settings)
            + " | " + " | ".join(f"host µs, {v}" for v in settings) + " | decode ms |",
            "| --- | --- |" + " --- |" * (3 * len(settings) + 1)]
    for ctx in args.contexts:
        for n in args.batches:
            cell = [r for r in runs if r["context"] == ctx and r["batch"] == n]

            def med(value: str, key: str, cell: list[dict[str, Any]] = cell) -> str:
                got = [r[key]["median"] for r in cell if r["setting"] == value]
                return f"{statistics.median(got):.3f}" if got else "-"

            decode = statistics.median(r["decode_ms"]["median"] for r in cell)
            rows.append(f"| {ctx} | {n} | " + " | ".join(med(v, "step_ms") for v in settings) + " | "
                        + " | ".join(med(v, "run_ms") for v in settings) + " | "
                        + " | ".join(med(v, "host_us") for v in settings) + f" | {decode:.3f} |")
    table = "\n".join(rows) + (f"\n\n{name}; medians over {args.rounds} rounds; Rust core bookkeeping "
                               f"on this host: {core['us_per_seq_step']:.2f} µs per sequence-step\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lever_ab.json").write_text(json.dumps({
        "environment": bench.environment(device), "lever": name, "settings": settings,
        "runs": runs, "core_bookkeeping": core, "total_s": time.perf_counter() - t0,
    }, indent=2, default=str))
    print(table)
    print(f"total {time.perf_counter() - t0:.1f} s; wrote {out}/lever_ab.json")


if __name__ == "__main__":
    main()
