"""Shared by the kernel benchmarks: import ``blockdraft.kernels``, measure the copy-bandwidth
ceiling, time a call eagerly and replayed from a CUDA graph (``triton.testing.do_bench``
medians), and print / append one JSON line per result."""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def import_kernels() -> types.ModuleType:
    """``blockdraft.kernels`` (the installed package, else this checkout's ``python/`` with its
    built extension)."""
    sys.path.insert(0, str(REPO / "python"))
    import blockdraft.kernels as k

    return k


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None,
                   help="directory to append bench.jsonl to (default: print only)")
    return p.parse_args()


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms of back-to-back calls: what a caller pays, host work included."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` captured once in a CUDA graph and replayed: device time without the
    launcher's host work, which is how the proposer's graph path runs these kernels."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of a 2 GiB buffer: bytes read + bytes written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    src.normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def env_info() -> dict[str, Any]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def record(out: Path | None, entry: dict[str, Any]) -> None:
    """Print one result as a JSON line (with the environment) and append it to
    ``out/bench.jsonl`` when ``out`` is given."""
    line = json.dumps({**env_info(), **entry})
    print(line, flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "bench.jsonl", "a") as f:
            f.write(line + "\n")
