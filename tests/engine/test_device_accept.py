"""Acceptance on the device (:mod:`blockdraft.engine.device_accept`) against a row-by-row
reference with the same uniforms, and against the target distribution by chi-square.

The reference walks each request's rows in Python: draft ``d`` at row ``j`` is accepted when
``u_j·q_j(d) < p_j(d)`` (``q`` one-hot for a greedy draft), else the token is the first id whose
cumulative residual mass, summed in float64, exceeds ``u·total``; after the last draft the
bonus token is drawn from ``p`` the same way. Batched, the device code must give the same
(accepted, token) for every request of a ragged batch mixing greedy and sampled requests,
greedy and sampled drafts and different temperatures, top-k and top-p."""

from __future__ import annotations

import random

import pytest
import torch

from blockdraft.engine import Request
from blockdraft.engine.accept import accept_blocks
from blockdraft.engine.device_accept import decide_on_device, draw_uniforms, on_device
from blockdraft.sampling import SamplingParams, target_probs

from support.stats import assert_counts_fit


def request(params: SamplingParams, seed: int, **kw: object) -> Request:
    return Request(id=seed, prompt=[1, 2], max_new_tokens=64, params=params, stops=frozenset(),
                   mask_fn=None, generator=torch.Generator().manual_seed(seed), submitted_at=0.0,
                   **kw)  # type: ignore[arg-type]


def draw_ref(mass: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(mass.double(), 0)
    target = u * float(cdf[-1])
    for t in range(mass.numel()):
        if float(cdf[t]) > target and float(mass[t]) > 0:
            return t
    return int(torch.nonzero(mass > 0).max())


def reference(r: Request, drafts: list[int], rows: torch.Tensor, q: torch.Tensor | None,
              u: torch.Tensor | None) -> tuple[int, int]:
    if r.params.greedy:
        choice = torch.argmax(rows, dim=-1).tolist()
        for j, d in enumerate(drafts):
            if d != choice[j]:
                return j, choice[j]
        return len(drafts), choice[len(drafts)]
    assert u is not None
    k = len(drafts)
    p = target_probs(rows, r.params.temperature, r.params.top_p, r.params.top_k)
    for j, d in enumerate(drafts):
        qj = torch.zeros_like(p[j]) if q is None else q[j]
        if q is None:
            qj[d] = 1.0
        residual = (p[j] - qj).clamp_min(0.0)
        if float(residual.sum()) <= 0.0 or (float(qj[d]) > 0 and float(u[j]) * float(qj[d]) < float(p[j, d])):
            continue
        return j, draw_ref(residual, float(u[k + j]))
    return k, draw_ref(p[k], float(u[2 * k]))


PARAMS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
          SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, top_k=12, top_p=0.9)]


# Which settings a batch's requests draw from: greedy and sampled mixed (the sampled rows are
# then decided apart from the rest), sampled only, greedy only.
MIXES = {"mixed": PARAMS, "sampled": PARAMS[1:], "greedy": PARAMS[:1]}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("seed", range(6))
def test_a_ragged_mixed_batch_matches_the_row_by_row_reference(seed: int, mix: str, device: str) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, n = 40, 12
    reqs, drafts, qs = [], [], []
    for i in range(n):
        # a mixed batch has a greedy and a sampled request at least
        params = PARAMS[i] if mix == "mixed" and i < 2 else rng.choice(MIXES[mix])
        reqs.append(request(params, 100 * seed + i))
        k = rng.choice([0, 1, 3, 7])
        sampled_drafts = not reqs[-1].params.greedy and rng.random() < 0.5
        q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, -1) if sampled_drafts else None
        qs.append(q)
        drafts.append(torch.multinomial(q, 1, generator=gen)[:, 0].tolist() if q is not None and k
                      else [rng.randrange(vocab) for _ in range(k)])
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    # Make acceptance likely somewhere: some drafts are their row's argmax.
    at = 0
    for d in drafts:
        for j, t in enumerate(d):
            if rng.random() < 0.6:
                logits[at + j, t] += 8.0
        at += len(d) + 1
    uniforms = draw_uniforms(reqs, drafts)
    on = torch.device(device)
    got = decide_on_device(reqs, drafts, logits.to(on), [None if q is None else q.to(on) for q in qs],
                           uniforms).tolist()
    at = 0
    want = []
    for r, d, q, u in zip(reqs, drafts, qs, uniforms):
        want.append(reference(r, d, logits[at : at + len(d) + 1], q, u))
        at += len(d) + 1
    assert [tuple(x) for x in got] == want
    assert any(a > 0 for a, _ in want) and any(a < len(d) for (a, _), d in zip(want, drafts))


def test_sampled_acceptance_is_lossless() -> None:
    """3,000 requests at once, each with its own generator, over one block [anchor, d0, d1]
    with drafts drawn from q: the first emitted token follows p row 0, and after an accepted
    first draft ``a`` the second follows p row 1 (chi-square; fails a correct sampler with
    probability 1e-3 per check)."""
    vocab, trials = 8, 3000
    gen = torch.Generator().manual_seed(3)
    block = torch.randn(3, vocab, generator=gen)
    block[:, 5] += 1.5
    q = torch.softmax(torch.randn(2, vocab, generator=gen) + 1.5 * (torch.arange(vocab) == 5), dim=-1)
    params = SamplingParams(temperature=0.8)
    reqs = [request(params, 10_000 + i) for i in range(trials)]
    drafts = [torch.multinomial(q, 1, generator=gen)[:, 0].tolist() for _ in range(trials)]
    logits = block.repeat(trials, 1)
    got = decide_on_device(reqs, drafts, logits, [q] * trials, draw_uniforms(reqs, drafts)).tolist()
    p = target_probs(block, 0.8, 1.0, 0)
    firsts = torch.zeros(vocab)
    seconds = torch.zeros(vocab, vocab)
    for (a, nxt), d in zip(got, drafts):
        emitted = [*d[:a], nxt]
        firsts[emitted[0]] += 1
        if len(emitted) > 1:
            seconds[emitted[0], emitted[1]] += 1
    assert_counts_fit(firsts, p[0] * trials, "first")
    for a in range(vocab):
        if firsts[a] > 200 and seconds[a].sum() > 200:
            assert_counts_fit(seconds[a], p[1] * seconds[a].sum(), ("second after", a))


def test_accept_blocks_splits_device_and_host_requests() -> None:
    """A penalised request is decided on the host, the others on the device; each answer is
    the one its own path gives alone."""
    gen = torch.Generator().manual_seed(4)
    vocab = 16
    greedy = request(SamplingParams(), 1)
    sampled = request(SamplingParams(temperature=0.9), 2)
    penalised = request(SamplingParams(repetition_penalty=1.5), 3, out=[4])
    assert on_device(greedy) and on_device(sampled) and not on_device(penalised)
    drafts = [[3, 4, 5], [2], [7, 7]]
    logits = torch.randn(9, vocab, generator=gen)
    logits[0, 3] += 9.0  # the greedy request accepts its first draft
    together = accept_blocks([greedy, sampled, penalised], drafts, logits)
    again = [request(SamplingParams(), 1), request(SamplingParams(temperature=0.9), 2),
             request(SamplingParams(repetition_penalty=1.5), 3, out=[4])]
    alone = [accept_blocks([again[0]], [drafts[0]], logits[0:4])[0],
             accept_blocks([again[1]], [drafts[1]], logits[4:6])[0],
             accept_blocks([again[2]], [drafts[2]], logits[6:9])[0]]
    assert together == alone
    assert together[0][0] >= 1
