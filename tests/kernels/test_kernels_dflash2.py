"""DFlash2's kernels (the grouped dynamic causal convolution, the candidate selector's walk) vs
their references, and the references vs the drafter's own modules, on fresh random inputs.

The ``case_*`` helpers take a device and dtype, so the GPU file reruns them in bf16.
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.models.layers import CandidateSelector, grouped_dynamic_conv

from support.kernel_support import K, assert_close, need_triton

CPU = torch.device("cpu")


def _conv_inputs(
    n: int, block: int, size: int, kernel: int, group: int, dtype: torch.dtype,
    device: torch.device, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n*B, H], taps [n*B, K, G] as a strided view (the second half of a [n*B, 2, K, G]
    projection, as the drafter slices it), base [K, H]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n * block, size, generator=gen).to(dtype).to(device)
    both = torch.randn(n * block, 2, kernel, size // group, generator=gen).to(dtype).to(device)
    base = torch.randn(kernel, size, generator=gen).to(dtype).to(device)
    return x, both[:, 1], base


def case_dynamic_conv(device: torch.device, dtype: torch.dtype, n: int, block: int, size: int,
                      kernel: int, group: int, seed: int = 0) -> None:
    need_triton(device)
    x, taps, base = _conv_inputs(n, block, size, kernel, group, dtype, device, seed)
    want = K.reference.dynamic_conv(x, taps, base, block, group)
    got = K.ops("triton").dynamic_conv(x, taps, base, block, group)
    assert got.shape == x.shape and got.dtype == dtype
    assert not torch.isnan(got).any()
    assert_close(got.cpu(), want.cpu(), "dynamic_conv")


@pytest.mark.parametrize(("n", "block", "size", "kernel", "group"),
                         [(1, 4, 16, 3, 8), (3, 5, 24, 2, 4), (2, 2, 8, 3, 8), (1, 1, 12, 1, 3)])
def test_dynamic_conv_kernel(n: int, block: int, size: int, kernel: int, group: int) -> None:
    case_dynamic_conv(CPU, torch.float32, n, block, size, kernel, group, seed=n + block)


@pytest.mark.parametrize(("block", "kernel"), [(4, 3), (3, 5)])
def test_dynamic_conv_reference_is_the_drafters_convolution(block: int, kernel: int) -> None:
    """The op's reference equals the drafter's ``grouped_dynamic_conv`` (fp32), including taps
    longer than the block; and a row never reads the block before it."""
    x, taps, base = _conv_inputs(3, block, 16, kernel, 4, torch.float32, CPU, seed=kernel)
    want = grouped_dynamic_conv(x.view(3, block, 16), taps.reshape(3, block, kernel, 4), base, 4)
    got = K.reference.dynamic_conv(x, taps, base, block, 4)
    torch.testing.assert_close(got, want.reshape(3 * block, 16), atol=2e-6, rtol=1e-5)
    changed = x.clone()
    changed[:block] += 1.0  # the first block only
    again = K.reference.dynamic_conv(changed, taps, base, block, 4)
    assert torch.equal(again[block:], got[block:])
    assert not torch.equal(again[:block], got[:block])


def test_dynamic_conv_rejects_bad_shapes() -> None:
    need_triton(CPU)
    x, taps, base = _conv_inputs(2, 4, 16, 3, 8, torch.float32, CPU, seed=1)
    conv = K.ops("triton").dynamic_conv
    with pytest.raises(ValueError, match="blocks of 3"):
        conv(x, taps, base, 3, 8)
    with pytest.raises(ValueError, match="taps"):
        conv(x, taps[:, :2], base, 4, 8)
    with pytest.raises(ValueError, match="group_size 5"):
        conv(x, taps, base, 4, 5)


def _walk_inputs(
    n: int, steps: int, top_k: int, rank: int, vocab: int, dtype: torch.dtype,
    device: torch.device, seed: int,
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, steps, vocab, generator=gen)
    unary, candidates = torch.topk(logits, top_k, dim=-1, sorted=False)
    return {
        "unary": unary.to(dtype).to(device),
        "candidates": candidates.to(device),
        "projected": torch.randn(n, steps, rank, generator=gen).to(dtype).to(device),
        "pred": torch.randn(vocab, rank, generator=gen).to(dtype).to(device),
        "succ": torch.randn(vocab, rank, generator=gen).to(dtype).to(device),
        "anchors": torch.randint(0, vocab, (n,), generator=gen).to(device),
    }


def _gumbel(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed)).clamp_min(1e-12)
    return (-torch.log(-torch.log(u))).to(device)


def case_selector_walk(device: torch.device, dtype: torch.dtype, n: int, steps: int, top_k: int,
                       rank: int, vocab: int, sampled: bool, seed: int = 0) -> None:
    need_triton(device)
    args = _walk_inputs(n, steps, top_k, rank, vocab, dtype, device, seed)
    noise = _gumbel((n, steps, top_k), seed + 100, device) if sampled else None
    want_tok, want_q = K.reference.selector_walk(**args, noise=noise, temperature=0.7)
    got_tok, got_q = K.ops("triton").selector_walk(**args, noise=noise, temperature=0.7)
    assert got_tok.dtype == torch.int64 and got_tok.shape == (n, steps)
    assert torch.equal(got_tok.cpu(), want_tok.cpu())
    if sampled:
        assert got_q is not None and want_q is not None
        # fp32 from the same inputs, summed in another order (scores of a few units)
        torch.testing.assert_close(got_q.cpu(), want_q.cpu(), atol=1e-4, rtol=1e-4)
    else:
        assert got_q is None and want_q is None


@pytest.mark.parametrize(("n", "steps", "top_k", "rank", "vocab"),
                         [(1, 3, 4, 8, 50), (5, 7, 8, 32, 100), (2, 1, 3, 5, 20), (3, 4, 1, 2, 9)])
@pytest.mark.parametrize("sampled", [False, True])
def test_selector_walk_kernel(n: int, steps: int, top_k: int, rank: int, vocab: int,
                              sampled: bool) -> None:
    case_selector_walk(CPU, torch.float32, n, steps, top_k, rank, vocab, sampled, seed=n * steps)


def _selector(vocab: int, hidden: int, rank: int, top_k: int, seed: int) -> CandidateSelector:
    sel = CandidateSelector(hidden, vocab, rank, top_k)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return sel


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_walk_is_the_selectors_walk(backend: str) -> None:
    """Both backends' walk over ``topk`` + ``hidden_projection`` picks what
    ``CandidateSelector.select`` picks (fp32, fresh random inputs)."""
    if backend == "triton":
        need_triton(CPU)
    for seed in range(3):
        sel = _selector(40, 12, 6, 5, seed)
        gen = torch.Generator().manual_seed(seed + 10)
        hidden = torch.randn(3, 6, 12, generator=gen)
        logits = torch.randn(3, 6, 40, generator=gen)
        anchors = torch.randint(0, 40, (3,), generator=gen)
        want, _, _ = sel.select(hidden, logits, anchors)
        unary, cand = torch.topk(logits, 5, dim=-1, sorted=False)
        got, q = K.ops(backend).selector_walk(  # type: ignore[arg-type]
            unary, cand, sel.hidden_projection(hidden), sel.predecessor_codebook,
            sel.successor_codebook, anchors)
        assert q is None
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampled_walk_returns_the_selectors_distribution(backend: str) -> None:
    """q of each row is ``softmax(score / T)`` with the selector's scores given the drafts before
    it, and each draft is one of its row's candidates."""
    if backend == "triton":
        need_triton(CPU)
    sel = _selector(30, 8, 4, 6, 7)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 8, generator=gen)
    logits = torch.randn(2, 5, 30, generator=gen)
    anchors = torch.tensor([3, 29])
    unary, cand = torch.topk(logits, 6, dim=-1, sorted=False)
    projected = sel.hidden_projection(hidden)
    tokens, q = K.ops(backend).selector_walk(  # type: ignore[arg-type]
        unary, cand, projected, sel.predecessor_codebook, sel.successor_codebook, anchors,
        noise=_gumbel((2, 5, 6), 4, CPU), temperature=0.5)
    assert q is not None
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
    scores = unary + sel.pair_scores(projected, prev, cand)
    torch.testing.assert_close(q, torch.softmax(scores / 0.5, dim=-1), atol=2e-6, rtol=1e-5)
    assert (cand == tokens[..., None]).any(-1).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_walk_breaks_ties_on_the_first_candidate(backend: str) -> None:
    """Equal scores choose the first candidate among them, as ``torch.argmax`` does."""
    if backend == "triton":
        need_triton(CPU)
    unary = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])
    cand = torch.tensor([[[5, 7, 2, 9], [4, 1, 8, 3]]])
    zeros = torch.zeros(1, 2, 3)  # no pairwise part: the scores are the unary ones
    book = torch.randn(10, 3)
    tokens, _ = K.ops(backend).selector_walk(  # type: ignore[arg-type]
        unary, cand, zeros, book, book, torch.tensor([0]))
    assert tokens.tolist() == [[7, 4]]


def test_sampled_walk_draws_from_q() -> None:
    """With Gumbel noise, the choices follow q (one row, many draws)."""
    args = _walk_inputs(1, 1, 4, 3, 12, torch.float32, CPU, 5)
    args = {k: (v.expand(4000, *v.shape[1:]) if k != "pred" and k != "succ" else v)
            for k, v in args.items()}
    tokens, q = K.reference.selector_walk(**args, noise=_gumbel((4000, 1, 4), 9, CPU),
                                          temperature=1.0)
    assert q is not None
    cand = args["candidates"][0, 0]
    freq = torch.stack([(tokens[:, 0] == c).float().mean() for c in cand])
    torch.testing.assert_close(freq, q[0, 0], atol=0.03, rtol=0.0)
