#!/usr/bin/env bash
# Quick check of the proposer's latency targets on one CUDA GPU (< 60 s with the model build):
#   OUT=/some/dir bash benchmarks/quick_h200.sh
# Random qwen3-8b pair in bf16; propose n=1 at 4K and 16K, propose_batch n=32 at 4K, median of
# REPS timed calls (CUDA events, each call preceded by one committed ctx row), graphs on, then
# the plain path (no graphs) on the same states; the same cells with the DFlash2 drafter of
# shape qwen3-8b-dflash2 on the same target (SHAPES="qwen3-8b" skips it), with its ratio to
# DFlash's. Prints one table; writes $OUT/quick.json and
# $OUT/quick.md (default: a new directory under ${TMPDIR:-/tmp}/blockdraft-bench, outside the
# checkout). Needs blockdraft importable (wheel or `maturin develop`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" quick
export PYTHONUNBUFFERED=1 OUT REPS="${REPS:-20}" SHAPES="${SHAPES:-qwen3-8b qwen3-8b-dflash2}"
"$py" - <<'PY'
import json, logging, os, time
from pathlib import Path

import torch

from blockdraft import bench, pair

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
device, dtype = torch.device("cuda"), torch.bfloat16
names = os.environ["SHAPES"].split()
shape = pair.SHAPES["qwen3-8b"]
t0 = time.perf_counter()
records = []
with torch.inference_mode():
    target = pair.random_target(shape, device, dtype, 0)  # the same target for every drafter
    torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    for name in names:
        drafter_shape = pair.SHAPES[name]
        drafter = pair.random_drafter(drafter_shape, device, dtype, 1)
        records += bench.bench_quick(drafter_shape, drafter, target, device, reps=int(os.environ["REPS"]))
        del drafter
        torch.cuda.empty_cache()
    # How fast this host is at the Rust core's per-step calls: host-bound figures vary by up to
    # 2x between machines of the same kind, so read them next to this one.
    core = bench.bench_core_bookkeeping(16, shape, calls=20000)
result = {
    "environment": bench.environment(device),
    "shapes": names,
    "dtype": "bf16",
    "build_s": build_s,
    "total_s": time.perf_counter() - t0,
    "quick": records,
    "core_bookkeeping": core,
}
out = Path(os.environ["OUT"])
(out / "quick.json").write_text(json.dumps(result, indent=2, default=str))
table = bench.quick_markdown(records) + (
    f"\nRust core bookkeeping on this host: {core['us_per_seq_step']:.2f} µs per sequence-step\n"
)
(out / "quick.md").write_text(table)
print(table)
print(f"build {build_s:.1f} s, total {result['total_s']:.1f} s; wrote {out}/quick.json")
PY
