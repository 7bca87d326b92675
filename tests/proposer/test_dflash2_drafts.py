"""DFlash2 drafts on the proposer's plain path: batched forwards equal per-sequence ones, greedy
and sampled; sampled drafts of many sequences (``draft``) come from one forward per group of
equal settings, each sequence drawing from its own random source.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft import DFlashProposer
from blockdraft.sampling import SamplingParams

from support.tinypair import K_H, tiny_dflash2, tiny_drafter, tiny_target


def _prop(drafter: Any, **kw: Any) -> DFlashProposer:
    return DFlashProposer(drafter, tiny_target(), max_seq_len=120, num_pages=120, page_size=4,
                          max_batch=4, graphs="off", backend="torch", **kw)


def _filled(prop: DFlashProposer, lens: list[int], seed: int) -> list[Any]:
    states = []
    for i, n in enumerate(lens):
        st = prop.alloc_state_for(60)
        rows = torch.randn(n, K_H, generator=torch.Generator().manual_seed(seed + i))
        prop.commit_ctx(st, rows, range(n))
        states.append(st)
    return states


def test_dflash2_propose_batch_equals_propose() -> None:
    prop = _prop(tiny_dflash2())
    lens, tokens = [5, 9, 3], [4, 17, 60]
    batch, single = _filled(prop, lens, 10), _filled(prop, lens, 10)
    got = prop.propose_batch(batch, tokens, lens, 3)
    assert got is not None
    assert got == [prop.propose(s, t, p, 3) for s, t, p in zip(single, tokens, lens)]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_sampled_drafts_of_a_group_equal_their_own_calls(kind: str) -> None:
    """``draft`` makes the sampled drafts of sequences with equal settings in one forward; each
    sequence's drafts and q equal those of ``propose_sampled`` for it alone, with the same seed;
    other settings make another group, a lone one its own call."""
    drafter = tiny_dflash2() if kind == "dflash2" else tiny_drafter()
    prop = _prop(drafter)
    lens, tokens = [4, 7, 3, 6], [3, 8, 21, 40]
    hot, cold = SamplingParams(temperature=0.9), SamplingParams(temperature=0.5)
    how = [hot, hot, cold, hot]
    states, single = _filled(prop, lens, 30), _filled(prop, lens, 30)
    sampling = [(p, torch.Generator().manual_seed(7 + i)) for i, p in enumerate(how)]
    got = prop.draft(states, tokens, lens, [3] * 4, sampling=sampling)
    assert got.errors == [None] * 4
    assert (got.batched, got.single) == (1, 1)  # sequences 0, 1, 3 at once; 2 alone
    for i in range(4):
        want, q = prop.propose_sampled([single[i]], [tokens[i]], [lens[i]], 3, how[i],
                                       torch.Generator().manual_seed(7 + i))
        assert got.tokens[i] == want[0]
        q_i = got.q[i]
        assert q_i is not None
        torch.testing.assert_close(q_i, q[0], atol=1e-6, rtol=1e-5)
    # the groups drew from different sources: not all the same drafts
    assert len({tuple(t) for t in got.tokens}) > 1


def test_sampled_groups_fall_back_per_sequence_when_the_forward_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prop = _prop(tiny_dflash2())
    states = _filled(prop, [4, 5], 50)
    params = SamplingParams(temperature=0.7)
    real = prop.propose_sampled
    calls: list[int] = []

    def flaky(st: Any, *args: Any) -> Any:
        calls.append(len(st))
        if len(st) > 1:
            raise RuntimeError("batched forward failed")
        return real(st, *args)

    monkeypatch.setattr(prop, "propose_sampled", flaky)
    got = prop.draft(states, [1, 2], [4, 5], [2, 2],
                     sampling=[(params, torch.Generator().manual_seed(i)) for i in range(2)])
    assert calls == [2, 1, 1]
    assert got.errors == [None, None] and (got.batched, got.single) == (0, 2)
    assert all(len(t) == 2 for t in got.tokens)


def test_propose_sampled_wants_one_generator_per_state() -> None:
    prop = _prop(tiny_dflash2())
    states = _filled(prop, [4, 5], 60)
    with pytest.raises(ValueError, match="1 generators for 2 sequences"):
        prop.propose_sampled(states, [1, 2], [4, 5], 2, SamplingParams(temperature=0.7),
                             [torch.Generator()])
    # nothing changed: the same call with two sources drafts
    drafts, _ = prop.propose_sampled(states, [1, 2], [4, 5], 2, SamplingParams(temperature=0.7),
                                     [torch.Generator(), torch.Generator()])
    assert len(drafts) == 2
