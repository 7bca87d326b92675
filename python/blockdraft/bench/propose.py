"""The propose section: latency of ``propose`` / ``propose_batch`` per context and batch size.

Per cell: the call's latency (median, p90), the plain (no CUDA graph) path's on the same
states, the same ``n`` sequences through ``n`` ``propose`` calls, the ctx K/V precompute of 1
and B rows per sequence, and drafter memory per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.figures import fmt
from blockdraft.bench.memory import state_memory
from blockdraft.bench.timing import cell_times
from blockdraft.bench.workload import Seqs, make_proposer, release
from blockdraft.pair import Shape

log = logging.getLogger(__name__)


def bench_propose(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """The propose section: one record per (context, batch)."""
    out: list[dict[str, Any]] = []
    max_batch = max(cfg.batches)
    per_cell = 2 * (cfg.warmup + cfg.reps) + cfg.warmup + cfg.loop_reps + 4
    grow = len(cfg.batches) * per_cell + 2 * shape.block_size + 64
    for ctx in cfg.contexts:
        gen = torch.Generator(device=device).manual_seed(cfg.seed + ctx)
        prop = make_proposer(drafter, target, shape, ctx, max_batch, "auto", grow)
        seqs = Seqs(prop, shape, ctx, max_batch, gen)
        try:
            for n in cfg.batches:
                out.append(_cell(cfg, shape, prop, seqs, ctx, n, device))
        finally:
            seqs.free()
            release(prop)
            del seqs, prop
    return out


def _cell(
    cfg: BenchConfig, shape: Shape, prop: Any, seqs: Seqs, ctx: int, n: int, device: torch.device
) -> dict[str, Any]:
    idx = list(range(n))
    step = partial(seqs.propose_batch, idx)
    before = partial(seqs.advance, idx)
    rec: dict[str, Any] = {"context": ctx, "batch": n}
    runner = prop.graph_runner
    rec["graph_mode"] = None if runner is None else runner.mode
    rec["latency_ms"] = cell_times(step, before, cfg.reps, cfg.warmup, device)
    if runner is not None:
        with prop.eager():
            rec["latency_plain_ms"] = cell_times(step, before, cfg.reps, cfg.warmup, device)
        rec["graph_disabled"] = runner.disabled
    loop = cell_times(partial(seqs.propose_loop, idx), before, cfg.loop_reps, 1, device)
    rec["loop_ms"] = loop
    rec["speedup_vs_loop"] = loop["median"] / rec["latency_ms"]["median"]
    rec["precompute_ms"] = {
        "rows_1": precompute_times(prop, seqs, idx, 1, cfg, device),
        f"rows_{shape.block_size}": precompute_times(prop, seqs, idx, shape.block_size, cfg, device),
    }
    mem = state_memory(prop, seqs.states[0])
    if seqs.alloc_bytes:
        mem["acc_alloc_delta_bytes"] = seqs.alloc_bytes[0]
    rec["memory_per_seq"] = mem
    rec["pool_check"] = all(state_memory(prop, seqs.states[i])["pages_within_bound"] for i in idx)
    log.info(
        "propose ctx %d n %d: %s ms (p90 %s), loop %s ms, plain %s ms",
        ctx,
        n,
        fmt(rec["latency_ms"]["median"]),
        fmt(rec["latency_ms"]["p90"]),
        fmt(loop["median"]),
        fmt(rec.get("latency_plain_ms", {}).get("median")),
    )
    return rec


def precompute_times(
    prop: Any, seqs: Seqs, idx: Sequence[int], rows: int, cfg: BenchConfig, device: torch.device
) -> dict[str, float]:
    """The proposer's ctx K/V precompute of the last ``rows`` committed rows of each sequence,
    rewritten in place with the same values."""
    items = []
    for i in idx:
        st = seqs.states[i]
        c = st.ctx_committed
        plan = SimpleNamespace(
            row_start=c - rows,
            row_end=c,
            positions=st.ctx_positions[c - rows : c],
            slots=st.ctx.slot_mapping()[c - rows : c],
        )
        items.append((st, plan))
    return cell_times(lambda: prop.forward.store_plans(items), lambda: None, cfg.reps, cfg.warmup, device)
