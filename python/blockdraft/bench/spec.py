"""The ``spec`` section: the speculative engine's step, end to end on blockdraft's runtime.

Per (context C, batch n) cell: n requests with random prompts of C tokens are submitted and
prefilled, a few steps warm the graphs up, then ``reps`` steps are timed (``engine.step()``, the
device drained after each): ms per step and tokens per step (tau: a random pair accepts almost
nothing, so the step time is the system's cost). Beside it, on the same runtime and
sequences' shapes, one target-only decode step (n rows through the captured decode graph).

``run_ms`` times ``reps`` steps run back to back, the device drained only before the first:
each step from the previous one's return to its own (a step returns after its read of the
verify's choices, so this is the pace a server's loop sees, where one step's device work may
overlap the host work around the next: the drafts launched ahead, ``BLOCKDRAFT_DRAFT_AHEAD``,
run on the device while the host finishes a step). ``step_ms`` drains the device after each
step, so no step's work overlaps the next's there.

Each cell runs once per drafter window cap of ``cfg.spec_caps`` (the default cap, and e.g.
uncapped), so a prompt as long as the cap is measured sliding its window and not, on the same
pair in one run.

``host_us`` is the step's host work alone: the same steps with every CUDA-graph replay (the
proposer's and the runtime's) doing nothing, so what is timed is Python, the Rust core and the
small metadata copies (off CUDA it is the whole step).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.figures import fmt
from blockdraft.bench.timing import summarize
from blockdraft.bench.workload import window_cap
from blockdraft.devices import sync
from blockdraft.pair import Shape

log = logging.getLogger(__name__)


@contextlib.contextmanager
def no_replays() -> Iterator[None]:
    """Inside the block a CUDA graph's replay does nothing: both graph paths then queue no
    device work beyond their small copies, and a step's time is its host work. A graph's
    first replay inside the block still runs: a graph captured inside it (a staging capacity
    the steps had not reached before) would otherwise leave its outputs unwritten, and the
    engine would read that memory as tokens."""
    real = torch.cuda.CUDAGraph.replay
    replayed: set[int] = set()

    def first_only(self: torch.cuda.CUDAGraph) -> None:
        if id(self) not in replayed:
            replayed.add(id(self))
            real(self)

    torch.cuda.CUDAGraph.replay = first_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.CUDAGraph.replay = real  # type: ignore[method-assign]


def bench_spec(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """One record per (context, batch, window cap) cell: ms per speculative step and per
    target-only decode step, tau, and the step's host work alone."""
    from blockdraft.engine import SpeculativeEngine

    gen = torch.Generator().manual_seed(cfg.seed + 11)
    block = shape.block_size
    out = []
    cells = [(ctx, n, cap) for ctx in cfg.contexts for n in cfg.batches for cap in cfg.spec_caps]
    for ctx, n, cap in cells:
        steps = cfg.warmup + 3 * cfg.reps  # timed one by one, back to back, host work alone
        new_tokens = (steps + 4) * block
        with window_cap(cap):
            engine = SpeculativeEngine(
                target, drafter, runtime="blockdraft",
                max_seq_len=max(cfg.max_seq_len or 0, ctx + new_tokens + block),
                max_active=n, max_batch=min(n, 32),
            )
        window = engine.proposer.ceiling
        rids = []
        for _ in range(n):
            prompt = torch.randint(0, shape.vocab - 1, (ctx,), generator=gen).tolist()
            rids.append(engine.submit(prompt, max_new_tokens=new_tokens))
        engine.step()  # admission + prefill + the first step
        waiting = [rid for rid in rids if engine.request(rid).target_seq is None]
        if waiting:
            raise RuntimeError(f"{len(waiting)} of the cell's {n} requests at {ctx} tokens were not "
                               "admitted: the engine's page pools are too small for this cell")
        # Timed too: with a prompt as long as the cap, the window's one slide (and the
        # recompute of the rows it keeps) falls in these first steps, not in the timed ones.
        warm = []
        for _ in range(cfg.warmup):
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            warm.append((time.perf_counter() - t0) * 1e3)
        times, produced = [], 0
        for _ in range(cfg.reps):
            sync(device)
            t0 = time.perf_counter()
            events = engine.step()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            produced += sum(len(e.tokens) for e in events)
        sync(device)
        paced, last = [], time.perf_counter()
        for _ in range(cfg.reps):
            engine.step()
            now = time.perf_counter()
            paced.append((now - last) * 1e3)
            last = now
        sync(device)
        rec: dict[str, Any] = {
            "context": ctx, "batch": n, "block": block, "ctx_cap": cap, "window": window,
            "max_seq_len": engine.max_seq_len,
            "draft_length": engine.draft_length, "step_ms": summarize(times),
            "run_ms": summarize(paced),
            "tau": produced / (cfg.reps * n), "warmup_ms": warm,
        }
        seqs = [engine.request(rid).target_seq for rid in rids]
        rec["decode_ms"] = _decode_step(engine.runtime, seqs, cfg, device)
        host = []
        with no_replays() if device.type == "cuda" else contextlib.nullcontext():
            for _ in range(cfg.reps):
                sync(device)
                t0 = time.perf_counter()
                engine.step()
                host.append((time.perf_counter() - t0) * 1e6)
        sync(device)
        rec["host_us"] = summarize(host)
        engine.close()
        del engine, seqs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.info(
            "spec step at %d x %d, drafter window %d: %s ms (tau %s), target-only decode "
            "%s ms, host %s us, back to back %s ms",
            ctx, n, window, fmt(rec["step_ms"]["median"]), fmt(rec["tau"], 2),
            fmt(rec["decode_ms"]["median"]), fmt(rec["host_us"]["median"], 1),
            fmt(rec["run_ms"]["median"]),
        )
        out.append(rec)
    return out


def _decode_step(rt: Any, seqs: list[Any], cfg: BenchConfig, device: torch.device) -> dict[str, float]:
    """A target-only decode step over ``seqs`` (one row each, left pending, so each call
    overwrites the last): the forward and the argmax to the host."""
    times = []
    for i in range(cfg.warmup + cfg.reps):
        sync(device)
        t0 = time.perf_counter()
        got = rt.forward(seqs, [[1]] * len(seqs), logits="last", capture=False)
        torch.argmax(got.logits, dim=-1).tolist()
        if i >= cfg.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times)


def spec_markdown(recs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Speculative step on blockdraft's runtime (random pair: tau ~ 1)",
        "",
        "| context | batch | drafter window cap | drafts per step | step ms | steps back to back ms "
        "| tau | target-only decode ms | host us per step | warm-up steps ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in recs:
        cap = r.get("ctx_cap")
        label = "environment" if cap is None else ("uncapped" if cap == 0 else str(cap))
        lines.append(
            f"| {r['context']} | {r['batch']} | {label} (window ceiling {r.get('window', '-')}) "
            f"| {r.get('draft_length', '-')} | {fmt(r['step_ms']['median'])} "
            f"| {fmt(r['run_ms']['median']) if 'run_ms' in r else '-'} | {fmt(r['tau'], 2)} "
            f"| {fmt(r['decode_ms']['median'])} | {fmt(r['host_us']['median'], 1)} "
            f"| {' / '.join(fmt(t) for t in r.get('warmup_ms', [])) or '-'} |"
        )
    return [*lines, ""]


__all__ = ["bench_spec", "no_replays", "spec_markdown"]
