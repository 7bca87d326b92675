"""The GPU's ceilings, measured in the same run as the kernels: device copy bandwidth (2 GiB
``copy_``, bytes read + written) and a bf16 8192^3 matmul.

    cd kernels && python bench_ceilings.py [--out DIR]
"""

from __future__ import annotations

import torch

from common import bench_ms, copy_bandwidth_gbs, parse_args, record


def main() -> None:
    a = parse_args()
    gbs = copy_bandwidth_gbs()
    record(a.out, {"bench": "copy_bandwidth", "bytes": 2 * (2 << 30), "gb_per_s": round(gbs, 1)})
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = bench_ms(lambda: x @ y)
    record(a.out, {"bench": "bf16_matmul", "shape": [n, n, n], "ms": round(ms, 4),
                   "tflop_per_s": round(2 * n**3 / (ms * 1e-3) / 1e12, 1)})


if __name__ == "__main__":
    main()
