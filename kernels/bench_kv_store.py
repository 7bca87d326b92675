"""ctx K/V store at Qwen3-8B drafter shapes (5 layers, 8 KV heads x 128, bf16), 4096 and 16384
rows. Bytes: read kv [R, L, 2, Hkv, D] + write K and V of every layer (same size) + 20 B of
positions/slots per row.

    cd kernels && python bench_kv_store.py [--out DIR]
"""

from __future__ import annotations

import torch

from common import bench_ms, copy_bandwidth_gbs, gb_per_s, import_kernels, parse_args, record


def main() -> None:
    a = parse_args()
    K = import_kernels()
    copy = copy_bandwidth_gbs()
    layers, heads, dim, page = 5, 8, 128, 16
    for rows in (4096, 16384):
        num_pages = 2 * rows // page
        dev = "cuda"
        kv = torch.randn(rows, layers, 2, heads, dim, dtype=torch.bfloat16, device=dev)
        pos = torch.arange(rows, device=dev)
        slots = torch.randperm(num_pages * page, device=dev)[:rows]
        w = torch.ones(layers, dim, dtype=torch.bfloat16, device=dev)
        inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=dev, dtype=torch.float32) / dim))
        kc = torch.zeros(layers, num_pages, page, heads, dim, dtype=torch.bfloat16, device=dev)
        vc = torch.zeros_like(kc)
        sp = torch.zeros(num_pages * page, dtype=torch.int32, device=dev)
        def call(kv: torch.Tensor = kv, pos: torch.Tensor = pos, slots: torch.Tensor = slots,
                 w: torch.Tensor = w, inv: torch.Tensor = inv, kc: torch.Tensor = kc,
                 vc: torch.Tensor = vc, sp: torch.Tensor = sp) -> object:
            return K.ops("triton").ctx_kv_store(kv, pos, slots, w, inv, 1.0, 1e-6, kc, vc, sp)

        ms = bench_ms(call)
        nbytes = 2 * kv.numel() * 2 + rows * (8 + 8 + 4)
        gbs = gb_per_s(nbytes, ms)
        record(a.out, {"bench": "ctx_kv_store", "rows": rows, "layers": layers, "kv_heads": heads,
                       "head_dim": dim, "ms": round(ms, 4), "gb_per_s": round(gbs, 1),
                       "copy_gb_per_s": round(copy, 1), "ratio": round(gbs / copy, 3),
                       "target_ratio": 0.70})


if __name__ == "__main__":
    main()
