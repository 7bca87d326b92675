"""The host section: where the host time of ``propose`` goes, and the Rust core's share.

A cProfile of steady-state calls split into blockdraft Python, the Rust core, kernel launches
and waiting for the device; the same calls unprofiled with the device work stubbed out (the
host work alone); and the core's per-step bookkeeping on its own.
"""

from __future__ import annotations

import contextlib
import cProfile
import logging
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.figures import fmt
from blockdraft.bench.workload import Seqs, make_proposer, release
from blockdraft.devices import sync
from blockdraft.pair import Shape

log = logging.getLogger(__name__)


def classify(func: tuple[str, int, str]) -> str:
    """The bucket of a cProfile entry ``(file, line, function)``."""
    filename, _, name = func
    text = f"{filename}:{name}"
    if "ContextState" in text or "PrecomputePlan" in text or "BlockPool" in text or "_core" in text:
        return "rust_core"
    if "split_bands" in name or "batch_decline_reason" in name or "propose_batch_max" in name:
        return "rust_core"
    if "tolist" in name or "synchronize" in name or "'item'" in name:
        return "device_wait"
    if "/blockdraft/kernels/" in filename:
        return "kernel_launchers"
    if "/blockdraft/" in filename:
        return "blockdraft_python"
    if "triton" in filename:
        return "triton_launch"
    if "replay" in name:
        return "graph_replay"
    return "torch_and_other"


def bench_host(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """cProfile of steady-state ``propose``/``propose_batch`` calls, split by where the host time
    goes, plus the core's per-step bookkeeping without the profiler."""
    ctx = cfg.wide_context()
    batches = cfg.profiled_batches()
    calls = max(10, cfg.reps)
    # Every sequence may take part in every cell: the profiled calls, then the glue's own.
    grow = (2 * calls + cfg.warmup + 8) * len(batches) + 64
    # Off CUDA the graph path's bookkeeping runs eagerly ("static"): the same host work.
    graphs = "auto" if device.type == "cuda" else "static"
    prop = make_proposer(drafter, target, shape, ctx, max(batches), graphs, grow)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7)
    seqs = Seqs(prop, shape, ctx, max(batches), gen)
    out: list[dict[str, Any]] = []
    try:
        for n in batches:
            idx = list(range(n))
            rec = _profile(seqs, ctx, idx, calls, cfg.warmup, device)
            rec.update(host_glue(prop, seqs, idx, calls))
            log.info(
                "host ctx %d n %d: blockdraft's own %s µs per sequence (profiled), glue %s µs",
                ctx,
                n,
                fmt(rec["blockdraft_own_us_per_seq"], 2),
                fmt(rec.get("glue_us_per_seq"), 2),
            )
            out.append(rec)
        core = bench_core_bookkeeping(prop.page_size, shape, calls=2000)
        log.info("host: Rust core bookkeeping %s µs per sequence-step", fmt(core["us_per_seq_step"], 2))
        out.append(core)
    finally:
        seqs.free()
        release(prop)
        del seqs, prop
    return out


def _profile(
    seqs: Seqs, ctx: int, idx: list[int], calls: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """cProfile of ``calls`` steady-state proposals of ``idx``, split by :func:`classify`."""
    n = len(idx)
    seqs.warm(idx, warmup)
    prof = cProfile.Profile()
    wall = 0.0
    for _ in range(calls):
        seqs.advance(idx)
        sync(device)
        t0 = time.perf_counter()
        prof.enable()
        seqs.propose_batch(idx)
        prof.disable()
        wall += time.perf_counter() - t0
    stats = pstats.Stats(prof)
    buckets: dict[str, float] = {}
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    top: list[tuple[float, str]] = []
    for func, (_, _, tottime, _, _) in raw.items():
        kind = classify(func)
        buckets[kind] = buckets.get(kind, 0.0) + tottime
        top.append((tottime, f"{Path(func[0]).name}:{func[2]}"))
    top.sort(reverse=True)
    per_call_us = {k: v / calls * 1e6 for k, v in sorted(buckets.items())}
    own = per_call_us.get("blockdraft_python", 0.0) + per_call_us.get("rust_core", 0.0)
    return {
        "context": ctx,
        "batch": n,
        "calls": calls,
        "wall_us_per_call_profiled": wall / calls * 1e6,
        "profile_us_per_call": per_call_us,
        "blockdraft_own_us_per_call": own,
        "blockdraft_own_us_per_seq": own / n,
        "top_functions_us_per_call": [
            {"function": name, "us": t / calls * 1e6} for t, name in top[:15]
        ],
    }


@contextlib.contextmanager
def stub_launch(runner: Any, launch: Callable[[Any, int, int], torch.Tensor]) -> Iterator[None]:
    """Inside the block the graph runner's device work (``GraphRunner.launch``: the replay, or
    the static forward) is ``launch(bucket, n, cap)``, so what is left to time is the host
    work around it."""
    runner.launch = launch
    try:
        yield
    finally:
        del runner.launch


def host_glue(prop: Any, seqs: Seqs, idx: list[int], calls: int) -> dict[str, Any]:
    """blockdraft's own host work per call without the profiler: the same steady-state calls
    with the device work (the graph replay) replaced by a ready answer, so what is timed is the
    Python glue, the Rust core and the few small copies it launches (staging rows, metadata).
    Only on the graph path (the steady state on CUDA); ``{}`` when the proposer has none."""
    runner = prop.graph_runner
    if runner is None:
        return {}
    n = len(idx)
    ready = torch.zeros((n, prop.block_gamma - 1), dtype=torch.int64, device=prop.device)
    launched = [0]

    def stub(bucket: Any, m: int, cap: int) -> torch.Tensor:
        launched[0] += 1
        return ready[:m]

    with stub_launch(runner, stub):
        seqs.warm(idx, 3)
        times = []
        commits = []
        verifies = []
        for _ in range(calls):
            sync(prop.device)
            t0 = time.perf_counter()
            seqs.advance(idx, fresh=False)
            commits.append(time.perf_counter() - t0)
            sync(prop.device)
            t0 = time.perf_counter()
            seqs.propose_batch(idx, verify=False)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            seqs.verify(idx)
            verifies.append(time.perf_counter() - t0)
    if launched[0] < calls + 3:
        raise RuntimeError(
            f"host glue: {calls + 3 - launched[0]} calls left the graph path (a table wider "
            "than the graphs?); the measurement would time the plain path"
        )
    per_call = statistics.median(times) * 1e6
    # The step's commit of one new ctx row per sequence (`commit_ctx` at n = 1,
    # `commit_ctx_batch` above, their copy launches included) and its verify record
    # (`after_verify` / `after_verify_batch`).
    commit = statistics.median(commits) * 1e6 / n
    verify = statistics.median(verifies) * 1e6 / n
    return {"glue_us_per_call": per_call, "glue_us_per_seq": per_call / n,
            "commit_us_per_seq": commit, "verify_us_per_seq": verify,
            "step_us_per_seq": per_call / n + commit + verify}


def bench_core_bookkeeping(page_size: int, shape: Shape, calls: int) -> dict[str, Any]:
    """The Rust core's calls of one steady-state step (append 1 row, plan/confirm the K/V,
    note the proposal, record the verify) on a fresh state with pages of ``page_size`` rows,
    without touching any tensor."""
    from blockdraft import BlockPool
    from blockdraft.core import ContextState

    pool = BlockPool(calls // page_size + 2, page_size)
    st = ContextState(pool, 1 << 20, 0)
    pos = 0
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            plan = st.plan_append([pos])
            st.apply_append(plan)
            pre = st.plan_precompute()
            st.confirm_precompute(pre)
            st.note_propose(pos + 1, shape.block_size - 1)
            st.after_verify(0)
            pos += 1
        per = (time.perf_counter() - t0) / calls * 1e6
    finally:
        st.free()
    return {"kind": "core_bookkeeping", "us_per_seq_step": per, "calls": calls}
