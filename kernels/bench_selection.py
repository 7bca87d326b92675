"""Masked argmax over bf16 logits, 151936 vocab, with a packed bitmask and without: 512 rows (a
32-sequence batch's drafted rows) and 15 rows (one sequence, B = 16). Then DFlash2's top-8 at
480, 15 and 1 rows against ``torch.topk(sorted=False)`` (``torch_ms``); bytes: the logits.

``ms`` is the launcher called back to back; ``graph_ms`` the same call replayed from a CUDA
graph, as the proposer's graph path runs it; ``torch_argmax_nomask_ms`` is ``torch.argmax`` on
the same logits. Bytes: logits (R * V * 2) + bitmask (R * ceil(V/32) * 4).

    cd kernels && python bench_selection.py [--out DIR]
"""

from __future__ import annotations

import torch

from common import bench_ms, copy_bandwidth_gbs, gb_per_s, graph_ms, import_kernels, parse_args, record


def main() -> None:
    a = parse_args()
    K = import_kernels()
    copy = copy_bandwidth_gbs()
    vocab = 151936
    for rows in (512, 15):
        logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device="cuda")
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, device="cuda")
        torch_ms = bench_ms(lambda logits=logits: logits.argmax(1))
        for with_mask in (True, False):
            bm = mask if with_mask else None
            got = K.ops("triton").masked_argmax(logits, bm)
            want = K.reference.masked_argmax(logits, bm)
            assert torch.equal(got, want), f"kernel != reference: {rows} rows, mask {with_mask}"

            def call(logits: torch.Tensor = logits, bm: torch.Tensor | None = bm) -> torch.Tensor:
                return K.ops("triton").masked_argmax(logits, bm)

            ms = bench_ms(call)
            replay_ms = graph_ms(call)
            nbytes = logits.numel() * 2 + (mask.numel() * 4 if with_mask else 0)
            record(a.out, {"bench": "masked_argmax", "rows": rows, "vocab": vocab,
                           "bitmask": with_mask, "ms": round(ms, 4),
                           "graph_ms": round(replay_ms, 4),
                           "gb_per_s": round(gb_per_s(nbytes, ms), 1),
                           "copy_gb_per_s": round(copy, 1),
                           "ratio": round(gb_per_s(nbytes, ms) / copy, 3),
                           "graph_ratio": round(gb_per_s(nbytes, replay_ms) / copy, 3),
                           "torch_argmax_nomask_ms": round(torch_ms, 4), "target_ratio": 0.70})

    top_k = 8
    for rows in (480, 15, 1):
        logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device="cuda")
        vals, ids = K.ops("triton").topk(logits, top_k)
        want = torch.topk(logits, top_k, dim=-1).values
        assert torch.equal(vals.sort(-1, descending=True).values, want), f"topk: {rows} rows"

        def top(logits: torch.Tensor = logits) -> tuple[torch.Tensor, torch.Tensor]:
            return K.ops("triton").topk(logits, top_k)

        def torch_top(logits: torch.Tensor = logits) -> object:
            return torch.topk(logits, top_k, dim=-1, sorted=False)

        ms = bench_ms(top)
        nbytes = logits.numel() * 2
        record(a.out, {"bench": "topk", "rows": rows, "vocab": vocab, "k": top_k,
                       "ms": round(ms, 4), "graph_ms": round(graph_ms(top), 4),
                       "gb_per_s": round(gb_per_s(nbytes, ms), 1),
                       "ratio": round(gb_per_s(nbytes, ms) / copy, 3),
                       "torch_ms": round(bench_ms(torch_top), 4)})


if __name__ == "__main__":
    main()
