"""The speculative engine's host work of one step on the CPU: median µs per steady-state
`engine.step()` at n = 1 and n = 32 running requests (tiny random pair, fp32, target on
blockdraft's runtime, `graphs="static"`: the graph paths' bookkeeping run eagerly). Each request
has a random prompt of about 100 tokens and room to generate for the whole run (no stop token,
``max_seq_len`` 1024); the draft length is fixed at 7 (the tiny block's ``B - 1``). After
WARMUP steps, REPEATS runs of STEPS steps are timed; the best median is printed.

As ``blockdraft bench --sections spec``'s ``host_us`` does on CUDA (every graph replay doing
nothing), the device work of the two graph paths (the proposer's draft forward, the runtime's
verify forward) runs once per graph shape and is then replaced by its first answer, so what is
timed is Python, the Rust core and the small tensor ops around the forwards. The host's speed
is printed first as a yardstick (:func:`yardstick_us`). ``--compute``
runs the forwards every step instead (the tiny model's CPU compute is then most of the step).
``--ops`` counts the torch operators a step dispatches outside the two forwards (what the
host launches around the graph replays on CUDA) and prints them per step by name.
``--critical`` times the part of each step the device waits on when the drafts stay on the
device: from the host's one read of a step (the verify's choices with the drafts) to the launch
of the next step's drafter, median µs over the steps.
``--profile`` profiles the steps once more with cProfile and prints the top entries by
cumulative and by own time, and the step's own time split into torch's operators (builtins of
torch), the Rust core's calls and the rest (Python):

    PYTHONPATH=python python benchmarks/host_engine_step.py [--batches 1,32] [--steps 200]
        [--warmup 20] [--repeats 3] [--threads 1] [--max-seq-len 1024] [--compute] [--ops]
        [--critical] [--profile] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import time
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockdraft import pair
from blockdraft.engine import SpeculativeEngine, accept

PROMPT = 100
DRAFTS = 7
MAX_SEQ_LEN = 1024  # room for about 850 steps at tau 1; the page tables are 64 pages wide

log = logging.getLogger("host_engine_step")


def build(target: object, drafter: object, n: int, max_seq_len: int = MAX_SEQ_LEN) -> SpeculativeEngine:
    """An engine of ``max_seq_len`` with ``n`` running requests, prefilled and stepped twice."""
    shape = pair.SHAPES["tiny"]
    engine = SpeculativeEngine(target, drafter, runtime="blockdraft", max_seq_len=max_seq_len,
                               max_active=n, max_batch=n, graphs="static",
                               draft_length=DRAFTS)
    gen = torch.Generator().manual_seed(n)
    new = max_seq_len - PROMPT - 3 * engine.block_size
    for _ in range(n):
        prompt = torch.randint(0, shape.vocab - 1, (PROMPT + int(torch.randint(0, 8, (1,), generator=gen)),),
                               generator=gen).tolist()
        engine.submit(prompt, max_new_tokens=new)
    engine.step()
    return engine


class OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched while it is on, except inside the stubbed
    forwards (graph replays on CUDA: no operator of their own reaches the host there)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Critical:
    """Times from the end of each step's read from the device to the next drafter launch."""

    def __init__(self) -> None:
        self.read_at: float | None = None
        self.gaps: list[float] = []

    def read(self) -> None:
        self.read_at = time.perf_counter()

    def launched(self) -> None:
        if self.read_at is not None:
            self.gaps.append((time.perf_counter() - self.read_at) * 1e6)
            self.read_at = None


def watch_reads(clock: Critical) -> None:
    """``clock.read()`` after each step's one read (the verify's choices with the drafts)."""
    real = accept.read_drafted

    def read_drafted(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        clock.read()
        return out

    accept.read_drafted = read_drafted  # type: ignore[assignment]


def stub_forwards(engine: SpeculativeEngine, counter: OpCounter | None = None,
                  clock: Critical | None = None) -> None:
    """The graph paths' device work answers what it answered the first time for the same
    buffers (a replay that does nothing leaves a graph's outputs as they were); ``counter``
    is paused inside them."""
    runner = engine.proposer.graph_runner
    graphs = engine.runtime.graphs if engine.runtime is not None else None
    if runner is None or graphs is None:
        raise SystemExit("the engine has no graph paths to stub (graphs='static' expected)")
    drafts: dict[tuple[int, int], torch.Tensor] = {}
    real_launch = runner.launch

    def launch(bucket: Any, n: int, cap: int) -> torch.Tensor | None:
        if clock is not None:
            clock.launched()
        key = (id(bucket), cap)
        if counter is not None:
            counter.paused += 1
        try:
            if key not in drafts:
                out = real_launch(bucket, bucket.size, cap)
                assert out is not None
                drafts[key] = out.clone()
            return drafts[key][:n]
        finally:
            if counter is not None:
                counter.paused -= 1

    runner.launch = launch  # type: ignore[method-assign]
    forward = graphs.forward
    logits: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    real_run = forward.run

    def run(batch: Any, capture: torch.Tensor | None) -> torch.Tensor:
        if counter is not None:
            counter.paused += 1
        try:
            if id(batch) not in logits:
                logits[id(batch)] = (real_run(batch, capture).clone(),
                                     None if capture is None else capture.clone())
            out, cap = logits[id(batch)]
            if cap is not None and capture is not None:
                capture.copy_(cap)
            return out
        finally:
            if counter is not None:
                counter.paused -= 1

    forward.run = run  # type: ignore[method-assign]


def timed(engine: SpeculativeEngine, n: int, steps: int) -> list[float]:
    """µs per step of ``steps`` steps (stops early, with a warning, once a request ended)."""
    out = []
    for _ in range(steps):
        if engine.num_running < n:
            log.warning("a request ended: %d steps timed", len(out))
            break
        t0 = time.perf_counter()
        engine.step()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def yardstick_us() -> float:
    """Median µs of one small-op round on the host (a tensor built from 64 ints, then one
    in-place add): what most of a step's host work is made of, so figures taken on hosts of
    different speed compare through it."""
    ints = list(range(64))
    times = []
    for i in range(2100):
        t0 = time.perf_counter()
        torch.tensor(ints, dtype=torch.int64).add_(1)
        if i >= 100:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def split(stats: pstats.Stats) -> dict[str, float]:
    """Own time (s) of torch's builtins, the Rust core's and everything else."""
    parts = {"torch": 0.0, "core": 0.0, "python": 0.0}
    for (file, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file == "~" and ("torch" in name or "Tensor" in name):
            parts["torch"] += tt
        elif file == "~" and ("blockdraft" in name or "_core" in name or "builtins.Seq" in name):
            parts["core"] += tt
        else:
            parts["python"] += tt
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compute", action="store_true", help="run the forwards every step")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (1: the small ops are not spread over busy cores)")
    ap.add_argument("--max-seq-len", type=int, default=MAX_SEQ_LEN,
                    help="the engine's max_seq_len (the page tables' width follows it)")
    ap.add_argument("--ops", action="store_true",
                    help="count the torch operators a step dispatches outside the forwards")
    ap.add_argument("--critical", action="store_true",
                    help="time each step's read-to-next-draft gap (what the device waits on)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    shape = pair.SHAPES["tiny"]
    target, drafter = pair.random_pair(shape, "cpu", torch.float32)
    print(f"host yardstick: {yardstick_us():.2f} us (one torch.tensor of 64 ints + one add_)")
    for n in (int(b) for b in args.batches.split(",")):
        engine = build(target, drafter, n, args.max_seq_len)
        counter = OpCounter() if args.ops else None
        clock = Critical() if args.critical else None
        if clock is not None:
            if args.compute:
                raise SystemExit("--critical times the stubbed forwards (leave out --compute)")
            watch_reads(clock)
        if not args.compute:
            stub_forwards(engine, counter, clock)
        with torch.inference_mode():
            timed(engine, n, args.warmup)
            medians = [statistics.median(timed(engine, n, args.steps)) for _ in range(args.repeats)]
            tau = statistics.mean(s for rid in engine.request_ids() for s in engine.request(rid).steps)
            print(f"n={n}: {min(medians):.0f} us/step (medians of {args.repeats} x {args.steps} steps: "
                  f"{', '.join(f'{m:.0f}' for m in medians)}), tau {tau:.2f}")
            if clock is not None:
                runs = []
                for _ in range(args.repeats):
                    clock.gaps.clear()
                    timed(engine, n, args.steps)
                    if not clock.gaps:
                        raise SystemExit("no read-to-draft gap seen: are the drafts left on the device?")
                    runs.append(statistics.median(clock.gaps))
                print(f"n={n}: {min(runs):.0f} us from a step's read to the next draft's launch "
                      f"(medians of {args.repeats} x {args.steps} steps: {', '.join(f'{m:.0f}' for m in runs)})")
            if counter is not None:
                with counter:
                    timed(engine, n, args.steps)
                per_step = {k: v / args.steps for k, v in counter.counts.most_common()}
                print(f"n={n}: {sum(per_step.values()):.1f} torch operators per step outside the "
                      "forwards: " + ", ".join(f"{k} {v:.1f}" for k, v in list(per_step.items())[:args.top]))
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                timed(engine, n, args.steps)
                prof.disable()
                stats = pstats.Stats(prof)
                parts = split(stats)
                total = sum(parts.values())
                print(f"n={n} profile: own time per step " + ", ".join(
                    f"{k} {v / args.steps * 1e6:.0f} us ({v / total:.0%})" for k, v in parts.items()))
                stats.sort_stats("cumulative").print_stats(args.top)
                stats.sort_stats("tottime").print_stats(args.top)
        engine.close()


if __name__ == "__main__":
    main()
