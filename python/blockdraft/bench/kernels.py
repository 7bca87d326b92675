"""The kernels section: device time per kernel of proposals (torch.profiler), CUDA only."""

from __future__ import annotations

import contextlib
import logging
import statistics
from functools import partial
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.figures import fmt
from blockdraft.bench.timing import time_ms
from blockdraft.bench.workload import Seqs, make_proposer, release
from blockdraft.devices import sync
from blockdraft.pair import Shape

log = logging.getLogger(__name__)


def bench_kernels(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """Device time per kernel (torch.profiler), graph and plain paths: batch-1 proposals at
    every context, and ``propose_batch`` at the host profile's batch sizes and context.

    Also per cell: the wall time of one call (the same calls, unprofiled) against the device
    time, so the gap (host work the device waited for) is visible. ``[]`` off CUDA."""
    if device.type != "cuda":
        return []
    out: list[dict[str, Any]] = []
    calls = 5
    wide = cfg.wide_context()
    cells = [(ctx, 1) for ctx in cfg.contexts]
    cells += [(wide, n) for n in cfg.profiled_batches() if n > 1]
    for ctx, n in cells:
        prop = make_proposer(drafter, target, shape, ctx, n, "auto", 4 * (calls + 8) + 64)
        gen = torch.Generator(device=device).manual_seed(cfg.seed + 3)
        seqs = Seqs(prop, shape, ctx, n, gen)
        idx = list(range(n))
        try:
            for label in ("graph", "plain"):
                path = prop.eager() if label == "plain" else contextlib.nullcontext()
                with path:
                    rec = _profile_cell(seqs, idx, calls, device)
                rec = {"context": ctx, "batch": n, "path": label, **rec}
                log.info(
                    "kernels ctx %d n %d %s path: %s µs device, %s µs wall per call",
                    ctx,
                    n,
                    label,
                    fmt(rec["device_us_per_call"], 1),
                    fmt(rec["wall_us_per_call"], 1),
                )
                out.append(rec)
        finally:
            seqs.free()
            release(prop)
            del seqs, prop
    return out


def _profile_cell(seqs: Seqs, idx: list[int], calls: int, device: torch.device) -> dict[str, Any]:
    """Unprofiled wall times, then a torch.profiler trace, of ``calls`` steady-state steps."""
    from torch.profiler import ProfilerActivity, profile

    seqs.warm(idx, 2)
    wall = []
    for _ in range(calls):
        seqs.advance(idx)
        wall.append(time_ms(partial(seqs.propose_batch, idx), device))
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            seqs.advance(idx)
            seqs.propose_batch(idx)
        sync(device)
    rows = []
    total = 0.0
    for evt in p.key_averages():
        dev_us = float(getattr(evt, "device_time_total", 0.0) or 0.0)
        if dev_us <= 0:
            continue
        total += dev_us
        rows.append({"kernel": evt.key[:90], "us_per_call": dev_us / calls,
                     "launches_per_call": evt.count / calls})
    rows.sort(key=lambda r: -float(r["us_per_call"]))
    return {
        "device_us_per_call": total / calls,
        "wall_us_per_call": statistics.median(wall) * 1e3,
        "kernels": rows[:25],
    }
