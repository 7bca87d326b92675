"""One bench run: resolve the config, build the pair, run each section, collect the result."""

from __future__ import annotations

import logging
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.e2e import bench_e2e
from blockdraft.bench.figures import fmt
from blockdraft.bench.host import bench_host
from blockdraft.bench.kernels import bench_kernels
from blockdraft.bench.propose import bench_propose
from blockdraft.bench.reference import bench_reference
from blockdraft.bench.spec import bench_spec
from blockdraft.bench.target import bench_target
from blockdraft.devices import sync
from blockdraft.pair import SHAPES, Shape, random_drafter, random_target

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Version of the result's JSON layout (``bench.json``)."""

Section = Callable[[BenchConfig, Shape, Any, Any, torch.device], list[dict[str, Any]]]

SECTIONS: dict[str, Section] = {
    "propose": bench_propose,
    "reference": bench_reference,
    "host": bench_host,
    "kernels": bench_kernels,
    "e2e": bench_e2e,
    "target": bench_target,
    "spec": bench_spec,
}


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device, for the report."""
    import transformers

    import blockdraft

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blockdraft_core": blockdraft.__version__,
        "device": str(device),
        "host": platform.machine(),
    }
    try:
        import triton  # type: ignore[import-untyped]

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import dflash  # type: ignore[import-untyped]

        env["dflash"] = getattr(dflash, "__version__", "installed")
    except ImportError:
        env["dflash"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def resolve(cfg: BenchConfig) -> tuple[Shape, torch.device, torch.dtype]:
    """The shape, device and dtype ``cfg`` names. Raises ValueError for a bad config."""
    if cfg.shape not in SHAPES:
        raise ValueError(f"unknown shape {cfg.shape!r}; choose one of {sorted(SHAPES)}")
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if not cfg.contexts or not cfg.batches or min(cfg.contexts) < 1 or min(cfg.batches) < 1:
        raise ValueError("contexts and batches must be non-empty lists of positive ints")
    if (cfg.reps < 1 or cfg.warmup < 0 or cfg.loop_reps < 1 or cfg.e2e_steps < 1
            or cfg.e2e_repeats < 1):
        raise ValueError("reps, loop_reps, e2e_steps and e2e_repeats must be >= 1 and warmup >= 0")
    if not cfg.spec_caps or any(c is not None and c < 0 for c in cfg.spec_caps):
        raise ValueError(f"spec caps must be a non-empty list of None or ints >= 0, not {cfg.spec_caps}")
    if not cfg.public_tau >= 1:
        raise ValueError(f"public tau must be >= 1 (tokens per step), not {cfg.public_tau}")
    bad = [b for b in cfg.e2e_backends if b not in ("flash", "default")]
    if bad or not cfg.e2e_backends:
        raise ValueError(f"e2e backends must be 'flash' and/or 'default', not {cfg.e2e_backends}")
    dev_name = cfg.device
    if dev_name == "auto":
        dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif cfg.dtype in dtypes:
        dtype = dtypes[cfg.dtype]
    else:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose auto, bf16, fp16 or fp32")
    return SHAPES[cfg.shape], device, dtype


def run(
    cfg: BenchConfig,
    *,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the configured sections; returns the JSON-able result (see ``docs/BENCHMARKS.md``).

    ``checkpoint`` is called with the partial result after every section (so a long run that
    is cut short still leaves its finished sections on disk).
    """
    shape, device, dtype = resolve(cfg)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "config": asdict(cfg),
        "shape": asdict(shape),
        "dtype": str(dtype).replace("torch.", ""),
        "environment": environment(device),
        "sections": {},
        "errors": {},
    }
    torch.manual_seed(cfg.seed)
    tb = time.perf_counter()
    target = random_target(shape, device, dtype, cfg.seed)
    drafter = random_drafter(shape, device, dtype, cfg.seed + 1)
    sync(device)
    result["build_s"] = time.perf_counter() - tb
    log.info("bench: built the %s pair on %s in %s s", shape.name, device, fmt(result["build_s"], 1))
    with torch.inference_mode():
        for name in cfg.sections:
            ts = time.perf_counter()
            try:
                result["sections"][name] = SECTIONS[name](cfg, shape, drafter, target, device)
            except Exception as exc:  # noqa: BLE001 - one section's failure is recorded
                log.error("bench section %s failed: %s", name, exc)
                result["errors"][name] = traceback.format_exc(limit=8)
            result.setdefault("section_s", {})[name] = time.perf_counter() - ts
            if checkpoint is not None:
                checkpoint(result)
    result["total_s"] = time.perf_counter() - t0
    return result
