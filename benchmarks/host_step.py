"""blockdraft's host work of a steady-state step on the CPU (tiny shape, fp32, graphs="static":
the graph path's bookkeeping run eagerly, device work stubbed out): per sequence at n = 32 the
batch commit and the proposal (medians of CALLS steps), and one `commit_ctx` at n = 1 (best of
five medians of 20,000 calls). For A/B of two builds on one machine, run it once per build:

    PYTHONPATH=<site of a build> python benchmarks/host_step.py [CALLS]
"""
import statistics
import sys
import time
import timeit

import torch

from blockdraft import bench, pair
from blockdraft.bench.host import stub_launch

shape = pair.SHAPES["tiny"]
dev = torch.device("cpu")
target = pair.random_target(shape, dev, torch.float32)
drafter = pair.random_drafter(shape, dev, torch.float32)
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 400
n = 32

prop = bench.make_proposer(drafter, target, shape, 128, n, "static", 3 * calls + 64)
seqs = bench.Seqs(prop, shape, 128, n, torch.Generator().manual_seed(0))
idx = list(range(n))
ready = torch.zeros((n, prop.block_gamma - 1), dtype=torch.int64)


def step() -> tuple[float, float]:
    t0 = time.perf_counter()
    seqs.advance(idx, fresh=False)
    t1 = time.perf_counter()
    seqs.propose_batch(idx, verify=False)
    t2 = time.perf_counter()
    seqs.verify(idx)
    return t1 - t0, t2 - t1


with stub_launch(prop.graph_runner, lambda bucket, m, cap: ready[:m]):
    seqs.warm(idx, 3)
    for _ in range(20):
        step()
    commits, proposals = zip(*[step() for _ in range(calls)])
c = statistics.median(commits) * 1e6 / n
p = statistics.median(proposals) * 1e6 / n

single = bench.make_proposer(drafter, target, shape, 128, 1, "static", 200000)
st = single.alloc_state()
row = torch.randn(1, shape.ctx_row_width)
pos = [0]


def commit() -> None:
    single.commit_ctx(st, row, [pos[0]])
    pos[0] += 1


one = min(timeit.repeat(commit, number=20000, repeat=5)) / 20000 * 1e6
print(f"n=32: commit {c:.2f} + propose {p:.2f} = {c + p:.2f} us/seq; n=1 commit_ctx {one:.2f} us")
