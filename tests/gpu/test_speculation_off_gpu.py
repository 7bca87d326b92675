"""Speculation off on the GPU: the engine's target-only step, eager and replayed from CUDA
graphs (decode rows only, nothing captured for a drafter), gives target-only decoding's
tokens (fp32) while requests join and leave."""

from __future__ import annotations

import pytest
import torch

import blockdraft
from blockdraft import pair as bd_pair

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda")
SHAPE = bd_pair.Shape("gpu-spec-off", 6, 512, 8, 2, 64, 1024, 4096, 2, (1, 4), 8, 4095)


@pytest.mark.parametrize("mode", ["off", "capture"])
def test_speculation_off_equals_target_only_decode(mode: str) -> None:
    model = bd_pair.random_target(SHAPE, GPU, torch.float32, seed=3)
    drafter = bd_pair.random_drafter(SHAPE, GPU, torch.float32, seed=4)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, SHAPE.vocab - 1, (n,), generator=gen).tolist() for n in (3, 250, 900, 40, 1)]
    want = blockdraft.decode(model, prompts, max_new_tokens=20).tokens
    engine = blockdraft.SpeculativeEngine(model, drafter, graphs=mode, max_seq_len=1024,  # type: ignore[arg-type]
                                          max_active=8, max_batch=8, speculate=False)
    first = [engine.submit(p, max_new_tokens=20) for p in prompts[:2]]
    for _ in range(5):
        engine.step()
    rest = [engine.submit(p, max_new_tokens=20) for p in prompts[2:]]
    list(engine.stream())
    assert [engine.request(r).out for r in first + rest] == [list(t) for t in want]
    assert engine.proposer.pool.num_used == 0 and engine.single_proposals == engine.batched_proposals == 0
    assert engine.runtime is not None
    graphs = engine.runtime.graphs
    if mode == "capture":
        assert graphs is not None and graphs.disabled is None and graphs.replays > 10
    assert engine.pages_used() == {"target": 0, "drafter": 0}
    engine.close()
