"""After ``SpeculativeEngine.warmup()`` no request compiles a kernel or captures a graph: every
prompt length 1..64, a dense spread up to 2048 (powers of two and their neighbours, odd
primes), every batch size up to 32, greedy and sampled, on the built-in pair and on a random
small pair."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from blockdraft import pair as bd_pair
from blockdraft.engine import SpeculativeEngine
from blockdraft.pretrained import builtin_pair
from blockdraft.sampling import SamplingParams

pytestmark = pytest.mark.gpu

MOST = 2048
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)


def lengths(most: int) -> list[int]:
    out = set(range(1, 65))
    k = 64
    while k <= most:
        out |= {k - 1, k, k + 1}
        k *= 2
    sieve = [True] * (most + 1)
    for p in range(2, most + 1):
        if sieve[p]:
            if p % 2:
                out.add(p)
            for q in range(p * p, most + 1, p):
                sieve[q] = False
    out |= set(range(65, most + 1, 29))
    return sorted(n for n in out if 1 <= n <= most)


def _pair(which: str) -> tuple[Any, Any]:
    if which == "builtin":
        target, drafter, _ = builtin_pair(device="cuda", dtype=torch.bfloat16)
        return target, drafter
    shape = bd_pair.Shape("gpu-warmup", 4, 256, 8, 2, 32, 512, 4096, 2, (1, 2), 8, 4095)
    return bd_pair.random_pair(shape, device="cuda", dtype=torch.bfloat16, seed=3)


@pytest.mark.parametrize("which", ["builtin", "random"])
def test_nothing_compiles_or_captures_after_warmup(which: str, caplog: pytest.LogCaptureFixture) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, drafter = _pair(which)
    positions = int(getattr(target.config, "max_position_embeddings", 4096))
    engine = SpeculativeEngine(target, drafter, runtime="blockdraft",
                               max_seq_len=min(positions, MOST + 64), max_active=32)
    report = engine.warmup()
    logging.getLogger(__name__).warning("%s warm-up: %s", which, report)
    vocab = engine.proposer.head.vocab_in
    room = engine.max_seq_len - 8
    with caplog.at_level(logging.WARNING, logger="blockdraft.engine.compiles"):
        for i, n in enumerate(n for n in lengths(MOST) if n <= room):
            prompt = [(13 * j + n) % vocab for j in range(n)]
            engine.generate([prompt], max_new_tokens=6,
                            sampling=SAMPLED if i % 5 == 0 else None)
        for n in range(1, engine.max_active + 1):
            prompts = [[(7 * j + k) % vocab for j in range(3 + (37 * k) % 200)] for k in range(n)]
            engine.generate(prompts, max_new_tokens=engine.block_size + 2)
            engine.generate(prompts, max_new_tokens=engine.block_size + 2, sampling=SAMPLED,
                            generator=torch.Generator().manual_seed(n))
    late = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert engine.compiles_after_warmup == 0, late
    assert engine.captures_after_warmup == 0, late
    assert engine.pages_used() == {"target": 0, "drafter": 0}
