"""Skinny GEMMs at the Qwen3-8B projection shapes (bf16): cuBLAS (``F.linear``) against the
weight-streaming kernels of ``blockdraft.kernels.skinny_gemm`` over a sweep of configs, for
M = 1, 2, 4, 8, 16 rows; then the fused gate/up + SwiGLU against ``silu_mul(F.linear(...))``
and the fused lm_head + argmax against ``torch.argmax(F.linear(...))``.

Shapes ``N x K``: q/k/v fused 6144 x 4096, o 4096 x 4096, gate/up fused 24576 x 4096, down
4096 x 12288, lm_head 151936 x 4096. Every time is a CUDA-graph replay of many calls (cuda
events, median of ``--reps`` replays, divided by the calls): the calls rotate over enough copies
of the weight that the copies together are 3x the L2 (the o weight, 32 MB, would otherwise sit
in the H200's 50 MB L2). ``gb_per_s`` counts the weight bytes once per call; ``pct_copy`` is
that against the device copy bandwidth measured in the same run (``common.copy_bandwidth_gbs``,
read + write bytes). Each streaming config's output is checked against ``F.linear`` first; a
config that fails to compile or disagrees is reported and skipped.

Writes ``gemm.json`` (every cell and config), ``gemm.md`` (the table) and appends one JSON
line per cell to ``bench.jsonl`` under ``--out`` (default ``$OUT``); prints the table and, at
the end, the best configs as ``DEFAULT_CONFIGS`` entries to paste into ``skinny_gemm.py``.

    cd kernels && python bench_gemm.py [--out DIR] [--rows 1,16] [--shapes o,down] [--quick]
    cd kernels && python bench_gemm.py --dry-run     # the plan only: no GPU needed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from common import copy_bandwidth_gbs, import_kernels, record

# name -> (kind, weight rows N, K)
SHAPES: dict[str, tuple[str, int, int]] = {
    "qkv": ("linear", 6144, 4096),
    "o": ("linear", 4096, 4096),
    "gate_up": ("linear", 24576, 4096),
    "down": ("linear", 4096, 12288),
    "lm_head": ("linear", 151936, 4096),
    "gate_up+swiglu": ("swiglu", 24576, 4096),
    "lm_head+argmax": ("argmax", 151936, 4096),
}
ROWS = (1, 2, 4, 8, 16)
H200_SMS = 132  # the plan of --dry-run (no device to ask)
DEVICE = "cuda"
DTYPE = torch.bfloat16
L2_BYTES = 50 << 20  # off CUDA, or where the device does not say


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="directory for gemm.json, gemm.md and bench.jsonl (default: $OUT; none: print only)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="comma-separated row counts (each <= 16)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=15, help="graph replays per timing (median)")
    p.add_argument("--calls", type=int, default=24, help="calls per graph replay (at least)")
    p.add_argument("--quick", action="store_true", help="sweep 3 block shapes, not 6")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    a = p.parse_args(argv)
    try:
        a.rows = [int(r) for r in a.rows.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rows: not a list of integers: {a.rows!r}")
    if not a.rows or any(not 1 <= r <= 16 for r in a.rows):
        p.error(f"--rows: each must be in 1..16, got {a.rows}")
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in a.shapes if s not in SHAPES]
    if bad or not a.shapes:
        p.error(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    if a.reps < 1 or a.calls < 1:
        p.error("--reps and --calls must be >= 1")
    return a


def candidates(sg: Any, kind: str, rows: int, n: int, k: int, sms: int, quick: bool) -> list[Any]:
    """The configs swept for one cell: the module's own choice first, then block shapes with
    the rule's split for that block (and, for four of them, no split, one or two programs per
    SM, twice the rule's), the broadcast path for 1-2 rows."""
    out = [sg.config_for(kind, rows, n, k, torch.device(DEVICE)) if torch.cuda.is_available()
           else sg.rule_config(kind, rows, n, k, sms)]
    out_n = n // 2 if kind == "swiglu" else n
    # (block_n, block_k, warps, stages, sweep the split): one compile per block shape (the
    # split count is a launch argument), so the split sweep costs only timing
    # (narrow tiles: enough column tiles to fill the GPU without a split at N = 4096)
    blocks = [(64, 128, 4, 4, True), (16, 256, 4, 6, True), (128, 128, 8, 3, True),
              (32, 256, 4, 4, True), (64, 128, 4, 6, False), (64, 256, 4, 3, False)]
    for bn, bk, warps, stages, sweep in blocks[:3] if quick else blocks:
        tiles, steps = math.ceil(out_n / bn), math.ceil(k / bk)
        base = 1 if kind == "argmax" else max(1, min(steps // 4, math.ceil(2 * sms / tiles)))
        splits = {base}
        if sweep and kind != "argmax":
            # one wave of one or two programs per SM, the rule's, twice the rule's
            splits |= {sms // tiles, 2 * sms // tiles, 2 * base, 1}
        for split in sorted({max(1, min(steps, sp)) for sp in splits}):
            out.append(sg.GemmConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                                     num_stages=stages))
    if rows <= 2 and not quick:
        out.append(sg.GemmConfig(block_n=64, block_k=128, split_k=out[0].split_k, dot=False))
    seen: list[Any] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return seen


def replay_ms(calls: list[Callable[[], object]], reps: int) -> float:
    """Median ms per call of ``calls`` captured in one CUDA graph, replayed ``reps`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:  # compile and warm up outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events) / len(calls)
    del graph
    return ms


def config_src(c: Any) -> str:
    extra = "" if c.dot else ", dot=False"
    return (f"GemmConfig(block_n={c.block_n}, block_k={c.block_k}, split_k={c.split_k}, "
            f"num_warps={c.num_warps}, num_stages={c.num_stages}{extra})")


def weights(name: str) -> list[torch.Tensor]:
    """Copies of one random weight, together at least 3x the L2."""
    _, n, k = SHAPES[name]
    dev = torch.device(DEVICE)
    l2 = L2_BYTES
    if dev.type == "cuda":
        l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", l2))
    gen = torch.Generator(device=dev).manual_seed(n + k)
    nbytes = n * k * DTYPE.itemsize
    return [(torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(DTYPE)
            for _ in range(max(1, math.ceil(3 * l2 / nbytes)))]


def run_cell(K: Any, sg: Any, name: str, ws: list[torch.Tensor], rows: int,
             a: argparse.Namespace, copy_gbs: float, sms: int) -> dict[str, Any]:
    kind, n, k = SHAPES[name]
    nbytes = n * k * DTYPE.itemsize
    copies = len(ws)
    gen = torch.Generator(device=ws[0].device).manual_seed(rows)
    x = torch.randn(rows, k, device=ws[0].device, generator=gen).to(DTYPE)
    loops = math.ceil(a.calls / copies)
    ops = K.ops("triton")

    def torch_fn(w: torch.Tensor) -> torch.Tensor:
        if kind == "swiglu":
            return ops.silu_mul(F.linear(x, w))
        if kind == "argmax":
            return torch.argmax(F.linear(x, w), dim=1)
        return F.linear(x, w)

    stream_fn = {"linear": sg.linear, "swiglu": sg.linear_silu_mul, "argmax": sg.linear_argmax}[kind]
    torch_ms = replay_ms([lambda w=w: torch_fn(w) for _ in range(loops) for w in ws], a.reps)
    want = torch_fn(ws[0])
    results = []
    for cfg in candidates(sg, kind, rows, n, k, sms, a.quick):
        prev = sg.set_config_override(cfg)
        entry: dict[str, Any] = {"config": asdict(cfg)}
        try:
            got = stream_fn(x, ws[0])
            if kind == "argmax":
                # near-ties of bf16 logits may round either way; count, do not fail
                entry["argmax_mismatches"] = int((got != want).sum())
                ok = entry["argmax_mismatches"] <= max(1, rows // 8)
            else:
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                entry["rel_err"] = round(err, 5)
                ok = err < 0.02
            if ok:
                ms = replay_ms([lambda w=w: stream_fn(x, w) for _ in range(loops) for w in ws],
                               a.reps)
                entry.update(ms=round(ms, 5), gb_per_s=round(nbytes / ms / 1e6, 1),
                             pct_copy=round(100 * nbytes / ms / 1e6 / copy_gbs, 1))
            else:
                entry["error"] = "output differs from the torch path"
        except Exception as exc:  # a config that does not compile or launch: report, go on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        finally:
            sg.set_config_override(prev)
        results.append(entry)
    timed = [r for r in results if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    cell = {"bench": "skinny_gemm", "shape": name, "kind": kind, "rows": rows, "n": n, "k": k,
            "weight_bytes": nbytes, "weight_copies": copies, "copy_gb_per_s": round(copy_gbs, 1),
            "torch_ms": round(torch_ms, 5),
            "torch_pct_copy": round(100 * nbytes / torch_ms / 1e6 / copy_gbs, 1),
            "default": results[0], "best": best, "sweep": results,
            "speedup_vs_torch": round(torch_ms / best["ms"], 3) if best else None}
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| shape | M | torch ms | torch % copy | default ms | best ms | best GB/s | best % copy "
             "| vs torch | best config |", "|" + " --- |" * 10]
    for c in cells:
        b, d = c["best"], c["default"]
        cfg = b["config"] if b else {}
        lines.append(
            f"| {c['shape']} | {c['rows']} | {c['torch_ms']:.4f} | {c['torch_pct_copy']} | "
            f"{d.get('ms', float('nan')):.4f} | {b['ms'] if b else float('nan'):.4f} | "
            f"{b['gb_per_s'] if b else '-'} | {b['pct_copy'] if b else '-'} | "
            f"{c['speedup_vs_torch']}x | "
            + (f"{cfg['block_n']}x{cfg['block_k']} s{cfg['split_k']} w{cfg['num_warps']} "
               f"st{cfg['num_stages']}{'' if cfg['dot'] else ' bcast'}" if b else "none") + " |")
    return "\n".join(lines)


def suggested(sg: Any, cells: list[dict[str, Any]]) -> str:
    lines = ["DEFAULT_CONFIGS: dict[tuple[Kind, int, int, int], GemmConfig] = {"]
    for c in cells:
        if c["best"] is None:
            continue
        cfg = sg.GemmConfig(**c["best"]["config"])
        lines.append(f"    ({c['kind']!r}, {sg.m_bucket(c['rows'])}, {c['n']}, {c['k']}): "
                     f"{config_src(cfg)},  # {c['shape']}: {c['best']['pct_copy']}% of copy, "
                     f"{c['speedup_vs_torch']}x torch")
    lines.append("}")
    return "\n".join(lines)


def dry_run(sg: Any, a: argparse.Namespace) -> None:
    print(f"plan: shapes {a.shapes}, rows {a.rows}, {a.reps} replays x >= {a.calls} calls")
    for name in a.shapes:
        kind, n, k = SHAPES[name]
        for rows in a.rows:
            cfgs = candidates(sg, kind, rows, n, k, H200_SMS, a.quick)
            print(f"{name} M={rows}: {len(cfgs)} configs: "
                  + "; ".join(config_src(c) for c in cfgs))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    K = import_kernels()
    import blockdraft.kernels.skinny_gemm as sg

    if a.dry_run:
        dry_run(sg, a)
        return
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gemm: needs a CUDA device (use --dry-run for the plan only)")
    copy_gbs = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4
    cells = []
    start = time.monotonic()
    for name in a.shapes:
        ws = weights(name)
        for rows in a.rows:
            cell = run_cell(K, sg, name, ws, rows, a, copy_gbs, sms)
            record(a.out, {k: v for k, v in cell.items() if k != "sweep"})
            cells.append(cell)
        del ws
        torch.cuda.empty_cache()
    print(f"bench_gemm: {len(cells)} cells in {time.monotonic() - start:.0f} s")
    md = table(cells)
    src = suggested(sg, cells)
    print("\n" + md + "\n")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gemm.json").write_text(json.dumps({"copy_gb_per_s": copy_gbs, "cells": cells},
                                                    indent=1))
        (a.out / "gemm.md").write_text(md + "\n\n```python\n" + src + "\n```\n")
    print("# suggested default table for python/blockdraft/kernels/skinny_gemm.py:\n" + src)


if __name__ == "__main__":
    main()
