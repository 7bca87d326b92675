"""Warm-up: compile every kernel variant and capture every CUDA graph a request can reach,
before any request arrives.

Nothing here names a kernel or a graph: warm-up drives real work through the paths requests
take, so whatever a later change adds to those paths is warmed as well. Kernel variants
depend only on shapes and on a few length classes (batch sizes and row counts rounded up to
powers of two, the attention's context splits; see the kernels' launchers), so one pass over
those classes reaches them all:

1. target forwards (the runtime's): for each class of sequences per forward (the graph
   buckets) and rows per sequence (powers of two up to a prefill chunk; any number up to a
   verify block), one eager forward, and one forward per graph bucket and graph rows (decode,
   verify) through the graph path, capturing it;
2. requests through the engine: one prompt of each length class (powers of two up to
   ``max_prompt``; the drafter's context splits follow the context), greedy and with a
   grammar mask; then for each batch bucket a batch greedy, sampled and masked, where after
   the first step the proposer's graph of each staging capacity of that bucket is captured
   too (how many rows a step stages depends on how many drafts are accepted, which warm-up
   does not choose).

The engine restores its request ids and counters afterwards; every page is back in its pool.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockdraft.cuda_graphs import default_buckets
from blockdraft.sampling import SamplingParams

if TYPE_CHECKING:
    from blockdraft.engine.engine import SpeculativeEngine
    from blockdraft.target import TargetRuntime

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called after each unit of warm-up work."""

_SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did.

    Attributes:
        seconds: wall time.
        forwards: target forwards run directly on the runtime.
        requests: requests run through the engine.
        compiles: Triton kernel variants compiled (or loaded from Triton's disk cache).
        captures: CUDA graphs captured.
    """

    seconds: float
    forwards: int
    requests: int
    compiles: int
    captures: int


def pow2_upto(most: int) -> list[int]:
    """``1, 2, 4, ...`` up to ``most``, and ``most`` itself."""
    out = [1]
    while out[-1] * 2 <= most:
        out.append(out[-1] * 2)
    if out[-1] != most:
        out.append(most)
    return out


def _prompt(length: int, vocab: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % vocab for i in range(length)]


def _forward_shapes(rt: TargetRuntime, max_batch: int, block: int) -> list[tuple[int, int]]:
    """(sequences, rows each) of the eager forwards: every class a prefill chunk (at most
    ``prefill_chunk`` rows in all) or a verify of mixed blocks (at most ``block`` rows each)
    can fall in."""
    shapes = []
    for n in default_buckets(max_batch):
        for rows in pow2_upto(max(rt.prefill_chunk, block)):
            # A ragged chunk reaches (n, rows) when its longest prompt is in the rows class
            # (over rows / 2) and the other n - 1 hold a row each.
            if rows <= rt.max_seq_len and (rows // 2 + n <= rt.prefill_chunk or rows <= block):
                shapes.append((n, rows))
    return shapes


def _graph_shapes(rt: TargetRuntime, max_batch: int) -> list[tuple[int, int]]:
    graphs = rt.graphs
    if graphs is None:
        return []
    return [(n, rows) for rows in graphs.rows for n in graphs.buckets
            if n <= max_batch and rows <= rt.max_seq_len]


def _runtime_forward(rt: TargetRuntime, n: int, rows: int, logits: str) -> bool:
    """One forward of ``n`` fresh sequences of ``rows`` rows each; ``False`` when the pool
    cannot hold them now. Every page goes back."""
    if rt.pool.num_free < n * rt.pages_for(rows):
        return False
    seqs = []
    try:
        for _ in range(n):
            seqs.append(rt.new_sequence(rows))
        rt.forward(seqs, [_prompt(rows, rt.vocab_size, i) for i in range(n)], logits=logits)
    finally:
        rt.free(seqs)
    return True


def prompt_lengths(engine: SpeculativeEngine, max_prompt: int | None) -> list[int]:
    """The single-prompt lengths warm-up runs: 1, 2, 3, then powers of two up to
    ``max_prompt`` (default: the longest prompt the engine takes with a new token, at most
    16384)."""
    room = engine.max_seq_len - 1
    most = min(room, 1 << 14) if max_prompt is None else min(room, max_prompt)
    if most < 1:
        return []
    return sorted({n for n in (1, 2, 3) if n <= most} | set(pow2_upto(most)))


def _allow_all(vocab: int) -> Callable[[int, object], torch.Tensor]:
    mask = torch.full((math.ceil(vocab / 32),), -1, dtype=torch.int32)
    return lambda index, generated: mask


def _new_tokens(engine: SpeculativeEngine, longest: int) -> int:
    """New tokens for a warm-up request whose prompt has at most ``longest`` tokens: a full
    verify block and the tails (``B + 1``), fewer when the engine's ``max_seq_len`` holds less
    (an engine sized for one short request)."""
    return min(engine.block_size + 1, engine.max_seq_len - longest)


def _run_batch(engine: SpeculativeEngine, n: int, *, sampling: SamplingParams | None,
               masked: bool, capture_stages: bool) -> int:
    """``n`` short ragged prompts through the engine (``B + 1`` new tokens: a full verify
    block, then the tails); with ``capture_stages``, after the first step every staging
    capacity of the proposer's graph bucket is captured on the live sequences."""
    vocab = engine.proposer.head.vocab_in
    mask = _allow_all(vocab) if masked else None
    prompts = [_prompt(2 + i % 3, vocab, i) for i in range(n)]
    new = _new_tokens(engine, 4)
    if new < 1:
        return 0
    if not capture_stages:
        engine.generate(prompts, max_new_tokens=new, sampling=sampling,
                        grammar_bitmask_fn=mask, generator=torch.Generator().manual_seed(n))
        return n
    rids = [engine.submit(p, max_new_tokens=new, sampling=sampling) for p in prompts]
    try:
        engine.step()
        runner = engine.proposer.graph_runner
        if runner is not None and runner.disabled is None:
            size = runner.bucket_for(n)
            bucket = runner.bucket(size) if size is not None else None
            if size is not None and bucket is not None:
                # These launches write the graphs' outputs, which the drafts the step
                # launched ahead may view: the next step drafts afresh.
                engine.drafts.drop_ahead()
                with torch.inference_mode():
                    for cap in runner.stage_caps(size):
                        # The bucket's metadata is the last call's, of live sequences: the
                        # replay stores the same K/V again and its drafts are not used.
                        runner.launch(bucket, n, cap)
        for _ in engine.stream(rids):
            pass
    finally:
        for rid in rids:
            engine.cancel(rid)
            engine.forget(rid)
    return n


def warm_up(engine: SpeculativeEngine, *, max_prompt: int | None = None, full: bool = True,
            progress: Progress | None = None) -> tuple[int, int]:
    """Drive the work described in the module docstring through ``engine`` (idle, with no
    request waiting or running). ``full=False`` (where nothing compiles or captures: the
    torch kernels, no CUDA graphs) runs the same paths once each: prompt lengths up to 3,
    the sampled and masked batches at the largest bucket only. Returns ``(forwards,
    requests)`` run."""
    rt = engine.runtime
    block = engine.block_size
    lengths = prompt_lengths(engine, max_prompt if full else 3)
    buckets = default_buckets(engine.max_active)
    runner = engine.proposer.graph_runner
    if runner is not None:
        buckets = sorted(set(buckets) | {b for b in runner.buckets if b <= engine.max_active})
    eager = _forward_shapes(rt, engine.max_active, block) if rt is not None else []
    graphed = _graph_shapes(rt, engine.max_active) if rt is not None else []
    # (batch size, sampling, masked, capture the staging capacities)
    batches: list[tuple[int, SamplingParams | None, bool, bool]] = [
        (n, None, False, True) for n in buckets]
    batches += [(n, kind, kind is None, False) for n in (buckets if full else buckets[-1:])
                for kind in (_SAMPLED, None)]
    total = len(eager) + len(graphed) + 2 * len(lengths) + len(batches)
    done = forwards = requests = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if rt is not None:
        for n, rows in eager:
            forwards += _runtime_forward(rt, n, rows, "last")
            tick()
        for n, rows in graphed:
            # equal rows per sequence with every row's logits: the graph path
            forwards += _runtime_forward(rt, n, rows, "all")
            tick()
    vocab = engine.proposer.head.vocab_in
    for length in lengths:
        for masked in (False, True):
            engine.generate([_prompt(length, vocab)], max_new_tokens=_new_tokens(engine, length),
                            grammar_bitmask_fn=_allow_all(vocab) if masked else None)
            requests += 1
            tick()
    for n, sampling, masked, stages in batches:
        requests += _run_batch(engine, n, sampling=sampling, masked=masked, capture_stages=stages)
        tick()
    if engine.proposer.device.type == "cuda":
        torch.cuda.synchronize(engine.proposer.device)
    return forwards, requests


def timed(run: Callable[[], tuple[int, int]], compiles: Callable[[], int],
          captures: Callable[[], int]) -> WarmupReport:
    """``run`` timed, with the compiles and captures it caused."""
    c0, g0 = compiles(), captures()
    start = time.perf_counter()
    forwards, requests = run()
    seconds = time.perf_counter() - start
    report = WarmupReport(seconds, forwards, requests, compiles() - c0, captures() - g0)
    log.info("warm-up: %.1f s, %d target forwards, %d requests, %d kernels compiled, "
             "%d CUDA graphs captured", report.seconds, report.forwards, report.requests,
             report.compiles, report.captures)
    return report


__all__ = ["Progress", "WarmupReport", "prompt_lengths", "timed", "warm_up"]
