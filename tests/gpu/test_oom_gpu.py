"""A real device allocation failure (not an injected one) in one request's prefill fails that
request alone: the device is filled until a long prompt's prefill cannot get its activations,
while a short prompt's still fit. The long request ends with an out-of-memory error and holds
no page; the short ones run to their solo tokens; once the memory is back the long prompt runs
to its solo tokens too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft import pair as bd_pair
from blockdraft.engine import SpeculativeEngine

pytestmark = pytest.mark.gpu

# A wide MLP so that a long prompt's prefill chunk needs far more activation memory (512 rows
# x 2 x 32768 bf16 gate/up = 64 MiB) than the device has left (HEADROOM), and a short prompt's
# step far less (16 rows: 2 MiB).
SHAPE = bd_pair.Shape("gpu-oom", 2, 1024, 8, 2, 128, 32768, 4096, 1, (1,), 8, 4095)
LONG, SHORT, NEW = 2048, 16, 24
HEADROOM = 24 << 20


def fill_device(headroom: int) -> list[torch.Tensor]:
    """Tensors that take all device memory but ``headroom`` bytes: first the free space inside
    the caching allocator's segments (which earlier work in this process may have left, and
    which the device's free figure does not count), then the device's free memory."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    held: list[torch.Tensor] = []
    # No new segment while the segments' own free space is taken.
    torch.cuda.set_per_process_memory_fraction(min(1.0, torch.cuda.memory_reserved() / total))
    try:
        for size in (256 << 20, 16 << 20, 1 << 20, 64 << 10, 4 << 10, 512):
            while True:
                try:
                    held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    break
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    free, _ = torch.cuda.mem_get_info()
    held.append(torch.empty(max(free - headroom, 0), dtype=torch.uint8, device="cuda"))
    return held


def _engine(target: Any, drafter: Any) -> SpeculativeEngine:
    return SpeculativeEngine(target, drafter, runtime="blockdraft", max_seq_len=LONG + 64,
                             max_active=3)


def test_a_real_out_of_memory_in_prefill_fails_that_request_alone() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, drafter = bd_pair.random_pair(SHAPE, device="cuda", dtype=torch.bfloat16, seed=5)
    vocab = SHAPE.vocab - 1
    long_prompt = [(11 * j + 3) % vocab for j in range(LONG)]
    shorts = [[(7 * j + k) % vocab for j in range(SHORT)] for k in range(2)]
    engine = _engine(target, drafter)
    engine.warmup()
    solo_long = engine.generate([long_prompt], max_new_tokens=NEW).tokens[0]
    solo_short = [engine.generate([p], max_new_tokens=NEW).tokens[0] for p in shorts]

    a, b = (engine.submit(p, max_new_tokens=NEW) for p in shorts)
    engine.step()  # both prefilled and running before the device fills up
    filler = fill_device(HEADROOM)
    try:
        c = engine.submit(long_prompt, max_new_tokens=NEW)
        for _ in engine.stream([a, b, c]):
            pass
    finally:
        filler.clear()
        torch.cuda.empty_cache()
    failed = engine.request(c)
    assert failed.finish_reason == "error", (failed.finish_reason, failed.out)
    assert isinstance(failed.exception, torch.OutOfMemoryError)
    assert [engine.request(r).out for r in (a, b)] == solo_short
    assert engine.pages_used() == {"target": 0, "drafter": 0}
    assert engine.generate([long_prompt], max_new_tokens=NEW).tokens == [solo_long]
    engine.close()
