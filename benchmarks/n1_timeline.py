"""Where the wall time of one graph-path `propose` goes on a CUDA GPU (random qwen3-8b pair,
bf16, batch 1; contexts from $CTXS, default 4096): a torch.profiler trace of CALLS steady-state
calls (each preceded, untimed, by a one-row commit), split per call into host time before the
first kernel, the device span from the first kernel's start to the last one's end (with the
sum of kernel durations and the gaps between kernels), and host time after the last kernel.

    OUT=/some/dir python3 benchmarks/n1_timeline.py    # prints a table, writes $OUT/n1_timeline.json
"""
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from blockdraft import bench

device, dtype = torch.device("cuda"), torch.bfloat16
shape = bench.SHAPES["qwen3-8b"]
calls = int(os.environ.get("CALLS", "20"))
out: dict[str, object] = {"environment": bench.environment(device)}
with torch.inference_mode():
    target = bench.build_target(shape, device, dtype, 0)
    drafter = bench.build_drafter(shape, device, dtype, 1)
    for ctx in (int(c) for c in os.environ.get("CTXS", "4096").split(",")):
        prop = bench._make_proposer(drafter, target, shape, ctx, 1, "auto", 4 * calls + 64)
        seqs = bench._Seqs(prop, shape, ctx, 1, torch.Generator(device=device).manual_seed(ctx))
        for _ in range(5):
            seqs.advance([0])
            seqs.propose_batch([0])
        torch.cuda.synchronize()
        marks = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                seqs.advance([0])
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                with record_function("propose_call"):
                    seqs.propose_batch([0])
                t1 = time.perf_counter_ns()
                marks.append((t0, t1))
        # profiler timestamps are µs on the host's steady clock; align by the calls' own spans
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs)
        # one group per call: from its metadata copy (the one pinned host-to-device copy of a
        # call) up to the next call's commit (its random rows: the `normal_` kernel)
        groups, cur = [], None
        for k in kern:
            if k[2].startswith("Memcpy HtoD (Pinned"):
                cur = [k]
                groups.append(cur)
            elif "distribution" in k[2] or "normal" in k[2]:
                cur = None
            elif cur is not None:
                cur.append(k)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.name == "propose_call" and e.device_type == torch.autograd.DeviceType.CPU)
        rows = []
        for g, (c0, c1) in zip(groups, spans):
            span = g[-1][1] - g[0][0]
            busy = sum(e - s for s, e, _ in g)
            rows.append({"kernels": len(g), "span_us": span, "busy_us": busy, "gaps_us": span - busy,
                         "before_us": g[0][0] - c0, "after_us": c1 - g[-1][1]})
        wall = [(t1 - t0) / 1e3 for t0, t1 in marks]
        rec = {
            "context": ctx,
            "wall_us_median": statistics.median(wall),
            "groups": len(groups),
            "kernels_per_call": statistics.median(r["kernels"] for r in rows),
            "span_us_median": statistics.median(r["span_us"] for r in rows),
            "busy_us_median": statistics.median(r["busy_us"] for r in rows),
            "gaps_us_median": statistics.median(r["gaps_us"] for r in rows),
            "host_before_first_kernel_us_median": statistics.median(r["before_us"] for r in rows),
            "host_after_last_kernel_us_median": statistics.median(r["after_us"] for r in rows),
            "calls_matched": len(rows),
            "largest_gaps": sorted(
                ((round(b[0] - a[1], 1), a[2][:50], b[2][:50]) for g in groups[-3:]
                 for a, b in zip(g, g[1:])), reverse=True)[:10],
        }
        last = groups[-1]
        rec["last_call_kernels"] = [(round(a - last[0][0], 1), round(b - a, 1), name[:60])
                                    for a, b, name in last]
        out[str(ctx)] = rec
        print(json.dumps({k: v for k, v in rec.items() if k != "last_call_kernels"}, indent=1),
              flush=True)
        seqs.free()
        bench._release(prop)
Path(os.environ.get("OUT", "."), "n1_timeline.json").write_text(json.dumps(out, indent=1, default=str))
