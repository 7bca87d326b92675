"""Memory the device acceptance of one verify step allocates: the bytes of every tensor the
torch operators of :func:`blockdraft.engine.device_accept.decide_on_device` return (the
largest are the ``[rows, V]`` fp32 temporaries of rejection sampling), and the largest
single one, for a step of SEQS requests of ROWS verify rows each at a Qwen3 vocabulary,
of which SAMPLED requests sample (temperature 0.7, top-p 0.95) and the rest are greedy.
A count, the same on any host; run on the CPU:

    PYTHONPATH=python python benchmarks/device_accept_bytes.py [--seqs 32] [--rows 16]
        [--vocab 151936] [--sampled 0,1,8,32]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from blockdraft.engine import Request
from blockdraft.engine.device_accept import decide_on_device, draw_uniforms
from blockdraft.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.7, top_p=0.95)


class Allocations(TorchDispatchMode):
    """The bytes of every tensor an operator returns while it is on, and the largest."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None:  # views allocate nothing
                size = t.untyped_storage().nbytes()
                self.total += size
                self.largest = max(self.largest, size)
        return out


def step(seqs: int, rows: int, vocab: int, sampled: int) -> tuple[int, int]:
    """Bytes allocated by one decision, in all and the largest tensor."""
    gen = torch.Generator().manual_seed(0)
    reqs = [Request(id=i, prompt=[1], max_new_tokens=64, params=SAMPLED if i < sampled else SamplingParams(),
                    stops=frozenset(), mask_fn=None, generator=torch.Generator().manual_seed(i),
                    submitted_at=0.0) for i in range(seqs)]
    drafts = [torch.randint(0, vocab, (rows - 1,), generator=gen).tolist() for _ in range(seqs)]
    logits = torch.randn(seqs * rows, vocab, generator=gen, dtype=torch.bfloat16)
    uniforms = draw_uniforms(reqs, drafts)
    count = Allocations()
    with count:
        decide_on_device(reqs, drafts, logits, [None] * seqs, uniforms)
    return count.total, count.largest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--sampled", default="0,1,8,32")
    args = ap.parse_args()
    torch.set_num_threads(2)
    for k in (int(x) for x in args.sampled.split(",")):
        total, largest = step(args.seqs, args.rows, args.vocab, k)
        print(f"{args.seqs} x {args.rows} rows, {k} sampled: {total / 2**20:,.1f} MiB allocated, "
              f"largest {largest / 2**20:,.1f} MiB")


if __name__ == "__main__":
    main()
