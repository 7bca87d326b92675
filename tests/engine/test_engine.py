"""Speculative engine: greedy output == target greedy, lossless sampling, state release."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.attention
from torch.nn.attention import SDPBackend

import blockdraft
from blockdraft.engine import DEFAULT_SDPA_BACKENDS, Request, SpeculativeEngine, generate
from blockdraft.engine.accept import accept_blocks, first_tokens
from blockdraft.proposer import DFlashProposer
from blockdraft.sampling import SamplingParams, sample_rows, target_probs
from blockdraft.target import HFTarget

from support.oracle import OracleProposer
from support.stats import assert_counts_fit, assert_marginals_fit, chi2_sf
from support.tinypair import drafter_config, tiny_drafter, tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [30]]


def reference(target: Any, prompt: list[int], n: int, stops: list[int] | None = None) -> list[int]:
    """The target's own greedy continuation, cut after the first stop token."""
    ids = torch.tensor([prompt])
    # the mask is given: generate would otherwise mask every prompt token equal to the pad id
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )[0, len(prompt) :].tolist()
    if stops:
        for i, t in enumerate(out):
            if t in stops:
                return out[: i + 1]
    return list(out)


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
    prop = OracleProposer(drafter, target, max_seq_len=64, num_pages=64, max_batch=4, truth=truth)
    engine = SpeculativeEngine(target, drafter, proposer=prop, max_seq_len=64)
    for stops in (None, [stop]):
        res = engine.generate(PROMPTS, max_new_tokens=max_new, stop_token_ids=stops)
        want = [reference(target, p, max_new, stops) for p in PROMPTS]
        assert res.tokens == want
        assert prop.pool.num_free == prop.pool.num_pages
    if max_new >= 7:
        assert max(max(a) for a in res.stats.acceptance_lengths if a) >= 3


def test_fallback_when_batching_declines(target: Any, drafter: Any) -> None:
    engine = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4, batched_path=False)
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


@pytest.mark.parametrize("runtime", ["blockdraft", "hf"])
def test_every_state_freed_after_failure(target: Any, drafter: Any, runtime: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    engine = SpeculativeEngine(target, drafter, runtime=runtime, max_seq_len=64, num_pages=64,
                               max_batch=4)
    pool = engine.proposer.pool
    real = engine.target.verify
    calls = {"n": 0}

    for exc in (RuntimeError("simulated target failure"), KeyboardInterrupt()):
        calls["n"] = 0

        def flaky(seqs: Any, blocks: Any, exc: BaseException = exc) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:
                raise exc
            return real(seqs, blocks)

        monkeypatch.setattr(engine.target, "verify", flaky)
        with pytest.raises(type(exc)):
            engine.generate(PROMPTS, max_new_tokens=10)
        assert pool.num_used == 0 and pool.num_free == pool.num_pages
        pool.check_invariants()
        assert engine.pages_used() == {"target": 0, "drafter": 0}
    monkeypatch.undo()
    # The engine is still usable afterwards.
    assert engine.generate(PROMPTS[:1], max_new_tokens=3).tokens[0] == reference(target, PROMPTS[0], 3)


def test_bad_arguments(target: Any, drafter: Any) -> None:
    with pytest.raises(ValueError):
        generate(target, drafter, PROMPTS[:1], max_new_tokens=0)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # before generate: settings are checked where they are made
    with pytest.raises(TypeError, match="sampling"):
        generate(target, drafter, PROMPTS[:1], max_new_tokens=2, sampling=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        generate(target, drafter, [[]], max_new_tokens=2)
    assert blockdraft.engine.generate is generate


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampling_matches_target_distribution(sampled_drafts: bool) -> None:
    """Chi-square goodness of fit of the 2nd and 3rd generated tokens (the first speculative
    ones) against the target's exact marginals, computed by enumeration on an 8-token
    vocabulary, with greedy drafts and with drafts sampled from the drafter. With a correct
    sampler the test fails with probability 1e-3 per statistic (2e-3 in all); the seeds are
    fixed, so a pass is reproducible."""
    vocab, n = 8, 480
    target = tiny_target(vocab=vocab, seed=5)
    drafter = tiny_drafter(drafter_config(vocab=vocab, block=4), seed=6)
    prompt = [1, 2, 3]
    engine = SpeculativeEngine(target, drafter, max_seq_len=16, num_pages=512, max_batch=16,
                               sampled_drafts=sampled_drafts)
    gen = torch.Generator().manual_seed(1234)
    res = engine.generate([prompt] * n, max_new_tokens=3, sampling=SamplingParams(1.3, top_k=6), generator=gen)
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
    assert_marginals_fit(res.tokens, [(1, m2), (2, m3)], vocab, n)


@pytest.mark.parametrize("where", ["device", "host"])
def test_sampling_detects_a_biased_sampler(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The chi-square check above has power: accepting every draft (a lossy sampler) fails it,
    whether the rows are decided on the device or on the host."""
    vocab, n = 8, 240
    target = tiny_target(vocab=vocab, seed=5)
    drafter = tiny_drafter(drafter_config(vocab=vocab, block=4), seed=6)
    prompt = [1, 2, 3]
    engine = SpeculativeEngine(target, drafter, max_seq_len=16, num_pages=256, max_batch=16)
    import blockdraft.engine.accept as accept_mod
    import blockdraft.engine.device_accept as device_mod

    if where == "device":  # every draft accepted: each request's first rejection is its last row
        monkeypatch.setattr(device_mod, "_first_rejected", lambda ok, owner, rank, n, last: last)
    else:
        monkeypatch.setattr(accept_mod, "on_device", lambda r: False)
        monkeypatch.setattr(accept_mod, "accept_draft", lambda p, d, q, g: (True, d))
    res = engine.generate([prompt] * n, max_new_tokens=3, sampling=SamplingParams(1.3, top_k=6),
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p1 = target_probs(target(torch.tensor([prompt])).logits[0, -1:], 1.3, 1.0, 6)[0]
        seq2 = torch.tensor([prompt + [a] for a in range(vocab)])
        m2 = p1 @ target_probs(target(seq2).logits[:, -1], 1.3, 1.0, 6)
    counts = torch.bincount(torch.tensor([t[1] for t in res.tokens]), minlength=vocab).double()
    expected = m2.double() * n
    keep = expected > 5
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2_sf(stat, int(keep.sum()) - 1) < 1e-3


class KeepsLogits(torch.nn.Module):
    """The target behind a forward that names ``logits_to_keep``; records every call."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.calls: list[tuple[int, Any, int]] = []  # (input length, logits_to_keep, logits rows)

    def forward(self, input_ids: Any, past_key_values: Any = None, use_cache: bool = True,
                output_hidden_states: bool = False, logits_to_keep: Any = 0) -> Any:
        out = self.inner(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)
        self.calls.append((input_ids.shape[1], logits_to_keep, out.logits.shape[1]))
        return out


class NoKeep(torch.nn.Module):
    """The target behind a forward without ``logits_to_keep`` (it would raise TypeError)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.calls: list[tuple[int, int]] = []  # (input length, logits rows)

    def forward(self, input_ids: Any, past_key_values: Any = None, use_cache: bool = True,
                output_hidden_states: bool = False) -> Any:
        out = self.inner(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states)
        self.calls.append((input_ids.shape[1], out.logits.shape[1]))
        return out


# Lengths 1 .. 40, so that prefill, block boundaries and windows differ per prompt.
LONG_PROMPTS = [[30], [5, 9], [(7 * i + 3) % 60 for i in range(17)], [(11 * i + 1) % 62 for i in range(40)],
                [(3 * i + 2) % 61 for i in range(9)]]


def _engine_for(wrapper: Any, target: Any, drafter: Any) -> SpeculativeEngine:
    prop = DFlashProposer(drafter, target, max_seq_len=64, num_pages=96, max_batch=4)
    return SpeculativeEngine(wrapper, drafter, proposer=prop, max_seq_len=64, runtime="hf")


def test_prefill_asks_for_the_last_row_only(target: Any, drafter: Any) -> None:
    wrapper = KeepsLogits(target)
    engine = _engine_for(wrapper, target, drafter)
    res = engine.generate(LONG_PROMPTS, max_new_tokens=9)
    assert res.tokens == [reference(target, p, 9) for p in LONG_PROMPTS]
    # The prefills come first, then the verifies.
    prefills = [c for c in wrapper.calls if c[1] != 0]
    assert prefills == [(len(p), 1, 1) for p in LONG_PROMPTS]
    assert wrapper.calls[:4] == prefills[:4]
    verifies = [c for c in wrapper.calls if c[1] == 0]
    assert verifies and all(rows == n for n, _, rows in verifies)
    assert len(wrapper.calls) == len(prefills) + len(verifies)
    # Straight from the HF target as well: one row, in the target's dtype.
    hf = engine.target
    assert isinstance(hf, HFTarget)
    logits, rows = hf.forward(LONG_PROMPTS[3], hf.new(64).cache, last_only=True)
    assert logits.shape == (1, 64) and logits.dtype == target.dtype
    assert rows.shape == (40, len(engine.proposer.target_layer_ids) * target.config.hidden_size)
    with torch.no_grad():
        full = target(torch.tensor([LONG_PROMPTS[3]])).logits[0, -1:]
    torch.testing.assert_close(logits, full)


def test_target_without_logits_to_keep(target: Any, drafter: Any) -> None:
    wrapper = NoKeep(target)
    engine = _engine_for(wrapper, target, drafter)
    hf = engine.target
    assert isinstance(hf, HFTarget)
    assert not hf.adapter.takes_logits_to_keep
    res = engine.generate(LONG_PROMPTS, max_new_tokens=8)
    assert res.tokens == [reference(target, p, 8) for p in LONG_PROMPTS]
    # The prefills come first.
    assert wrapper.calls[:5] == [(len(p), len(p)) for p in LONG_PROMPTS]
    assert all(rows == n for n, rows in wrapper.calls)  # every row computed, nothing kept
    logits, _ = hf.forward(LONG_PROMPTS[2], hf.new(64).cache, last_only=True)
    assert logits.shape == (1, 64) and logits._base is None  # a copy, not a view of all rows
    # Sampling goes through the same prefill.
    out = engine.generate(LONG_PROMPTS[:2], max_new_tokens=4, sampling=SamplingParams(0.8),
                          generator=torch.Generator().manual_seed(0))
    assert [len(t) for t in out.tokens] == [4, 4]


def test_greedy_device_path_matches_target_on_long_prompts(target: Any, drafter: Any) -> None:
    n = 15
    want = [reference(target, p, n) for p in LONG_PROMPTS]
    engine = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=96, max_batch=4)
    # Batched (two waves: 4 + 1) and one at a time.
    assert engine.generate(LONG_PROMPTS, max_new_tokens=n).tokens == want
    assert [engine.generate([p], max_new_tokens=n).tokens[0] for p in LONG_PROMPTS] == want
    assert engine.proposer.pool.num_free == engine.proposer.pool.num_pages


def test_device_greedy_accept_equals_the_fp32_host_rule() -> None:
    """The device argmax over (bf16) logits picks what the fp32 host rule (the masked path)
    picks, ties to the lowest id included."""
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    all_allowed = torch.full((2,), -1, dtype=torch.int32)

    def request(mask: Any) -> Request:
        return Request(id=1, prompt=[1], max_new_tokens=8, params=SamplingParams(), stops=frozenset(),
                       mask_fn=mask, generator=None, submitted_at=0.0)

    plain, masked = request(None), request(lambda toks: all_allowed)
    for dtype in (torch.bfloat16, torch.float32):
        for trial in range(200):
            # Few distinct values: many ties.
            logits = torch.randint(0, 4, (6, vocab), generator=gen).to(dtype)
            best = [int(torch.argmax(r.float())) for r in logits]
            assert best == [int(torch.nonzero(r == r.max())[0]) for r in logits]  # lowest id
            k = trial % 6
            drafts = best[:k] + [(best[k] + 1) % vocab] * (5 - k) if k < 5 else best[:5]
            got = accept_blocks([plain], [drafts], logits)
            assert got == accept_blocks([masked], [drafts], logits)
            assert got == [(k, best[k]) if k < 5 else (5, best[5])]
            assert first_tokens([plain], logits[2:3]) == first_tokens([masked], logits[2:3]) == [best[2]]


@contextlib.contextmanager
def _recording_sdpa_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, Any]]]:
    real = torch.nn.attention.sdpa_kernel
    seen: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def fake(backends: Any, set_priority: bool = False) -> Iterator[Any]:
        seen.append((list(backends), set_priority))
        with real(backends, set_priority=set_priority) as x:
            yield x

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", fake)
    yield seen
    monkeypatch.undo()


def test_sdpa_backends_default_and_none(target: Any, drafter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert SDPBackend.CUDNN_ATTENTION not in DEFAULT_SDPA_BACKENDS
    assert DEFAULT_SDPA_BACKENDS == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    want = [reference(target, p, 6) for p in PROMPTS]
    with _recording_sdpa_kernel(monkeypatch) as seen:
        engine = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4,
                                   runtime="hf")
        assert engine.target.sdpa_backends == DEFAULT_SDPA_BACKENDS
        assert engine.generate(PROMPTS, max_new_tokens=6).tokens == want
        # Every target call (4 prefills + the verifies) ran inside the selection.
        assert len(seen) >= len(PROMPTS) + 1
        assert all(c == (list(DEFAULT_SDPA_BACKENDS), True) for c in seen)
        seen.clear()
        custom = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4,
                                   sdpa_backends=[SDPBackend.MATH], runtime="hf")
        assert custom.generate(PROMPTS, max_new_tokens=6).tokens == want
        assert seen and all(c == ([SDPBackend.MATH], True) for c in seen)
        seen.clear()
        single = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4,
                                   sdpa_backends=SDPBackend.MATH, runtime="hf")
        assert single.target.sdpa_backends == (SDPBackend.MATH,)
        seen.clear()
        untouched = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4,
                                      sdpa_backends=None, runtime="hf")
        assert untouched.generate(PROMPTS, max_new_tokens=6).tokens == want
        assert seen == []


def test_sdpa_backends_without_set_priority(target: Any, drafter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older torch's sdpa_kernel (no set_priority) gets the backends alone."""
    real = torch.nn.attention.sdpa_kernel
    seen: list[Any] = []

    @contextlib.contextmanager
    def old(backends: Any) -> Iterator[Any]:
        seen.append(list(backends))
        with real(backends) as x:
            yield x

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", old)
    engine = SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4,
                               runtime="hf")
    assert engine.generate(PROMPTS[:2], max_new_tokens=4).tokens == [reference(target, p, 4) for p in PROMPTS[:2]]
    assert seen and all(b == list(DEFAULT_SDPA_BACKENDS) for b in seen)


@pytest.mark.parametrize("bad, exc", [
    ([], ValueError),
    ((), ValueError),
    ("flash", TypeError),
    (3, TypeError),
    ([SDPBackend.MATH, "flash"], TypeError),
    ([SDPBackend.MATH, 1], TypeError),
    ([SDPBackend.MATH, SDPBackend.MATH], ValueError),
    ([SDPBackend.ERROR], ValueError),
])
def test_sdpa_backends_validated(target: Any, drafter: Any, bad: Any, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="sdpa_backends"):
        SpeculativeEngine(target, drafter, max_seq_len=64, num_pages=64, max_batch=4, sdpa_backends=bad)


def test_sample_rows_draws_one_index_per_row_from_the_generators_stream() -> None:
    """Row ``i`` takes the ``i``-th uniform ``u`` of the generator's stream and the first index
    whose cumulative probability exceeds ``u`` (summed here in float64, one id at a time)."""
    probs = torch.softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(1)), dim=-1)
    probs[2, 3] = 0.0  # a row that is not normalised and has a hole
    a = sample_rows(probs, torch.Generator().manual_seed(7))
    u = torch.rand(5, generator=torch.Generator().manual_seed(7)).tolist()
    b = []
    for row, ui in zip(probs.double(), u):
        cdf = torch.cumsum(row, 0)
        b.append(next(t for t in range(11) if float(cdf[t]) > ui * float(cdf[-1])))
    assert a.shape == (5,) and a.dtype == torch.int64 and a.tolist() == b
    counts = torch.bincount(sample_rows(probs[:1].expand(4000, -1), torch.Generator().manual_seed(8)),
                            minlength=11)
    assert_counts_fit(counts, probs[0] * 4000 / probs[0].sum())
    one_hot = torch.zeros(3, 11)
    one_hot[torch.arange(3), torch.tensor([4, 0, 10])] = 1.0
    assert sample_rows(one_hot, None).tolist() == [4, 0, 10]


@pytest.mark.parametrize("runtime", ["blockdraft", "hf"])
@pytest.mark.parametrize("close", [True, False])
def test_a_dropped_engine_is_freed_without_a_collection(target: Any, drafter: Any, runtime: str,
                                                        close: bool) -> None:
    """Engines built one after another (a benchmark's cells, a server's restarts) each hold
    device memory (K/V pages, the drafter's pool, graphs): the last reference dropped frees it
    at once, not at the next garbage collection, since nothing in an engine refers back to it."""
    gc.collect()
    gc.disable()
    try:
        eng = SpeculativeEngine(target, drafter, runtime=runtime, max_seq_len=128, max_active=2,
                                graphs="static")
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):
            eng.submit(prompt, max_new_tokens=12)
        for _ in range(3):
            eng.step()
        refs = [weakref.ref(eng), weakref.ref(eng.proposer), weakref.ref(eng.drafts)]
        if eng.runtime is not None:
            refs.append(weakref.ref(eng.runtime))
        if close:
            eng.close()
        del eng
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()
