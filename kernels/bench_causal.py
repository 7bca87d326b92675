"""The target runtime's paged causal attention (``causal_attention``: decode rows and verify
blocks over each sequence's pages) at the split count its launcher picks and at the others, as
a fraction of the copy bandwidth. Shapes: Qwen3-8B's 32 query heads / 8 K/V heads x 128, bf16,
page 16; n sequences x ctx tokens of K/V, each with ``rows`` new rows (16: a verify of 15
drafts, 1: a decode) whose own K/V are already in the pages, as in the runtime.

``graph_ms`` is the call replayed from a CUDA graph (the runtime's decode and verify run
captured). Bytes counted: the K and V the kernel must read, ``n * (ctx + rows) * Hkv * D * 2
tensors * 2 B``. ``width`` is the tokens the page tables could hold: the runtime's tables are as
wide as its ``max_seq_len`` (40960 for a target of that many positions), whatever the context.

    cd kernels && python bench_causal.py [--out DIR]
"""

from __future__ import annotations

from functools import partial

import torch

from common import copy_bandwidth_gbs, gb_per_s, graph_ms, import_kernels, parse_args, record

# (sequences, context, new rows, table width in tokens; None: just the context and the rows)
CELLS = ((32, 4096, 16, None), (1, 16384, 16, None), (32, 4096, 1, None),
         (1, 4096, 16, None), (1, 4096, 1, None), (1, 16384, 1, None),
         (1, 4096, 16, 40960), (1, 16384, 16, 40960), (32, 4096, 16, 40960))
SPLITS = (None, 1, 2, 4, 8, 16, 32)


def main() -> None:
    a = parse_args()
    K = import_kernels()
    from blockdraft.kernels.causal_attention import launch_config

    copy = copy_bandwidth_gbs()
    hq, hkv, dim, page = 32, 8, 128, 16
    dev = torch.device("cuda")
    for n, ctx, rows, width in CELLS:
        kv_len = ctx + rows
        pages_per = -(-kv_len // page)
        wide = max(pages_per, -(-(width or 0) // page))
        num_pages = n * pages_per + 1
        kc = torch.randn(num_pages, page, hkv, dim, dtype=torch.bfloat16, device=dev)
        vc = torch.randn_like(kc)
        tables = (torch.randperm(num_pages - 1, device=dev)[: n * pages_per] + 1)
        tables = tables.view(n, pages_per).to(torch.int32)
        if wide > pages_per:  # entries past a sequence's length are never read
            tables = torch.cat((tables, torch.zeros((n, wide - pages_per), dtype=torch.int32, device=dev)), 1)
        q = torch.randn(n * rows, hq, dim, dtype=torch.bfloat16, device=dev)
        q_starts = torch.arange(0, n * rows + 1, rows, dtype=torch.int32, device=dev)
        kv_lens = torch.full((n,), kv_len, dtype=torch.int32, device=dev)
        positions = (ctx + torch.arange(rows, device=dev)).repeat(n)
        out = torch.empty_like(q)
        default = launch_config(n, rows, hq // hkv, hkv, wide * page, dev)[-1]
        nbytes = n * kv_len * hkv * dim * 2 * 2
        ref = None
        block_n = launch_config(n, rows, hq // hkv, hkv, wide * page, dev)[3]
        runs = [(s, None) for s in SPLITS]
        if wide > pages_per:
            # The spans of the table's width (each sequence's keys in the first few splits).
            runs += [(s, -(-(wide * page) // s // block_n) * block_n) for s in (default, 8, 16, 32)]
        for splits, span in runs:
            call = partial(K.ops("triton").causal_attention, q, kc, vc, tables, q_starts, kv_lens,
                           positions, scale=dim**-0.5, max_rows=rows, num_splits=splits,
                           split_len=span, out=out)
            got = call().float()
            if ref is None:
                ref = got.clone()
            err = float((got - ref).abs().max())
            ms = graph_ms(call)
            record(a.out, {"bench": "causal_attention", "n": n, "ctx": ctx, "rows": rows,
                           "width": wide * page,
                           "heads": hq, "kv_heads": hkv, "head_dim": dim,
                           "splits": default if splits is None else splits,
                           "spans": "own keys" if span is None else f"{span} of the width",
                           "default_splits": splits is None, "graph_ms": round(ms, 4),
                           "gb_per_s": round(gb_per_s(nbytes, ms), 1),
                           "copy_gb_per_s": round(copy, 1),
                           "ratio": round(gb_per_s(nbytes, ms) / copy, 3),
                           "max_abs_diff_vs_default": round(err, 5)})
        del kc, vc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
