"""The quick check: propose latency at a few cells against the proposer's latency targets."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from blockdraft.bench.figures import fmt
from blockdraft.bench.timing import cell_times
from blockdraft.bench.workload import Seqs, make_proposer, release
from blockdraft.pair import Shape

log = logging.getLogger(__name__)

QUICK_TARGETS_MS: dict[tuple[int, int], float] = {(4096, 1): 1.2, (16384, 1): 1.4, (4096, 32): 3.0}
"""Latency targets (ms) per (context, batch) on one H200, bf16, ``qwen3-8b``: ``propose`` at
4K and 16K context, ``propose_batch`` of 32 sequences at 4K."""

DFLASH2_RATIO_TARGET = 1.15
"""A DFlash2 drafter's latency target at each quick cell: at most this times the DFlash
drafter's of the same shape in the same run."""

QUICK_CELLS: tuple[tuple[int, int], ...] = tuple(QUICK_TARGETS_MS)
"""(context, batch) cells of :func:`bench_quick`: the cells with a latency target."""


def bench_quick(
    shape: Shape,
    drafter: Any,
    target: Any,
    device: torch.device,
    *,
    cells: Sequence[tuple[int, int]] = QUICK_CELLS,
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Propose latency (graphs on, then the plain path) for a few cells only, each with its
    own proposer; one record per cell, as in the propose section (no loop or precompute)."""
    out: list[dict[str, Any]] = []
    grow = 2 * (reps + warmup) + 2 * shape.block_size + 64
    for ctx, n in cells:
        gen = torch.Generator(device=device).manual_seed(seed + ctx)
        prop = make_proposer(drafter, target, shape, ctx, n, "auto", grow)
        seqs = Seqs(prop, shape, ctx, n, gen)
        idx = list(range(n))
        step = partial(seqs.propose_batch, idx)
        before = partial(seqs.advance, idx)
        try:
            runner = prop.graph_runner
            rec: dict[str, Any] = {"shape": shape.name, "context": ctx, "batch": n}
            rec["graph_mode"] = None if runner is None else runner.mode
            rec["fused_drafter"] = runner is not None and prop.forward.fused_view() is not None
            rec["latency_ms"] = cell_times(step, before, reps, warmup, device)
            if runner is not None:
                rec["graph_disabled"] = runner.disabled
                rec["graph_replays"] = runner.replays
                with prop.eager():
                    rec["latency_plain_ms"] = cell_times(step, before, reps, warmup, device)
            log.info(
                "quick ctx %d n %d: %s ms (plain %s ms)",
                ctx,
                n,
                fmt(rec["latency_ms"]["median"]),
                fmt(rec.get("latency_plain_ms", {}).get("median")),
            )
            out.append(rec)
        finally:
            seqs.free()
            release(prop)
            del seqs, prop
    return out


def quick_markdown(records: Sequence[dict[str, Any]]) -> str:
    """One table of :func:`bench_quick` records against :data:`QUICK_TARGETS_MS`; records of
    several shapes (e.g. ``qwen3-8b`` and ``qwen3-8b-dflash2`` from one run) side by side, a
    ``*-dflash2`` shape's median also as a ratio to its DFlash shape's at the same cell
    (target :data:`DFLASH2_RATIO_TARGET`)."""
    medians = {(r.get("shape"), r["context"], r["batch"]): r["latency_ms"]["median"] for r in records}
    lines = [
        "| shape | ctx | n | median ms | p90 ms | plain path ms | target ms | vs DFlash | graph | fused drafter |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        lat, plain = r["latency_ms"], r.get("latency_plain_ms", {})
        graph = r.get("graph_mode") or "off"
        if r.get("graph_disabled"):
            graph = f"disabled: {r['graph_disabled']}"
        shape = r.get("shape")
        target = QUICK_TARGETS_MS.get((r["context"], r["batch"]))
        ratio = ""
        if isinstance(shape, str) and shape.endswith("-dflash2"):
            base = medians.get((shape.removesuffix("-dflash2"), r["context"], r["batch"]))
            target = None
            if base:
                ratio = f"{lat['median'] / base:.2f}x (target ≤ {DFLASH2_RATIO_TARGET}x)"
        lines.append(
            f"| {shape or ''} | {r['context']} | {r['batch']} | {fmt(lat['median'])} | "
            f"{fmt(lat['p90'])} | {fmt(plain.get('median'))} | {fmt(target)} | {ratio} | "
            f"{graph} | {'yes' if r.get('fused_drafter') else 'no'} |"
        )
    return "\n".join(lines) + "\n"
