"""The report of a run: markdown tables, PNG charts, and the files written under ``--out``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from blockdraft.bench.figures import fmt
from blockdraft.bench.side_by_side import side_by_side_markdown
from blockdraft.bench.spec import spec_markdown
from blockdraft.bench.target import target_markdown
from blockdraft.bench.timing import timing_method

log = logging.getLogger(__name__)


def to_markdown(result: dict[str, Any]) -> str:
    """The result as markdown tables."""
    env = result["environment"]
    lines = [
        f"# blockdraft bench: shape `{result['shape']['name']}`, {result['dtype']}",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
    ]
    sec = result["sections"]
    if "propose" in sec:
        lines += _propose_md(sec["propose"], result["shape"]["block_size"], env["device"])
    if "reference" in sec:
        lines += _reference_md(sec["reference"], sec.get("propose", []))
    if "host" in sec:
        lines += _host_md(sec["host"])
    if "kernels" in sec and sec["kernels"]:
        lines += _kernels_md(sec["kernels"])
    if "e2e" in sec:
        lines += _e2e_md(sec["e2e"])
    if sec.get("target"):
        lines += target_markdown(sec["target"])
    if sec.get("spec"):
        lines += spec_markdown(sec["spec"])
        lines += side_by_side_markdown(result)
    if result.get("errors"):
        lines += ["## Errors", ""]
        for name, tb in result["errors"].items():
            lines += [f"### {name}", "", "```", tb.strip(), "```", ""]
    return "\n".join(lines)


def _propose_md(recs: list[dict[str, Any]], b: int, device: str) -> list[str]:
    how = f"{timing_method(device)} around the call"
    if torch.device(device).type == "cuda":
        # The call's own host sync (drafts to the host) ends it, so the events span the full
        # latency a caller sees, not just the queued device work.
        how += ", which ends in a host sync"
    lines = [
        f"## Propose latency (ms; {how})",
        "",
        "| ctx | n | median | p90 | plain path median | loop of n `propose` | batched speed-up "
        f"| precompute 1 row/seq | precompute {b} rows/seq | MB/seq (acc + K/V) | = formula |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in recs:
        mem = r["memory_per_seq"]
        pre = r["precompute_ms"]
        lines.append(
            f"| {r['context']} | {r['batch']} | {fmt(r['latency_ms']['median'])} | "
            f"{fmt(r['latency_ms']['p90'])} | {fmt(r.get('latency_plain_ms', {}).get('median'))} | "
            f"{fmt(r['loop_ms']['median'])} | {fmt(r['speedup_vs_loop'], 2)}x | "
            f"{fmt(pre['rows_1']['median'])} | {fmt(pre[f'rows_{b}']['median'])} | "
            f"{mem['total_bytes'] / 2**20:.1f} | {'yes' if mem['equal_to_formula'] and r['pool_check'] else 'NO'} |"
        )
    lines.append("")
    if recs:
        lines += [
            "Memory per sequence (first cell): "
            + ", ".join(f"{k} {v}" for k, v in recs[0]["memory_per_seq"].items()),
            "",
        ]
    return lines


def _reference_md(recs: list[dict[str, Any]], propose: list[dict[str, Any]]) -> list[str]:
    ours = {r["context"]: r["latency_ms"]["median"] for r in propose if r["batch"] == 1}
    lines = [
        "## Reference drafter forward, batch 1 (ms; dflash 0.1.0, same weights and inputs)",
        "",
        "| ctx | SDPA backend | median | p90 | blockdraft propose n=1 | blockdraft speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in recs:
        fm = r.get("forward_ms", {})
        mine = ours.get(r["context"])
        sp = fm["median"] / mine if mine and fm.get("median") else None
        err = f" ({r['error']})" if "error" in r else ""
        lines.append(
            f"| {r['context']} | {r['backend']}{err} | {fmt(fm.get('median'))} | "
            f"{fmt(fm.get('p90'))} | {fmt(mine)} | {fmt(sp, 2)}{'x' if sp else ''} |"
        )
    lines.append("")
    return lines


def _host_md(recs: list[dict[str, Any]]) -> list[str]:
    lines = ["## Host CPU time per call (µs, cProfile; profiler overhead included)", ""]
    for r in recs:
        if r.get("kind") == "core_bookkeeping":
            lines += [
                f"Rust core bookkeeping alone (no profiler): {fmt(r['us_per_seq_step'], 2)} µs "
                "per sequence per step (append, plan + confirm precompute, note, verify).",
                "",
            ]
            continue
        parts = ", ".join(f"{k} {fmt(v, 1)}" for k, v in r["profile_us_per_call"].items())
        lines += [
            f"- ctx {r['context']}, n {r['batch']}: wall {fmt(r['wall_us_per_call_profiled'], 1)} µs "
            f"per call under the profiler; {parts}; blockdraft's own (Python + Rust) "
            f"{fmt(r['blockdraft_own_us_per_call'], 1)} µs = "
            f"{fmt(r['blockdraft_own_us_per_seq'], 2)} µs per sequence",
        ]
        if "glue_us_per_seq" in r:
            lines.append(
                f"  - unprofiled, device work stubbed out: {fmt(r['glue_us_per_call'], 1)} µs "
                f"per call = **{fmt(r['glue_us_per_seq'], 2)} µs per sequence** of blockdraft "
                "host work (Python glue + Rust core + its small copies)"
            )
        if "commit_us_per_seq" in r:
            lines.append(
                f"  - the step's `commit_ctx` of one row: {fmt(r['commit_us_per_seq'], 2)} µs "
                f"per sequence; its verify record: {fmt(r.get('verify_us_per_seq'), 2)} µs; "
                f"**a whole step (commit + propose + verify): "
                f"{fmt(r['step_us_per_seq'], 2)} µs per sequence**"
            )
    lines.append("")
    return lines


def _kernels_md(recs: list[dict[str, Any]]) -> list[str]:
    lines = ["## Device time per kernel (µs per call, torch.profiler)", ""]
    for r in recs:
        lines.append(
            f"- ctx {r['context']}, n {r.get('batch', 1)}, {r['path']} path: "
            f"{fmt(r['device_us_per_call'], 1)} µs device, "
            f"{fmt(r.get('wall_us_per_call'), 1)} µs wall per call; "
            + "; ".join(f"{k['kernel'][:60]} {fmt(k['us_per_call'], 1)}" for k in r["kernels"][:8])
        )
    lines.append("")
    return lines


def _e2e_md(recs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## End to end, batch 1 (ms per speculative step; random pair, tau ~ 1)",
        "",
        "SDPA backend: the process setting both run under; blockdraft's engine picks its own "
        "(every backend but cuDNN, its `sdpa_backends` default). The last column is the "
        "engine told to take torch's choice instead (`sdpa_backends=None`).",
        "",
        "| ctx | SDPA backend | blockdraft | its drafter share | reference dflash_generate | its drafter share "
        "| speed-up | blockdraft on torch's choice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in recs:
        bd = r.get("blockdraft", {})
        rf = r.get("reference", {})
        tc = r.get("blockdraft_torch_choice", {})
        lines.append(
            f"| {r['context']} | {r['backend']} | {fmt(bd.get('ms_per_step'), 2)} | "
            f"{fmt(bd.get('drafter_share'), 2)} | {fmt(rf.get('ms_per_step'), 2)} | "
            f"{fmt(rf.get('drafter_share'), 2)} | {fmt(r.get('speedup'), 2)} | "
            f"{fmt(tc.get('ms_per_step'), 2)} |"
        )
    lines.append("")
    return lines


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG charts (latency vs context per batch; batched speed-up vs batch per context).
    Returns the files written; none without matplotlib or without a propose section."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        log.warning("matplotlib is not installed: no plots")
        return []
    recs = result["sections"].get("propose")
    if not recs:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result["shape"]["name"]

    def chart(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
              title: str, file: str, log2_x: bool) -> Path:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in series.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if log2_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name}: {title}")
        ax.legend()
        path = out_dir / file
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    batches = sorted({r["batch"] for r in recs})
    contexts = sorted({r["context"] for r in recs})
    return [
        chart(
            {f"n={n}": [(r["context"], r["latency_ms"]["median"]) for r in recs if r["batch"] == n]
             for n in batches},
            "context rows", "propose latency, median (ms)", "latency vs context",
            "latency_vs_context.png", log2_x=True,
        ),
        chart(
            {f"ctx={c}": [(r["batch"], r["speedup_vs_loop"]) for r in recs if r["context"] == c]
             for c in contexts},
            "batch size n", "speed-up of propose_batch over n x propose", "batching speed-up",
            "speedup_vs_batch.png", log2_x=False,
        ),
    ]


def write_outputs(result: dict[str, Any], out_dir: Path, *, plots: bool = False) -> list[Path]:
    """``bench.json`` and ``bench.md`` (and PNGs with ``plots``) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "bench.json"
    js.write_text(json.dumps(result, indent=1, default=str))
    md = out_dir / "bench.md"
    md.write_text(to_markdown(result))
    files = [js, md]
    if plots:
        files += plot(result, out_dir)
    return files
