"""Why the two issue-4 misses miss: host launch cost vs device time, and the split count.

For block attention (n = 1 x 16K ctx, B = 16, 32/8 heads x 128, bf16) and masked argmax
(512 x 151936 bf16 logits with a bitmask) it times, with ``do_bench`` medians:

* ``eager``: the launcher as the proposer calls it (argument checks + launches per call);
* ``graph``: the same call captured once in a CUDA graph and replayed (no host work);
* ``splits=N``: graph replay with the split count forced, to see whether the shape-derived
  heuristic leaves the GPU idle.

If ``graph`` is far below ``eager``, the miss is host-side (launch) cost, which the proposer's
CUDA-graph path already removes; if ``graph`` is still slow, it is the kernel.

    cd kernels && python diagnose_misses.py --out $OUT
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from _lab import args, bench_ms, copy_bandwidth_gbs, import_kernels, record


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture ``fn`` (after a warm-up on a side stream) and return a replay closure."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def attention(copy_gbs: float, out: object) -> None:
    import_kernels()
    mod = importlib.import_module("blockdraft.kernels.paged_attention")
    n, ctx, B, hq, hkv, dim, page = 1, 16384, 16, 32, 8, 128, 16
    dev = "cuda"
    blocks = ctx // page
    kc = torch.randn(blocks + 1, page, hkv, dim, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    tables = (torch.randperm(blocks, device=dev) + 1).view(1, blocks).to(torch.int32)
    ctx_lens = torch.full((n,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(n, B, hq, dim, dtype=torch.bfloat16, device=dev)
    kb = torch.randn(n, B, hkv, dim, dtype=torch.bfloat16, device=dev)
    vb = torch.randn_like(kb)
    q_pos = (ctx + torch.arange(B, device=dev)).repeat(n, 1)
    sp = torch.zeros((blocks + 1) * page, dtype=torch.int32, device=dev)
    nbytes = n * ctx * hkv * dim * 2 * 2
    o = torch.empty(n, B, hq, dim, dtype=torch.bfloat16, device=dev)

    def call(splits: int | None = None) -> Callable[[], object]:
        return lambda: mod.block_attention(
            q, kb, vb, kc, vc, tables, ctx_lens, q_pos, sp, scale=dim**-0.5,
            num_splits=splits, out=o,
        )

    rows = {
        "eager": bench_ms(lambda: mod.block_attention(q, kb, vb, kc, vc, tables, ctx_lens,
                                                      q_pos, sp, scale=dim**-0.5)),
        "graph": bench_ms(graphed(call())),
    }
    for s in (8, 16, 32, 64, 128):
        rows[f"splits={s}"] = bench_ms(graphed(call(s)))
    for name, ms in rows.items():
        gbs = nbytes / (ms * 1e-3) / 1e9
        record(out, {"kernel": "diagnose_attention_n1_16k", "variant": name, "ms": round(ms, 4),
                     "gbs": round(gbs, 1), "copy_ratio": round(gbs / copy_gbs, 3)})


def argmax(copy_gbs: float, out: object) -> None:
    """The launcher as shipped (eager and graph), torch.argmax, then a sweep of tile shapes
    ``(mask words per tile, warps[, tiles per loop step])`` x split counts, each replayed from a graph and checked
    against the torch reference."""
    K = import_kernels()
    mod = importlib.import_module("blockdraft.kernels.selection")
    vocab = 151936
    dev = "cuda"
    words = (vocab + 31) // 32
    for rows_n in (512, 15):
        logits = torch.randn(rows_n, vocab, dtype=torch.bfloat16, device=dev)
        bits = torch.randint(-(2**31), 2**31 - 1, (rows_n, words), dtype=torch.int32, device=dev)
        want = K.masked_argmax(logits, bits, backend="torch")
        nbytes = logits.numel() * 2 + bits.numel() * 4
        default = (mod.argmax_tile(rows_n, vocab), "default")
        results = {
            "eager": bench_ms(lambda: K.masked_argmax(logits, bits, backend="triton")),
            "graph": bench_ms(graphed(lambda: mod.masked_argmax(logits, bits))),
            "graph_nomask": bench_ms(graphed(lambda: mod.masked_argmax(logits, None))),
            "torch_argmax_nomask": bench_ms(lambda: torch.argmax(logits, -1)),
        }
        assert torch.equal(mod.masked_argmax(logits, bits), want), default
        # runs 4-6 swept (16|32|64|128 words) x (2|4|8|16 warps); run 8 keeps the two
        # shipped shapes and adds two tiles per loop step (run 7's winner)
        for tile in ((32, 2), (64, 8), (32, 2, 2), (32, 4, 2), (64, 8, 2)):
            for s in (None, 2, 3, 4, 8):
                if rows_n < 64 and s is not None and s < 8:
                    continue
                got = mod.masked_argmax(logits, bits, num_splits=s, tile=tile)
                assert torch.equal(got, want), (tile, s)
                fn = graphed(lambda s=s, tile=tile: mod.masked_argmax(
                    logits, bits, num_splits=s, tile=tile))
                step = f"x{tile[2]}" if len(tile) > 2 else ""
                results[f"tile={tile[0]}x32/{tile[1]}w{step} splits={s or 'auto'}"] = bench_ms(fn)
        for name, ms in results.items():
            gbs = nbytes / (ms * 1e-3) / 1e9
            record(out, {"kernel": f"diagnose_masked_argmax_{rows_n}", "variant": name,
                         "ms": round(ms, 4), "gbs": round(gbs, 1),
                         "copy_ratio": round(gbs / copy_gbs, 3)})


def main() -> None:
    a = args()
    copy = copy_bandwidth_gbs()
    record(a.out, {"kernel": "copy_ceiling", "gbs": round(copy, 1)})
    which = a.only or "attention,argmax"
    if "attention" in which:
        attention(copy, a.out)
    if "argmax" in which:
        argmax(copy, a.out)


if __name__ == "__main__":
    main()
