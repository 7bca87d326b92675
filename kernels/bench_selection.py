"""Masked argmax: 512 rows x 151936 vocab, bf16 logits with a packed bitmask (and without).
Also times sampling (kernel mask/scale + torch sort) for reference.

Bytes: logits (R * V * 2) + bitmask (R * ceil(V/32) * 4)."""

from __future__ import annotations

import torch

from _lab import args, bench_ms, copy_bandwidth_gbs, import_kernels, record


def main() -> None:
    a = args()
    K = import_kernels()
    copy = copy_bandwidth_gbs()
    vocab = 151936
    for rows in (512, 15):
        logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device="cuda")
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, device="cuda")
        for with_mask in (True, False):
            bm = mask if with_mask else None
            got = K.masked_argmax(logits, bm, backend="triton")
            if not with_mask:
                assert torch.equal(got, logits.float().argmax(1))
            ms = bench_ms(lambda: K.masked_argmax(logits, bm, backend="triton"))
            nbytes = logits.numel() * 2 + (mask.numel() * 4 if with_mask else 0)
            gbs = nbytes / (ms * 1e-3) / 1e9
            torch_ms = bench_ms(lambda: logits.argmax(1))
            record(a.out, {"bench": "masked_argmax", "rows": rows, "vocab": vocab,
                           "bitmask": with_mask, "ms": round(ms, 4), "gb_per_s": round(gbs, 1),
                           "copy_gb_per_s": round(copy, 1), "ratio": round(gbs / copy, 3),
                           "torch_argmax_nomask_ms": round(torch_ms, 4), "target_ratio": 0.70})
        g = torch.Generator(device="cuda").manual_seed(0)
        ms = bench_ms(lambda: K.masked_sample(logits, mask, 0.8, 50, 0.9, g, backend="triton"))
        record(a.out, {"bench": "masked_sample", "rows": rows, "vocab": vocab, "ms": round(ms, 4)})


if __name__ == "__main__":
    main()
