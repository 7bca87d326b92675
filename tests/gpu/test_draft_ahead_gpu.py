"""The next step's drafts launched before a step's bookkeeping, on captured CUDA graphs: while
requests arrive, finish and are cancelled between steps (:func:`support.arrivals.arrivals`),
the tokens equal target-only decoding's and every request takes the same steps as with the
drafts launched at each step's start, for one proposal per step and for several into one
graph bucket."""

from __future__ import annotations

import pytest
import torch

import blockdraft.pretrained
from blockdraft.engine import SpeculativeEngine
from blockdraft.levers import ENV_BATCH_PROPOSE, ENV_DRAFT_AHEAD

from support.arrivals import LONG, arrivals, expected

pytestmark = pytest.mark.gpu


def _engine(target: object, drafter: object, **kw: object) -> SpeculativeEngine:
    return SpeculativeEngine(target, drafter, runtime="blockdraft", graphs="capture", max_seq_len=200,  # type: ignore[arg-type]
                             max_active=8, draft_length=15, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("width", [16, 1])
def test_drafts_ahead_equal_drafts_at_each_step_on_graphs(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    target, drafter, _ = blockdraft.pretrained.builtin_pair(device="cuda", dtype=torch.float32)
    prompts = [p[: 9 + 7 * i] for i, p in enumerate(blockdraft.pretrained.heldout_prompts()[:5])]
    with _engine(target, drafter, speculate=False) as off:
        want = expected(off.generate(prompts, max_new_tokens=LONG).tokens)
    monkeypatch.setenv(ENV_BATCH_PROPOSE, str(width))
    runs = {}
    for ahead in ("off", "on"):
        monkeypatch.setenv(ENV_DRAFT_AHEAD, ahead)
        with _engine(target, drafter) as eng:
            assert eng.draft_ahead is (ahead == "on")
            runs[ahead] = arrivals(eng, prompts)
    for name, toks in want.items():
        assert runs["on"][name][0] == toks, name
    assert runs["on"] == runs["off"]
    assert max(max(s) for _, s in runs["on"].values()) > 2
