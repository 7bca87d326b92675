"""Block attention over paged ctx K/V against torch SDPA (best backend) on the same data
gathered contiguous. Shapes: B = 16 queries, 32 query heads / 8 KV heads x 128, bf16, page 16;
n x ctx = 32 x 16K, 1 x 16K, 8 x 4K.

``ms`` is the launcher called back to back (argument checks and launches included); ``graph_ms``
the same call replayed from a CUDA graph, as the proposer's graph path runs it. Bytes counted:
the ctx K and V the kernel must read (n * ctx * Hkv * D * 2 tensors * 2 B).

    cd kernels && python bench_attention.py [--out DIR]
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from common import bench_ms, copy_bandwidth_gbs, gb_per_s, graph_ms, import_kernels, parse_args, record


def main() -> None:
    a = parse_args()
    K = import_kernels()
    copy = copy_bandwidth_gbs()
    B, hq, hkv, dim, page = 16, 32, 8, 128, 16
    dev = "cuda"
    for n, ctx in ((32, 16384), (1, 16384), (8, 4096)):
        pages_per = ctx // page
        num_pages = n * pages_per + 1
        kc = torch.randn(num_pages, page, hkv, dim, dtype=torch.bfloat16, device=dev)
        vc = torch.randn_like(kc)
        tables = (torch.randperm(num_pages - 1, device=dev)[: n * pages_per] + 1)
        tables = tables.view(n, pages_per).to(torch.int32)
        ctx_lens = torch.full((n,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(n, B, hq, dim, dtype=torch.bfloat16, device=dev)
        kb = torch.randn(n, B, hkv, dim, dtype=torch.bfloat16, device=dev)
        vb = torch.randn_like(kb)
        q_pos = (ctx + torch.arange(B, device=dev)).repeat(n, 1)
        sp = torch.zeros(num_pages * page, dtype=torch.int32, device=dev)
        scale = dim**-0.5
        call = partial(K.ops("triton").block_attention, q, kb, vb, kc, vc, tables, ctx_lens,
                       q_pos, sp, scale=scale)
        ms = bench_ms(call)
        replay_ms = graph_ms(call)
        nbytes = n * ctx * hkv * dim * 2 * 2
        # SDPA on the same data gathered contiguous (gather not timed)
        slots = (tables.long()[:, :, None] * page + torch.arange(page, device=dev)).view(n, -1)
        k_all = torch.cat([kc.view(-1, hkv, dim)[slots], kb], 1).transpose(1, 2).contiguous()
        v_all = torch.cat([vc.view(-1, hkv, dim)[slots], vb], 1).transpose(1, 2).contiguous()
        qt = q.transpose(1, 2).contiguous()
        ref = call()
        sdpa_ms: dict[str, float] = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
            for gqa in (True, False):
                kk = k_all if gqa else k_all.repeat_interleave(hq // hkv, 1)
                vv = v_all if gqa else v_all.repeat_interleave(hq // hkv, 1)
                try:
                    with sdpa_kernel(be):
                        o = sdpa(qt, kk, vv, scale=scale, enable_gqa=gqa)
                        err = (o.transpose(1, 2).float() - ref.float()).abs().max().item()
                        t = bench_ms(partial(sdpa, qt, kk, vv, scale=scale, enable_gqa=gqa))
                    sdpa_ms[f"{name}{'' if gqa else '_expanded'}"] = round(t, 4)
                    if err > 0.05:
                        print(f"warning: sdpa {name} differs from kernel by {err}")
                    break
                except RuntimeError as exc:
                    print(f"sdpa {name} gqa={gqa}: unavailable ({str(exc)[:80]})")
        best = min(sdpa_ms.values()) if sdpa_ms else float("nan")
        record(a.out, {"bench": "block_attention", "n": n, "ctx": ctx, "B": B, "heads": hq,
                       "kv_heads": hkv, "head_dim": dim, "ms": round(ms, 4),
                       "graph_ms": round(replay_ms, 4),
                       "gb_per_s": round(gb_per_s(nbytes, ms), 1),
                       "copy_gb_per_s": round(copy, 1),
                       "ratio": round(gb_per_s(nbytes, ms) / copy, 3),
                       "graph_ratio": round(gb_per_s(nbytes, replay_ms) / copy, 3),
                       "sdpa_ms": sdpa_ms, "speedup_vs_best_sdpa": round(best / ms, 3)})
        del kc, vc, k_all, v_all
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
