"""How the bench times a call, and the summary of a cell's samples.

On CUDA a call is timed with CUDA events and synchronised at its end; elsewhere with the wall
clock (``time.perf_counter``). :func:`timing_method` names the method for the report, so a CPU
run never claims CUDA events.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from blockdraft.devices import sync


def timing_method(device: torch.device | str) -> str:
    """The timing method :func:`time_ms` uses on ``device``, in words."""
    if torch.device(device).type == "cuda":
        return "CUDA events"
    return "wall clock"


def time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """One call of ``fn``, in ms, by :func:`timing_method` of ``device``."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p90 (nearest rank), min and count of ``samples``."""
    xs = sorted(samples)
    if not xs:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    p90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    return {"median": statistics.median(xs), "p90": p90, "min": xs[0], "n": len(xs)}


def cell_times(
    fn: Callable[[], Any], before: Callable[[], None], reps: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """``warmup`` untimed then ``reps`` timed calls of ``fn``, each after an untimed ``before``
    (the device drained before each timed call); the :func:`summarize` of the timed ones."""
    for _ in range(warmup):
        before()
        fn()
    samples = []
    for _ in range(reps):
        before()
        sync(device)
        samples.append(time_ms(fn, device))
    return summarize(samples)


def timed_calls(fn: Callable[..., Any], ms: list[float], device: torch.device) -> Callable[..., Any]:
    """``fn`` wrapped to append the wall time of each call (synchronised before and after) to
    ``ms``: a drafter's share of an end-to-end step."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        sync(device)
        t0 = time.perf_counter()
        r = fn(*args, **kwargs)
        sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
        return r

    return timed
