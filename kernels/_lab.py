"""Kernel-lab helpers: import ``blockdraft.kernels`` (even without the compiled core), measure
the copy-bandwidth ceiling, time with ``triton.testing.do_bench`` (median), record JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def import_kernels() -> types.ModuleType:
    """``blockdraft.kernels``; if the Rust core is not built here, load the kernels package
    alone behind a stub ``blockdraft`` package (the kernels do not need the core)."""
    sys.path.insert(0, str(REPO / "python"))
    try:
        import blockdraft.kernels as k

        return k
    except ImportError:
        for name in [m for m in sys.modules if m == "blockdraft" or m.startswith("blockdraft.")]:
            del sys.modules[name]
        stub = types.ModuleType("blockdraft")
        stub.__path__ = [str(REPO / "python" / "blockdraft")]
        sys.modules["blockdraft"] = stub
        import blockdraft.kernels as k

        return k


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None, help="directory for bench.jsonl")
    p.add_argument("--only", default=None, help="comma-separated parts of a script to run")
    return p.parse_args()


def bench_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of a 2 GiB buffer: bytes read + bytes written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    src.normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def env_info() -> dict[str, Any]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def record(out: Path | None, entry: dict[str, Any]) -> None:
    entry = {**env_info(), **entry}
    line = json.dumps(entry)
    print(line, flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "bench.jsonl", "a") as f:
            f.write(line + "\n")
