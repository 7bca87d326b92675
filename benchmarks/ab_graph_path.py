"""A/B of two graph-path choices in one process on one GPU (alternating, so host speed drifts
hit both sides alike): the ctx K/V store on its own stream vs inline, and the plans confirmed
before vs after the host waits for the drafts. Random qwen3-8b pair, bf16; propose n=1 and
propose_batch n=32 at 4K; 6 rounds x 4 variants x 20 timed calls.

    OUT=/some/dir python benchmarks/ab_graph_path.py      # prints medians, writes $OUT/ab.json

The "inline" and "after_sync" sides are the code before the third session's change, patched in
on the live objects (``GraphRunner._store_beside`` and ``DFlashProposer._graph_bands``).
"""
import json, os, statistics, types
import torch
from blockdraft import bench
from blockdraft.bench import _Seqs, _make_proposer, _cell_times
from blockdraft.graphs import GraphRunner

dev, dt = torch.device("cuda"), torch.bfloat16
shape = bench.SHAPES["qwen3-8b"]
out = {}
with torch.inference_mode():
    target = bench.build_target(shape, dev, dt, 0)
    drafter = bench.build_drafter(shape, dev, dt, 1)
    for ctx, n in ((4096, 1), (4096, 32)):
        prop = _make_proposer(drafter, target, shape, ctx, n, "auto", 2000)
        seqs = _Seqs(prop, shape, ctx, n, torch.Generator(device=dev).manual_seed(ctx))
        idx = list(range(n))
        real_bands = prop._graph_bands
        def old_bands(step, got, take, _p=prop):
            rows = (got if take == got.shape[1] else got[:, :take]).tolist()
            _p._confirm(step, take)
            return rows
        runners = {}
        for store in ("stream", "inline"):
            r = GraphRunner(prop, "capture")
            if store == "inline":
                def inline(self, device, fn):
                    fn()
                    return lambda: None
                r._store_beside = types.MethodType(inline, r)
            runners[store] = r
        res = {}
        for rnd in range(6):
            for store in ("stream", "inline"):
                for confirm in ("first", "after_sync"):
                    prop._graphs = runners[store]
                    prop._graph_bands = real_bands if confirm == "first" else old_bands
                    t = _cell_times(lambda: seqs.propose_batch(idx), lambda: seqs.advance(idx), 20, 2, dev)
                    res.setdefault(f"{store}/{confirm}", []).append(t["median"])
        prop._graph_bands = real_bands
        out[f"{ctx}x{n}"] = {k: {"rounds": v, "median": statistics.median(v)} for k, v in res.items()}
        print(ctx, n, {k: round(statistics.median(v), 4) for k, v in res.items()}, flush=True)
        seqs.free()
        del prop, runners
core = bench.bench_core_bookkeeping(16, shape, calls=20000)
out["core_us"] = core["us_per_seq_step"]
print("core", core["us_per_seq_step"])
json.dump(out, open(os.path.join(os.environ["OUT"], "ab.json"), "w"), indent=1)
