"""Speculation off (``SpeculativeEngine(speculate=False)``): target-only decoding under the
engine's batching and request handling gives the target's own tokens, the speculative
engine's greedy tokens and :func:`blockdraft.decode`'s, and never touches the drafter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import blockdraft
from blockdraft import pair as bd_pair
from blockdraft.engine import SpeculativeEngine, Status
from blockdraft.sampling import SamplingParams

from support import runtime_models

TARGET, DRAFTER = bd_pair.random_pair(bd_pair.SHAPES["tiny"], "cpu", torch.float32, seed=3)
PROMPTS = [[5, 17, 300, 2], [9], [(7 * i + 11) % 500 for i in range(23)], [44, 45, 46, 47, 48, 49, 50]]
NEW = 12


def engine(**kw: Any) -> SpeculativeEngine:
    kw = {"runtime": "blockdraft", "max_seq_len": 64, "max_active": 4, "page_size": 4,
          "num_pages": 64, "max_batch": 4, **kw}
    return SpeculativeEngine(TARGET, DRAFTER, **kw)


def hf_greedy(prompt: list[int], n: int) -> list[int]:
    return runtime_models.hf_greedy(TARGET, prompt, n)


@pytest.mark.parametrize("runtime", ["blockdraft", "hf"])
def test_greedy_equals_speculation_and_target_only_decode(runtime: str) -> None:
    with engine(runtime=runtime, speculate=False) as off:
        got = off.generate(PROMPTS, max_new_tokens=NEW)
        assert off.proposer.pool.num_used == 0
        assert off.batched_proposals == off.single_proposals == 0
    with engine(runtime=runtime) as on:
        spec = on.generate(PROMPTS, max_new_tokens=NEW)
    plain = blockdraft.decode(TARGET, PROMPTS, max_new_tokens=NEW)
    assert [list(t) for t in got.tokens] == [list(t) for t in spec.tokens] == [list(t) for t in plain.tokens]
    assert [list(t) for t in got.tokens] == [hf_greedy(p, NEW) for p in PROMPTS]
    # One target forward per generated token after the first: every step yields one token.
    assert got.stats.target_runtime == runtime
    assert got.stats.mean_tau == pytest.approx(1.0)


def test_requests_join_and_leave_with_stops_and_no_drafter_pages() -> None:
    ref = [hf_greedy(p, NEW) for p in PROMPTS]
    stop = ref[2][5]  # request 2 ends at the first occurrence of its sixth token
    want_2 = ref[2][: ref[2].index(stop) + 1]
    with engine(speculate=False) as eng:
        runtime = eng.runtime
        assert runtime is not None and runtime.forward_pass.ctx_row_width == 0
        first = eng.submit(PROMPTS[0], max_new_tokens=NEW)
        for _ in range(3):
            eng.step()
        later = [eng.submit(PROMPTS[i], max_new_tokens=NEW if i != 3 else 4,
                            stop_token_ids=[stop] if i == 2 else None) for i in (1, 2, 3)]
        while any(not eng.request(r).status.ended for r in [first, *later]):
            eng.step()
            assert eng.pages_used()["drafter"] == 0
            assert all(eng.request(r).drafter_pages == 0 and eng.request(r).state is None
                       for r in [first, *later])
        outs = [eng.request(r) for r in [first, *later]]
        assert [r.status for r in outs] == [Status.FINISHED] * 4
        assert outs[0].out == ref[0] and outs[1].out == ref[1] and outs[3].out == ref[3][:4]
        assert outs[2].out == want_2 and outs[2].finish_reason == "stop"
        assert outs[3].finish_reason == "length"
        assert all(set(r.steps) == {1} and len(r.steps) == len(r.out) - 1 for r in outs)
        assert eng.pages_used() == {"target": 0, "drafter": 0}


def test_sampling_draws_as_target_only_decode() -> None:
    """A seeded sampled request draws the tokens :func:`blockdraft.decode` draws from the
    same seed: the same distributions, chosen the same way."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    with engine(speculate=False) as eng:
        rid = eng.submit(PROMPTS[2], max_new_tokens=NEW, sampling=params, seed=11)
        list(eng.stream([rid]))
        got = eng.request(rid).out
    want = blockdraft.decode(TARGET, [PROMPTS[2]], max_new_tokens=NEW, sampling=params,
                             generator=torch.Generator().manual_seed(11)).tokens[0]
    assert got == list(want)


def test_cancel_gives_every_page_back() -> None:
    with engine(speculate=False) as eng:
        a = eng.submit(PROMPTS[2], max_new_tokens=NEW)
        b = eng.submit(PROMPTS[0], max_new_tokens=NEW)
        eng.step()
        eng.step()
        assert eng.pages_used()["target"] > 0
        assert eng.cancel(a)
        assert eng.request(a).status is Status.CANCELLED
        list(eng.stream([b]))
        assert eng.request(b).out == hf_greedy(PROMPTS[0], NEW)
        assert eng.pages_used() == {"target": 0, "drafter": 0}


def test_the_drafter_pool_is_one_page_unless_asked() -> None:
    """Off, the proposer the engine builds holds one page (the memory goes to the target's
    pool); on, a pool sized for drafting; a pool size given is kept."""
    kw: dict[str, Any] = {"runtime": "blockdraft", "max_seq_len": 64, "max_active": 4, "page_size": 4}
    with SpeculativeEngine(TARGET, DRAFTER, speculate=False, **kw) as off:
        assert off.pages_total()["drafter"] == off.proposer.pool.num_pages == 1
        off.warmup()
        got = off.generate(PROMPTS, max_new_tokens=NEW)
    with SpeculativeEngine(TARGET, DRAFTER, **kw) as on:
        assert on.pages_total()["drafter"] > 1
        assert [list(t) for t in on.generate(PROMPTS, max_new_tokens=NEW).tokens] == [list(t) for t in got.tokens]
    with SpeculativeEngine(TARGET, DRAFTER, speculate=False, num_pages=40, **kw) as given:
        assert given.pages_total()["drafter"] == 40
