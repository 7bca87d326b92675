"""A request's options beyond sampling: penalties, ``min_tokens`` and log-probabilities.

Each is checked against a plain reference (a full forward of the target over the tokens so
far, the options applied by explicit loops), with speculation on (drafts that the target
accepts for long stretches, so later verify rows matter) and off, and against
:func:`blockdraft.decode`; the sampled case with penalties is checked for losslessness by a
chi-square test of the speculative marginals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import blockdraft
from blockdraft.engine import Request, SpeculativeEngine
from blockdraft.engine.accept import accept_blocks, first_tokens
from blockdraft.sampling import Penalties, SamplingParams, sample_rows, target_probs

from support.oracle import OracleProposer
from support.stats import assert_counts_fit, assert_marginals_fit
from support.tinypair import drafter_config, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = tiny_target("qwen3", seed=4)
DRAFTER = tiny_drafter(drafter_config(block=5))
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
NEW = 14
GREEDY = SamplingParams()
PENALTIES = [SamplingParams(presence_penalty=1.5, frequency_penalty=0.6, repetition_penalty=1.4),
             SamplingParams(presence_penalty=-0.8, repetition_penalty=0.7)]


def last_logits(seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return TARGET(torch.tensor([seq])).logits[0, -1].float()


def penalise(row: torch.Tensor, params: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The penalties by explicit loops: repetition over prompt + generated, then frequency and
    presence over the generated tokens."""
    row = row.clone()
    for t in set(prompt) | set(out):
        rp = params.repetition_penalty
        row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
    for t in set(out):
        row[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
    return row


def reference(prompt: list[int], n: int, params: SamplingParams = GREEDY, *,
              stops: tuple[int, ...] = (), min_tokens: int = 0,
              generator: torch.Generator | None = None) -> list[int]:
    """Target-only decoding, one full forward per token."""
    out: list[int] = []
    for _ in range(n):
        row = penalise(last_logits(prompt + out), params, prompt, out)
        if len(out) < min_tokens:
            row[list(stops)] = float("-inf")
        if params.greedy:
            tok = int(torch.argmax(row))
        else:
            probs = target_probs(row[None], params.temperature, params.top_p, params.top_k)
            tok = int(sample_rows(probs, generator)[0])
        out.append(tok)
        if tok in stops:
            break
    return out


def speculative(truth_new: list[list[int]], **kw: Any) -> SpeculativeEngine:
    prop = OracleProposer(DRAFTER, TARGET, max_seq_len=64, num_pages=64, max_batch=4,
                          truth=[p + t for p, t in zip(PROMPTS, truth_new)])
    return SpeculativeEngine(TARGET, DRAFTER, proposer=prop, max_seq_len=64, **kw)


def target_only() -> SpeculativeEngine:
    return SpeculativeEngine(TARGET, DRAFTER, max_seq_len=64, num_pages=64, max_batch=4, speculate=False)


def test_penalties_equal_explicit_loops() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=gen) * 3
    prompt, out = [1, 5, 5, 39], [5, 7, 7, 7, 2]
    for params in PENALTIES:
        pen = Penalties(params, 40, prompt, out[:2])
        for t in out[2:]:
            pen.add(t)
        assert torch.allclose(pen.apply(logits), penalise(logits, params, prompt, out))
    assert not SamplingParams().penalised and all(p.penalised for p in PENALTIES)
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"repetition_penalty": 0.0},
                {"repetition_penalty": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.parametrize("params", PENALTIES, ids=["all-three", "negative"])
def test_greedy_penalties_equal_target_only_decoding(params: SamplingParams) -> None:
    want = [reference(p, NEW, params) for p in PROMPTS]
    assert want != [reference(p, NEW) for p in PROMPTS]  # the penalties change the output
    with speculative(want) as eng:
        spec = eng.generate(PROMPTS, max_new_tokens=NEW, sampling=params)
    assert max(max(a) for a in spec.stats.acceptance_lengths) >= 3  # later rows were verified
    with target_only() as off:
        plain = off.generate(PROMPTS, max_new_tokens=NEW, sampling=params)
    decoded = blockdraft.decode(TARGET, PROMPTS, max_new_tokens=NEW, sampling=params)
    assert spec.tokens == plain.tokens == [list(t) for t in decoded.tokens] == want


def test_seeded_sampling_with_penalties_draws_as_the_reference() -> None:
    params = SamplingParams(temperature=0.9, top_k=40, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.3)
    want = reference(PROMPTS[2], NEW, params, generator=torch.Generator().manual_seed(11))
    with target_only() as off:
        rid = off.submit(PROMPTS[2], max_new_tokens=NEW, sampling=params, seed=11)
        list(off.stream([rid]))
        got = off.request(rid).out
    decoded = blockdraft.decode(TARGET, [PROMPTS[2]], max_new_tokens=NEW, sampling=params,
                                generator=torch.Generator().manual_seed(11)).tokens[0]
    assert got == list(decoded) == want


def test_speculative_sampling_with_penalties_is_lossless() -> None:
    """Chi-square goodness of fit of the 2nd and 3rd generated tokens (the first speculative
    ones, drafted from the drafter's unpenalised distribution) against the penalised target's
    exact marginals, by enumeration on an 8-token vocabulary. A correct sampler fails with
    probability 1e-3 per statistic; the seeds are fixed, so a pass is reproducible."""
    vocab, n = 8, 480
    target = tiny_target(vocab=vocab, seed=5)
    drafter = tiny_drafter(drafter_config(vocab=vocab, block=4), seed=6)
    prompt = [1, 2, 3]
    params = SamplingParams(1.3, top_k=6, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.5)
    engine = SpeculativeEngine(target, drafter, max_seq_len=16, num_pages=512, max_batch=16, sampled_drafts=True)
    res = engine.generate([prompt] * n, max_new_tokens=3, sampling=params,
                          generator=torch.Generator().manual_seed(4322))

    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            rows = target(torch.tensor([prompt + a for a in prefixes])).logits[:, -1].float()
        rows = torch.stack([penalise(r, params, prompt, a) for r, a in zip(rows, prefixes)])
        return target_probs(rows, 1.3, 1.0, 6)

    p1 = probs([[]])[0]
    p2_given = probs([[a] for a in range(vocab)])  # [a, b]
    p3_given = probs([[a, b] for a in range(vocab) for b in range(vocab)])  # [(a, b), c]
    m2 = p1 @ p2_given
    m3 = (p1[:, None] * p2_given).reshape(-1) @ p3_given
    assert sum(1 for a in res.stats.acceptance_lengths if a and a[0] > 1) > 20  # drafts were accepted
    assert_marginals_fit(res.tokens, [(1, m2), (2, m3)], vocab, n)


def test_rejection_sampling_penalises_every_verify_row() -> None:
    """``accept_blocks`` on fixed verify rows: the first token follows the penalised row 0, and
    after an accepted draft ``a`` the next follows row 1 penalised with ``a`` counted too
    (chi-square over 3000 blocks; a correct sampler fails with probability 1e-3 per check)."""
    vocab, trials = 8, 3000
    gen = torch.Generator().manual_seed(8)
    # Block [anchor, d0, d1]. Token 5 is likely everywhere, so a draft of 5 is often accepted
    # and the penalties it then earns at row 1 decide much of row 1's distribution.
    logits = torch.randn(3, vocab, generator=gen)
    logits[:, 5] += 2.5
    q = torch.softmax(torch.randn(2, vocab, generator=gen) + 2.0 * (torch.arange(vocab) == 5), dim=-1)
    params = SamplingParams(1.0, presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=2.0)
    prompt, out = [1, 2], [3]
    req = Request(id=1, prompt=prompt, max_new_tokens=16, params=params, stops=frozenset(),
                  mask_fn=None, generator=gen, submitted_at=0.0, out=list(out))
    firsts = torch.zeros(vocab)
    seconds = torch.zeros(vocab, vocab)  # [first, second] after an accepted first draft
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        accepted, nxt = accept_blocks([req], [drafts], logits, [q])[0]
        emitted = [*drafts[:accepted], nxt]
        firsts[emitted[0]] += 1
        if len(emitted) > 1:
            seconds[emitted[0], emitted[1]] += 1

    def probs(row: torch.Tensor, generated: list[int]) -> torch.Tensor:
        return target_probs(penalise(row, params, prompt, generated)[None], 1.0, 1.0, 0)[0]

    expected_1 = probs(logits[0], out) * trials
    expected_2 = torch.stack([probs(logits[1], [*out, a]) * seconds[a].sum() for a in range(vocab)])
    assert seconds.sum() > 500  # drafts were accepted often enough to test row 1
    assert_counts_fit(firsts, expected_1, "row 0")
    assert_counts_fit(seconds.reshape(-1), expected_2.reshape(-1), "row 1")


def test_min_tokens_masks_the_stop_tokens_until_reached() -> None:
    free = [reference(p, NEW) for p in PROMPTS]
    stop = free[0][1]  # prompt 0 would stop at its second token
    want = [reference(p, NEW, stops=(stop,), min_tokens=6) for p in PROMPTS]
    assert len(reference(PROMPTS[0], NEW, stops=(stop,))) == 2 and len(want[0]) > 6
    with speculative(want) as eng:
        spec = eng.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[stop], min_tokens=6)
    with target_only() as off:
        plain = off.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[stop], min_tokens=6)
    assert spec.tokens == plain.tokens == want
    assert all(stop not in out[:6] for out in spec.tokens)


@pytest.mark.parametrize("runtime", ["blockdraft", "hf"])
def test_logprobs_are_the_targets_log_softmax_at_each_token(runtime: str) -> None:
    greedy = [reference(p, NEW) for p in PROMPTS]
    sampled = SamplingParams(temperature=1.2, presence_penalty=0.5)
    runs = []
    with speculative(greedy, runtime=runtime) as eng:
        runs.append(eng.generate(PROMPTS, max_new_tokens=NEW, logprobs=3))
        ids = [eng.submit(PROMPTS[1], max_new_tokens=NEW, sampling=sampled, seed=3, logprobs=0),
               eng.submit(PROMPTS[2], max_new_tokens=NEW)]
        events = [ev for ev in eng.stream(ids)]
        reqs = [eng.request(i) for i in ids]
    with target_only() as off:
        runs.append(off.generate(PROMPTS, max_new_tokens=NEW, logprobs=3))
    assert max(max(a) for a in runs[0].stats.acceptance_lengths) >= 3
    for res in runs:
        assert res.tokens == greedy and res.logprobs is not None
        for prompt, out, lps in zip(PROMPTS, res.tokens, res.logprobs):
            _check_logprobs(prompt, out, lps, 3)
    _check_logprobs(PROMPTS[1], reqs[0].out, reqs[0].out_logprobs, 0)
    assert reqs[1].out_logprobs == []  # not asked for: none computed
    assert [lp for ev in events if ev.request_id == ids[0] for lp in ev.logprobs] == reqs[0].out_logprobs
    assert all(ev.logprobs == () for ev in events if ev.request_id == ids[1])


def _check_logprobs(prompt: list[int], out: list[int], lps: list[Any], k: int) -> None:
    with torch.no_grad():
        logits = TARGET(torch.tensor([prompt + out])).logits[0].float()
    want = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(out)], dim=-1)
    assert [lp.token for lp in lps] == out
    for row, tok, lp in zip(want, out, lps):
        assert lp.logprob == pytest.approx(float(row[tok]), abs=1e-4)
        top = torch.topk(row, k) if k else None
        assert [i for i, _ in lp.top] == ([] if top is None else top.indices.tolist())
        if top is not None:
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_min_tokens_yields_to_a_grammar_that_allows_only_stops() -> None:
    """The stop tokens are masked until ``min_tokens`` unless nothing else would be allowed."""
    vocab, stop = 64, 9
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    logits[:, stop] = 10.0  # the target wants to stop

    def only(tokens: list[int]) -> Any:
        words = [0, 0]
        for t in tokens:  # bit t % 32 of word t // 32 (no token here reaches bit 31)
            words[t // 32] |= 1 << (t % 32)
        return lambda generated: torch.tensor(words, dtype=torch.int32)

    def request(mask_fn: Any) -> Request:
        return Request(id=1, prompt=[1], max_new_tokens=8, params=GREEDY, stops=frozenset({stop}),
                       mask_fn=mask_fn, generator=None, submitted_at=0.0, min_tokens=3)

    assert first_tokens([request(None)], logits[:1]) == [int(torch.argsort(logits[0])[-2])]
    assert first_tokens([request(only([stop, 40]))], logits[:1]) == [40]
    assert first_tokens([request(only([stop]))], logits[:1]) == [stop]
    late = request(None)
    late.out = [5, 6, 7]  # min_tokens reached: the stop token is the target's choice again
    assert accept_blocks([late], [[stop]], logits) == [(1, stop)]


def test_bad_options_are_refused() -> None:
    with target_only() as eng:
        for kw, exc, words in (({"min_tokens": 5}, ValueError, "min_tokens"),
                               ({"min_tokens": -1}, ValueError, "min_tokens"),
                               ({"min_tokens": 1.5}, TypeError, "min_tokens"),
                               ({"logprobs": -1}, ValueError, "logprobs"),
                               ({"logprobs": 65}, ValueError, "logprobs"),
                               ({"logprobs": True}, TypeError, "logprobs")):
            with pytest.raises(exc, match=words):
                eng.submit([1, 2], max_new_tokens=4, **kw)
        assert eng.num_waiting == 0


def test_choices_of_one_prompt_share_its_prefill() -> None:
    """Three seeded choices of one prompt submitted together (as the server submits ``n``):
    the prompt runs through the target once, and each choice draws what a request of it alone
    with its seed draws."""
    params = SamplingParams(temperature=0.9, top_p=0.95)
    prompt = PROMPTS[2]
    seeds = [11, 12, 13]
    with SpeculativeEngine(TARGET, DRAFTER, runtime="blockdraft", max_seq_len=64, max_active=4) as eng:
        solo = []
        for seed in seeds:
            rid = eng.submit(prompt, max_new_tokens=NEW, sampling=params, seed=seed)
            list(eng.stream([rid]))
            solo.append(eng.request(rid).out)
        rt = eng.runtime
        assert rt is not None
        rows: list[int] = []
        forward = rt.forward
        rt.forward = lambda seqs, toks, **kw: (rows.append(sum(map(len, toks))), forward(seqs, toks, **kw))[1]
        rids = [eng.submit(prompt, max_new_tokens=NEW, sampling=params, seed=s) for s in seeds]
        eng.step()  # admits and prefills the three together, then their first step
        prefill_rows = rows[0]
        list(eng.stream(rids))
        assert prefill_rows == len(prompt)
        assert [eng.request(r).out for r in rids] == solo
        assert eng.pages_used() == {"target": 0, "drafter": 0}
