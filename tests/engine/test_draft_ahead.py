"""The next step's drafts launched before a step's bookkeeping (``BLOCKDRAFT_DRAFT_AHEAD``):
the tokens equal target-only decoding's and every request takes the same steps as with the
lever off, while requests arrive, finish (at their length, or at a stop token inside an
accepted block) and are cancelled between steps (:func:`support.arrivals.arrivals`; the drafts
launched ahead are then joined with fresh ones, or dropped). The static graph path returns a graph
bucket's own output buffer, as a replay does, so a fresh proposal into the bucket the drafts
ahead came from overwrites them unless they were kept apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import blockdraft.pretrained
from blockdraft._core import ConfigError
from blockdraft.engine import SpeculativeEngine
from blockdraft.engine.drafting import Ahead, drafts_for, joined
from blockdraft.levers import ENV_BATCH_PROPOSE, ENV_DEVICE_DRAFTS, ENV_DRAFT_AHEAD, read_draft_ahead
from blockdraft.proposer import DFlashProposer, Drafts

from support.arrivals import LONG, arrivals, expected
from support.tinypair import tiny_dflash2, tiny_target

TARGET, DRAFTER, _TOKENIZER = blockdraft.pretrained.builtin_pair(device="cpu", dtype=torch.float32)
# Held-out prompts the trained pair drafts well for, cut to ragged lengths.
PROMPTS = [p[: 9 + 7 * i] for i, p in enumerate(blockdraft.pretrained.heldout_prompts()[:5])]


def engine(**kw: Any) -> SpeculativeEngine:
    kw = {"runtime": "blockdraft", "max_seq_len": 200, "max_active": 8, "graphs": "static",
          "draft_length": 15, **kw}
    return SpeculativeEngine(TARGET, DRAFTER, **kw)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Target-only decoding's tokens for the greedy requests that run to their end."""
    with engine(speculate=False) as off:
        return expected(off.generate(PROMPTS, max_new_tokens=LONG).tokens)


@pytest.fixture(scope="module")
def behind() -> dict[str, tuple[list[int], list[int]]]:
    """The requests' steps with every step drafting at its start (drafts still on the device)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DRAFT_AHEAD, "off")
        with engine() as eng:
            assert eng.device_drafts and not eng.draft_ahead
            return arrivals(eng, PROMPTS)


def test_the_lever_reads_a_boolean() -> None:
    assert read_draft_ahead({}) is True
    assert read_draft_ahead({ENV_DRAFT_AHEAD: "off"}) is False
    assert read_draft_ahead({ENV_DRAFT_AHEAD: " Yes "}) is True
    with pytest.raises(ConfigError, match=ENV_DRAFT_AHEAD):
        read_draft_ahead({ENV_DRAFT_AHEAD: "later"})


def test_drafts_go_ahead_only_where_they_stay_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    with engine() as eng:
        assert eng.draft_ahead
    with engine(graphs="off") as eng:
        assert not eng.draft_ahead
    monkeypatch.setenv(ENV_DEVICE_DRAFTS, "off")
    with engine() as eng:
        assert not eng.draft_ahead


@pytest.mark.parametrize("width", ["16", "1"])
def test_the_steps_equal_those_drafted_at_each_step(
    width: str, reference: dict[str, list[int]], behind: dict[str, tuple[list[int], list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Width 1: each request's drafts ahead are their own proposal into one graph bucket.
    monkeypatch.setenv(ENV_BATCH_PROPOSE, width)
    with engine() as eng:
        assert eng.draft_ahead
        got = arrivals(eng, PROMPTS)
    for name, toks in reference.items():
        assert got[name][0] == toks, name
    # The same drafts give the same steps: no request verified another's drafts or stale ones.
    assert got == behind
    assert sum(len(s) for _, s in got.values()) > 0
    assert max(max(s) for _, s in got.values()) > 2  # drafts were accepted


def test_the_next_drafts_are_launched_before_a_step_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[int] = []
    real = DFlashProposer.propose_on_device

    def counted(self: DFlashProposer, *a: Any, **k: Any) -> Any:
        launched.append(len(a[0]))
        return real(self, *a, **k)

    monkeypatch.setattr(DFlashProposer, "propose_on_device", counted)
    with engine() as eng:
        rid = eng.submit(PROMPTS[0], max_new_tokens=LONG)
        eng.step()  # the prefill and the first step
        for k in range(1, 4):
            eng.step()
            # This step's own drafts came from the step before; its successor's are out.
            assert len(launched) == k + 2
        assert eng.request(rid).status.name == "RUNNING"
    assert launched == [1] * len(launched)


def _drafts(pending: torch.Tensor | None, tokens: list[list[int]]) -> Drafts:
    n = len(tokens) if pending is None else pending.shape[0]
    toks = [[] for _ in range(n)] if pending is not None else tokens
    return Drafts(tokens=toks, q=[None] * n, errors=[None] * n, pending=pending)


def test_joined_keeps_drafts_on_the_device_in_the_order_asked() -> None:
    a = _drafts(torch.tensor([[1, 2], [3, 4], [5, 6]]), [])
    b = _drafts(torch.tensor([[7, 8]]), [])
    got = joined([(a, 2), (b, 0), (a, 0)])
    assert got.pending is not None and got.pending.tolist() == [[5, 6], [7, 8], [1, 2]]
    assert got.tokens == [[], [], []]
    whole = joined([(a, 0), (a, 1), (a, 2)])
    assert whole.pending is a.pending  # nothing dropped or moved: the same tensor


def test_joined_reads_parts_of_mixed_kinds_into_lists() -> None:
    a = _drafts(torch.tensor([[1, 2], [3, 4]]), [])
    b = _drafts(None, [[9], []])
    b.errors[1] = RuntimeError("proposal failed")
    got = joined([(b, 0), (a, 1), (b, 1)])
    assert got.pending is None
    assert got.tokens == [[9], [3, 4], []]
    assert got.errors[0] is None and isinstance(got.errors[2], RuntimeError)
    wide = _drafts(torch.tensor([[1, 2, 3]]), [])
    assert joined([(a, 0), (wide, 0)]).tokens == [[1, 2], [1, 2, 3]]


def test_drafts_ahead_of_requests_that_all_ended_are_not_used() -> None:
    ended, admitted = [object(), object()], [object()]
    ahead_pending = torch.tensor([[1, 2], [3, 4]])
    ahead = Ahead(ended, _drafts(ahead_pending, []))  # type: ignore[arg-type]
    fresh = _drafts(torch.tensor([[5, 6]]), [])
    asked: list[list[object]] = []

    def propose(reqs: list[object]) -> Drafts:
        asked.append(reqs)
        return fresh

    assert drafts_for(admitted, ahead, propose) is fresh  # type: ignore[arg-type]
    assert asked == [admitted]
    assert ahead.drafts.pending is ahead_pending  # not copied: nothing of it is read


def test_a_dflash2_drafter_drafts_ahead_as_it_drafts_at_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """DFlash2 (its graph path's fused selector) with the drafts launched ahead: requests
    admitted between steps and one cancelled, against drafting at each step's start and
    against target-only decoding."""
    target, drafter = tiny_target(), tiny_dflash2()
    prompts = [[(7 * i + 3 * j) % 50 + 1 for j in range(5 + 3 * i)] for i in range(4)]

    def run(ahead: str, speculate: bool = True) -> list[tuple[list[int], list[int]]]:
        monkeypatch.setenv(ENV_DRAFT_AHEAD, ahead)
        with SpeculativeEngine(target, drafter, runtime="blockdraft", max_seq_len=128, max_active=4,
                               graphs="static", draft_length=3, speculate=speculate) as eng:
            assert eng.draft_ahead == (speculate and ahead == "on")
            ids = [eng.submit(p, max_new_tokens=20) for p in prompts[:2]]
            eng.step()
            eng.step()
            ids += [eng.submit(p, max_new_tokens=12) for p in prompts[2:]]
            eng.step()
            eng.cancel(ids[1])
            list(eng.stream())
            assert eng.pages_used() == {"target": 0, "drafter": 0}
            return [(list(eng.request(i).out), list(eng.request(i).steps)) for i in ids]

    ahead, behind, alone = run("on"), run("off"), run("on", speculate=False)
    assert ahead == behind
    for i in (0, 2, 3):  # the requests that ran to their end
        assert ahead[i][0] == alone[i][0]
