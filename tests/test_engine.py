"""Speculative engine: greedy output == target greedy, lossless sampling, state release."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tinypair import drafter_config, tiny_drafter, tiny_target

import blockdraft
from blockdraft.engine import SpeculativeEngine, generate, target_probs
from blockdraft.proposer import DFlashProposer, DFlashState

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [30]]


def reference(target: Any, prompt: list[int], n: int, stops: list[int] | None = None) -> list[int]:
    """The target's own greedy continuation, cut after the first stop token."""
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(prompt) :].tolist()
    if stops:
        for i, t in enumerate(out):
            if t in stops:
                return out[: i + 1]
    return list(out)


class OracleProposer(DFlashProposer):
    """Real drafting and bookkeeping, but the returned drafts are the target's own greedy
    continuation with every third draft corrupted: exercises long acceptances and rejections
    at every offset inside a block."""

    def __init__(self, *args: Any, truth: list[list[int]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.truth = truth
        self.owner_of: dict[int, int] = {}
        self.calls = 0
        self.allocs = 0

    def alloc_state_for(self, budget_tokens: int) -> DFlashState:
        st = super().alloc_state_for(budget_tokens)
        self.owner_of[id(st)] = self.allocs % len(self.truth)  # the engine allocates in prompt order
        self.allocs += 1
        return st

    def _fix(self, st: DFlashState, position: int, drafts: list[int]) -> list[int]:
        seq = self.truth[self.owner_of[id(st)]]
        out = []
        for j in range(len(drafts)):
            tok = seq[position + 1 + j] if position + 1 + j < len(seq) else 0
            self.calls += 1
            out.append((tok + 1) % 64 if self.calls % 3 == 0 else tok)
        return out

    def propose(self, st: Any, last_token: int, position: int, num_drafts: int, grammar_bitmask: Any = None) -> list[int]:
        return self._fix(st, position, super().propose(st, last_token, position, num_drafts, grammar_bitmask))

    def propose_batch(self, states: Any, last_tokens: Any, positions: Any, num_drafts: int) -> Any:
        got = super().propose_batch(states, last_tokens, positions, num_drafts)
        if got is None:
            return None
        return [self._fix(s, p, d) for s, p, d in zip(states, positions, got)]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request: pytest.FixtureRequest) -> Any:
    return tiny_target(request.param)


@pytest.fixture(scope="module")
def drafter() -> Any:
    return tiny_drafter(drafter_config(block=5))


def test_greedy_matches_target_single_and_batched(target: Any, drafter: Any) -> None:
    n = 13
    single = [generate(target, drafter, [p], max_new_tokens=n).tokens[0] for p in PROMPTS[:2]]
    batched = generate(target, drafter, PROMPTS, max_new_tokens=n)
    want = [reference(target, p, n) for p in PROMPTS]
    assert single == want[:2]
    assert batched.tokens == want
    st = batched.stats
    assert st.batched_proposals > 0 and st.num_new_tokens == n * len(PROMPTS)
    assert [sum(a) for a in st.acceptance_lengths] == [n - 1] * len(PROMPTS)  # first token: prefill
    assert len(st.ttft_s) == len(PROMPTS) and st.tokens_per_s > 0 and st.mean_tau >= 1.0


@pytest.mark.parametrize("max_new", [1, 2, 7, 11])
def test_oracle_drafts_long_acceptance_stop_and_max_mid_block(target: Any, drafter: Any, max_new: int) -> None:
    truth_new = [reference(target, p, max_new + 8) for p in PROMPTS]
    truth = [p + t for p, t in zip(PROMPTS, truth_new)]
    # A stop token that first appears mid-way through one of the continuations.
    stop = truth_new[2][min(5, max_new - 1)]
    prop = OracleProposer(drafter, target, max_seq_len=64, num_blocks=64, max_batch=4, truth=truth)
    engine = SpeculativeEngine(target, drafter, proposer=prop, max_seq_len=64)
    for stops in (None, [stop]):
        res = engine.generate(PROMPTS, max_new_tokens=max_new, stop_token_ids=stops)
        want = [reference(target, p, max_new, stops) for p in PROMPTS]
        assert res.tokens == want
        assert prop.pool.num_free == prop.pool.num_blocks
    if max_new >= 7:
        assert max(max(a) for a in res.stats.acceptance_lengths if a) >= 3


def test_fallback_when_batching_declines(target: Any, drafter: Any) -> None:
    engine = SpeculativeEngine(target, drafter, max_seq_len=64, num_blocks=64, max_batch=4, batched_path=False)
    res = engine.generate(PROMPTS[:3], max_new_tokens=6)
    assert res.stats.batched_proposals == 0 and res.stats.single_proposals > 0
    assert res.tokens == [reference(target, p, 6) for p in PROMPTS[:3]]


def test_grammar_bitmask_fn(target: Any, drafter: Any) -> None:
    vocab = 64
    even = torch.zeros(2, dtype=torch.int32)
    for t in range(0, vocab, 2):
        even[t // 32] |= 1 << (t % 32)
    even = torch.where(even >= 2**31, even - 2**32, even) if even.dtype != torch.int32 else even
    seen: list[int] = []

    def fn(i: int, toks: Any) -> torch.Tensor:
        seen.append(i)
        return even

    res = generate(target, drafter, PROMPTS[:2], max_new_tokens=8, grammar_bitmask_fn=fn)
    for prompt, out in zip(PROMPTS[:2], res.tokens):
        # Masked greedy decoding by hand.
        ids = list(prompt)
        want = []
        with torch.no_grad():
            for _ in range(8):
                logits = target(torch.tensor([ids])).logits[0, -1]
                logits[1::2] = float("-inf")
                want.append(int(logits.argmax()))
                ids.append(want[-1])
        assert out == want
    assert set(seen) == {0, 1}


def test_every_state_freed_after_failure(target: Any, drafter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = SpeculativeEngine(target, drafter, max_seq_len=64, num_blocks=64, max_batch=4)
    pool = engine.proposer.pool
    real = engine._target_forward
    calls = {"n": 0}

    for exc in (RuntimeError("simulated target failure"), KeyboardInterrupt()):
        calls["n"] = 0

        def flaky(ids: list[int], cache: Any, exc: BaseException = exc) -> Any:
            calls["n"] += 1
            if calls["n"] == 9:
                raise exc
            return real(ids, cache)

        monkeypatch.setattr(engine, "_target_forward", flaky)
        with pytest.raises(type(exc)):
            engine.generate(PROMPTS, max_new_tokens=10)
        assert pool.num_used == 0 and pool.num_free == pool.num_blocks
        pool.check_invariants()
    monkeypatch.undo()
    # The engine is still usable afterwards.
    assert engine.generate(PROMPTS[:1], max_new_tokens=3).tokens[0] == reference(target, PROMPTS[0], 3)


def test_bad_arguments(target: Any, drafter: Any) -> None:
    for kw in ({"max_new_tokens": 0}, {"max_new_tokens": 2, "temperature": -1.0},
               {"max_new_tokens": 2, "top_p": 0.0}, {"max_new_tokens": 2, "top_k": -1}):
        with pytest.raises(ValueError):
            generate(target, drafter, PROMPTS[:1], **kw)
    with pytest.raises(ValueError, match="empty"):
        generate(target, drafter, [[]], max_new_tokens=2)
    assert blockdraft.engine.generate is generate


def _chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_sampling_matches_target_distribution() -> None:
    """Chi-square goodness of fit of the 2nd and 3rd generated tokens (the first speculative
    ones) against the target's exact marginals, computed by enumeration on an 8-token
    vocabulary. With a correct sampler the test fails with probability 1e-3 per statistic
    (2e-3 in all); the seeds are fixed, so a pass is reproducible."""
    vocab, n = 8, 480
    target = tiny_target(vocab=vocab, seed=5)
    drafter = tiny_drafter(drafter_config(vocab=vocab, block=4), seed=6)
    prompt = [1, 2, 3]
    engine = SpeculativeEngine(target, drafter, max_seq_len=16, num_blocks=512, max_batch=16)
    gen = torch.Generator().manual_seed(1234)
    res = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.3, top_k=6, generator=gen)
    assert sum(res.stats.acceptance_lengths[0]) >= 1
    # Exact marginals by enumeration over the first two tokens.
    with torch.no_grad():
        p1 = target_probs(target(torch.tensor([prompt])).logits[0, -1:], 1.3, 1.0, 6)[0]
        seq2 = torch.tensor([prompt + [a] for a in range(vocab)])
        p2_given = target_probs(target(seq2).logits[:, -1], 1.3, 1.0, 6)  # [a, b]
        m2 = p1 @ p2_given
        seq3 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3_given = target_probs(target(seq3).logits[:, -1], 1.3, 1.0, 6)  # [(a,b), c]
        m3 = (p1[:, None] * p2_given).reshape(-1) @ p3_given
    accepted_any = sum(1 for a in res.stats.acceptance_lengths if a and a[0] > 1)
    assert accepted_any > 20  # both branches of the rejection sampler were exercised
    for pos, marg in ((1, m2), (2, m3)):
        counts = torch.bincount(torch.tensor([t[pos] for t in res.tokens]), minlength=vocab).double()
        expected = marg.double() * n
        keep = expected > 5
        stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
        assert int(counts[~keep].sum()) <= max(10, int(expected[~keep].sum() * 3 + 10))
        assert _chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (pos, counts, expected)


def test_sampling_detects_a_biased_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chi-square check above has power: accepting every draft (a lossy sampler) fails it."""
    vocab, n = 8, 240
    target = tiny_target(vocab=vocab, seed=5)
    drafter = tiny_drafter(drafter_config(vocab=vocab, block=4), seed=6)
    prompt = [1, 2, 3]
    engine = SpeculativeEngine(target, drafter, max_seq_len=16, num_blocks=256, max_batch=16)
    import blockdraft.engine as eng

    monkeypatch.setattr(eng._Run, "_uniform", lambda self, device: 0.0)  # always accept
    res = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.3, top_k=6,
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p1 = target_probs(target(torch.tensor([prompt])).logits[0, -1:], 1.3, 1.0, 6)[0]
        seq2 = torch.tensor([prompt + [a] for a in range(vocab)])
        m2 = p1 @ target_probs(target(seq2).logits[:, -1], 1.3, 1.0, 6)
    counts = torch.bincount(torch.tensor([t[1] for t in res.tokens]), minlength=vocab).double()
    expected = m2.double() * n
    keep = expected > 5
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert _chi2_sf(stat, int(keep.sum()) - 1) < 1e-3
