"""Host time of one `commit_ctx` of a single row on a CUDA GPU (random qwen3-8b pair, bf16,
4K context): medians of 2000 calls, five repeats, and the cost of its tensor parts, then a
cProfile of 3000 calls. Used in the fourth session to compare two builds in one lease:

    for w in A B; do python3 -m pip install -q --no-deps --target /tmp/s-$w <wheel of $w>; done
    for r in 1 2; do for w in A B; do PYTHONPATH=/tmp/s-$w python3 benchmarks/commit_probe.py $w; done; done
"""
import sys, time, statistics, torch
from blockdraft import bench as B
shape = B.SHAPES["qwen3-8b"]; dev = torch.device("cuda"); dt = torch.bfloat16
tag = sys.argv[1]
with torch.inference_mode():
    target = B.build_target(shape, dev, dt, 0); drafter = B.build_drafter(shape, dev, dt, 1)
    prop = B._make_proposer(drafter, target, shape, 4096, 1, "auto", 30000)
    st = prop.alloc_state()
    rows = torch.randn(1, shape.ctx_row_width, device=dev, dtype=dt)
    pos = [0]
    def commit():
        prop.commit_ctx(st, rows, [pos[0]]); pos[0] += 1
    for _ in range(200): commit()
    torch.cuda.synchronize()
    res = []
    for r in range(5):
        ts = []
        for _ in range(2000):
            t0 = time.perf_counter(); commit(); ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        res.append(statistics.median(ts) * 1e6)
    # components
    acc = st.acc
    def t(fn, n=5000):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        return (time.perf_counter() - t0) / n * 1e6
    view = lambda: acc[3:4]
    cp = lambda: acc[3:4].copy_(rows)
    to = lambda: rows.to(device=acc.device, dtype=acc.dtype)
    print(tag, "commit_ctx n=1 medians us", [round(x, 2) for x in res], "view", round(t(view), 2), "copy", round(t(cp), 2), "to", round(t(to), 2), flush=True)
    import cProfile, pstats, io
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3000): commit()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); print(s.getvalue()[-2500:])
