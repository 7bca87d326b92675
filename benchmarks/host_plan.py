"""The target runtime's per-step bookkeeping of one verify on the host: the Rust core's
`plan_forward` over SEQS sequences of ROWS new rows each, then `ForwardPlan.fill` of a page
table as wide as `max_seq_len` (as the runtime's CUDA-graph buffers are), with and without
padding each row. Each sequence reserves pages for `max_seq_len` tokens and holds LENGTH of
them, as a served request whose `max_tokens` reaches the context limit does. Median µs of
`--calls` calls (the first tenth not counted), with the host yardstick of
`host_engine_step.py` printed first:

    PYTHONPATH=python python benchmarks/host_plan.py [--seqs 32] [--rows 16] [--length 300]
        [--max-seq-len 40960] [--page-size 16] [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from host_engine_step import yardstick_us

from blockdraft._core import BlockPool, SeqPages, plan_forward

OWNER = 7


def timed(seqs: list[SeqPages], rows: int, out: torch.Tensor, pad: bool, calls: int) -> float:
    """Median µs of one plan and fill (the plan's rows are dropped again after each)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        plan = plan_forward("verify", seqs, [rows] * len(seqs), OWNER)
        plan.fill(out, out.shape[1], pad)
        times.append(time.perf_counter() - t0)
        for s in seqs:
            s.accept(0)
    return statistics.median(times[calls // 10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=300)
    ap.add_argument("--max-seq-len", type=int, default=40960)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    width = -(-args.max_seq_len // args.page_size)
    pool = BlockPool(args.seqs * width, args.page_size)
    seqs = [SeqPages(pool, args.max_seq_len, OWNER) for _ in range(args.seqs)]
    plan_forward("prefill", seqs, [args.length] * args.seqs, OWNER)
    for s in seqs:
        s.accept(args.length)
    out = torch.zeros((args.seqs, width), dtype=torch.int32)
    print(f"host yardstick: {yardstick_us():.2f} us")
    for pad in (True, False):
        us = timed(seqs, args.rows, out, pad, args.calls)
        print(f"plan_forward + fill(pad={pad}): {us:.1f} us ({args.seqs} sequences x {args.rows} rows, "
              f"{args.length} tokens held, table {width} pages wide)")


if __name__ == "__main__":
    main()
