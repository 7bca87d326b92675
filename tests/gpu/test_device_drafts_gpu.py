"""Greedy drafts left on the device into the verify, on captured CUDA graphs: the same tokens
and the same steps as with the drafts read between drafter and verify, for one proposal per
step and for several into one graph bucket (whose pinned staging and output each call reuses
while nothing is read between them)."""

from __future__ import annotations

import pytest
import torch

import blockdraft.pretrained
from blockdraft.engine import SpeculativeEngine
from blockdraft.levers import ENV_BATCH_PROPOSE, ENV_DEVICE_DRAFTS

pytestmark = pytest.mark.gpu

NEW = 48


def _run(monkeypatch: pytest.MonkeyPatch, on: bool, width: int) -> tuple[list[list[int]], list[list[int]]]:
    target, drafter, _ = blockdraft.pretrained.builtin_pair(device="cuda", dtype=torch.float32)
    prompts = [p[: 12 + 5 * i] for i, p in enumerate(blockdraft.pretrained.heldout_prompts()[:8])]
    monkeypatch.setenv(ENV_DEVICE_DRAFTS, "on" if on else "off")
    monkeypatch.setenv(ENV_BATCH_PROPOSE, str(width))
    with SpeculativeEngine(target, drafter, runtime="blockdraft", graphs="capture", max_seq_len=256,  # type: ignore[arg-type]
                           max_active=8, draft_length=15) as eng:
        assert eng.device_drafts is on
        got = eng.generate(prompts, max_new_tokens=NEW)
        assert eng.pages_used() == {"target": 0, "drafter": 0}
    return [list(t) for t in got.tokens], [list(a) for a in got.stats.acceptance_lengths]


@pytest.mark.parametrize("width", [16, 2, 1])
def test_device_drafts_equal_read_drafts_on_graphs(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    tokens, steps = _run(monkeypatch, True, width)
    ref_tokens, ref_steps = _run(monkeypatch, False, width)
    assert tokens == ref_tokens
    assert steps == ref_steps
    assert sum(map(sum, steps)) / sum(map(len, steps)) > 2.0
