"""DFlash2's two kernels at qwen3-8b drafter shapes (H = 4096, B = 16, conv 3 taps over groups of
32 channels, selector rank 32 over the top 8 of 151936 candidates), for one sequence (16 rows)
and 32 (512 rows).

``dynamic_conv``: bytes are x (K reads of M * H * 2, the taps overlap in cache, counted once) +
out (M * H * 2); ``torch_loop_ms`` is the drafter's own ``grouped_dynamic_conv`` (a loop of
shift/multiply/add kernels) on the same rows. ``selector_walk``: one launch for all sequences;
``torch_loop_ms`` is ``CandidateSelector``'s walk (a few kernels per row). ``graph_ms``: the
call replayed from a CUDA graph, as the proposer's graph path runs it.

    cd kernels && python bench_dflash2.py [--out DIR]
"""

from __future__ import annotations

import torch

from common import bench_ms, copy_bandwidth_gbs, gb_per_s, graph_ms, import_kernels, parse_args, record


def main() -> None:
    a = parse_args()
    K = import_kernels()
    from blockdraft.models.layers import CandidateSelector, grouped_dynamic_conv

    copy = copy_bandwidth_gbs()
    dev, dt = torch.device("cuda"), torch.bfloat16
    size, block, taps, group, vocab, rank, top_k = 4096, 16, 3, 32, 151936, 32, 8
    ops = K.ops("triton")
    sel = CandidateSelector(size, vocab, rank, top_k, device=dev, dtype=dt)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0.0, 0.02)
    for n in (1, 32):
        rows = n * block
        x = torch.randn(rows, size, device=dev, dtype=dt)
        dyn = torch.randn(rows, 2, taps, size // group, device=dev, dtype=dt)[:, 0]
        base = torch.randn(taps, size, device=dev, dtype=dt)
        got = ops.dynamic_conv(x, dyn, base, block, group)
        want = K.reference.dynamic_conv(x, dyn, base, block, group)
        torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)

        def conv(x: torch.Tensor = x, dyn: torch.Tensor = dyn, base: torch.Tensor = base) -> torch.Tensor:
            return ops.dynamic_conv(x, dyn, base, block, group)

        def conv_loop(x: torch.Tensor = x, dyn: torch.Tensor = dyn, base: torch.Tensor = base,
                      n: int = n) -> torch.Tensor:
            return grouped_dynamic_conv(x.view(n, block, size), dyn.reshape(n, block, taps, -1),
                                        base, group)

        ms = bench_ms(conv)
        nbytes = 2 * rows * size * 2
        record(a.out, {"bench": "dynamic_conv", "sequences": n, "rows": rows, "hidden": size,
                       "ms": round(ms, 4), "graph_ms": round(graph_ms(conv), 4),
                       "gb_per_s": round(gb_per_s(nbytes, ms), 1), "copy_gb_per_s": round(copy, 1),
                       "torch_loop_ms": round(bench_ms(conv_loop), 4)})

        steps = block - 1
        hidden = torch.randn(n, steps, size, device=dev, dtype=dt)
        logits = torch.randn(n, steps, vocab, device=dev, dtype=dt)
        anchors = torch.randint(0, vocab, (n,), device=dev)
        unary, cand = torch.topk(logits, top_k, dim=-1, sorted=False)
        projected = sel.hidden_projection(hidden)
        walk_args = (unary, cand, projected, sel.predecessor_codebook, sel.successor_codebook, anchors)
        tokens, _ = ops.selector_walk(*walk_args)
        assert torch.equal(tokens, K.reference.selector_walk(*walk_args)[0]), "walk != reference"

        def walk(walk_args: tuple[torch.Tensor, ...] = walk_args) -> object:
            return ops.selector_walk(*walk_args)

        def walk_loop(hidden: torch.Tensor = hidden, logits: torch.Tensor = logits,
                      anchors: torch.Tensor = anchors) -> object:
            return sel.select(hidden, logits, anchors)

        record(a.out, {"bench": "selector_walk", "sequences": n, "rows": n * steps, "top_k": top_k,
                       "rank": rank, "ms": round(bench_ms(walk), 4), "graph_ms": round(graph_ms(walk), 4),
                       "torch_loop_ms": round(bench_ms(walk_loop), 4)})


if __name__ == "__main__":
    with torch.no_grad():
        main()
