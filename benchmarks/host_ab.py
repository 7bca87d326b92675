"""One side of a same-lease A/B of blockdraft builds on one CUDA GPU: the issue-6 latency cells
and the host work per sequence-step, with the Rust core's per-step speed as the host's yardstick.
Run it once per build, alternating, in one lease (host speed drifts between leases):

    PYTHONPATH=<site of build A> TAG=a OUT=$OUT python3 benchmarks/host_ab.py
    PYTHONPATH=<site of build B> TAG=b OUT=$OUT python3 benchmarks/host_ab.py

`benchmarks/host_ab.sh` does that for two wheels. Writes $OUT/ab-$TAG-$ROUND.json. Uses only the
bench API that every build since the third session has (bench_quick, bench_host,
bench_core_bookkeeping), so an older build can be measured by the same script.
"""
import json
import os
import time
from pathlib import Path

import torch

import blockdraft
from blockdraft import bench

device, dtype = torch.device("cuda"), torch.bfloat16
shape = bench.SHAPES["qwen3-8b"]
reps = int(os.environ.get("REPS", "30"))
# the host's speed before anything else ran in this process, and again at the end
core_start = bench.bench_core_bookkeeping(16, shape, calls=20000)["us_per_seq_step"]
t0 = time.perf_counter()
with torch.inference_mode():
    target = bench.build_target(shape, device, dtype, 0)
    drafter = bench.build_drafter(shape, device, dtype, 1)
    quick = bench.bench_quick(shape, drafter, target, device, reps=reps)
    cfg = bench.BenchConfig(shape="qwen3-8b", contexts=[4096], profile_context=4096,
                            profile_batches=[1, 32], reps=int(os.environ.get("HOST_CALLS", "200")))
    host = bench.bench_host(cfg, shape, drafter, target, device)
core = bench.bench_core_bookkeeping(16, shape, calls=20000)
out = {
    "tag": os.environ.get("TAG", "?"),
    "blockdraft": blockdraft.__file__,
    "environment": bench.environment(device),
    "quick": quick,
    "host": host,
    "core_us_per_seq_step": core["us_per_seq_step"],
    "core_us_per_seq_step_at_start": core_start,
    "total_s": time.perf_counter() - t0,
}
name = f"ab-{out['tag']}-{os.environ.get('ROUND', '0')}.json"
Path(os.environ["OUT"], name).write_text(json.dumps(out, indent=1, default=str))
lat = {f"{r['context']}x{r['batch']}": round(r["latency_ms"]["median"], 4) for r in quick}
steps = {r["batch"]: {k: round(r[k], 2) for k in ("glue_us_per_seq", "commit_us_per_seq",
                                                   "verify_us_per_seq", "step_us_per_seq") if k in r}
         for r in host if "batch" in r}
print(out["tag"], "latency ms", lat, "host us/seq", steps, "core start/end",
      round(core_start, 2), round(core["us_per_seq_step"], 2),
      f"({out['total_s']:.0f} s)", flush=True)
