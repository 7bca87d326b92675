"""The split top-K kernel vs ``torch.topk``: the same set of values and ids (the order of a
row's K is not part of the contract), and ties resolved to the lowest ids."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

from support.kernel_support import K, need_triton

CPU = torch.device("cpu")


def _mod(device: torch.device) -> ModuleType:
    need_triton(device)
    return importlib.import_module("blockdraft.kernels.topk")


def distinct_logits(rows: int, vocab: int, dtype: torch.dtype, gen: torch.Generator,
                    device: torch.device) -> torch.Tensor:
    """Rows of distinct values in the dtype: a random permutation of evenly spaced values
    (fp16 and bf16 hold 1/16 steps exactly only up to a few thousand distinct values, so wide
    rows repeat the smaller values and keep their largest ones distinct)."""
    span = min(vocab, 2048 if dtype == torch.float16 else 256 if dtype == torch.bfloat16
               else vocab)
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])
    # ranks >= vocab - span are distinct; lower ones fold onto the bottom values
    vals = (ranks - (vocab - span)).clamp(min=-1).to(torch.float32) / 16
    return vals.to(dtype).to(device)


def assert_same_topk(logits: torch.Tensor, k: int, got: tuple[torch.Tensor, torch.Tensor],
                     distinct: bool) -> None:
    want_v, want_i = torch.topk(logits.float(), k, dim=-1, sorted=False)
    got_v, got_i = got
    assert got_v.dtype == logits.dtype and got_i.dtype == torch.int64
    assert got_v.shape == got_i.shape == (*logits.shape[:-1], k)
    assert torch.equal(got_v.float().sort(-1).values, want_v.sort(-1).values)
    # every id names its value
    assert torch.equal(logits.gather(-1, got_i), got_v)
    if distinct:
        assert torch.equal(got_i.sort(-1).values, want_i.sort(-1).values)


def assert_topk_lowest_ids(logits: torch.Tensor, k: int,
                           got: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Against ``torch.topk`` with ties anywhere (rows [R, V]): the sorted values are equal;
    every id above the K-th value is torch's too; at the K-th value the lowest ids are taken."""
    want_v = torch.topk(logits, k, dim=-1).values
    got_v, got_i = got
    assert torch.equal(got_v.sort(-1, descending=True).values, want_v)
    assert torch.equal(logits.gather(-1, got_i), got_v)
    kth = want_v[:, -1:]
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, got_i, True)
    assert int(chosen.sum()) == got_i.numel()  # no id twice
    above = logits > kth
    assert torch.equal(chosen & above, above)
    at = logits == kth
    taken = (chosen & at).sum(-1, keepdim=True)
    assert torch.equal(chosen & at, at & (at.to(torch.int32).cumsum(-1) <= taken))


def case_topk(device: torch.device, dtype: torch.dtype, rows: int, vocab: int, k: int,
              seed: int = 0, num_splits: int | None = None,
              block: tuple[int, int] | None = None) -> None:
    mod = _mod(device)
    gen = torch.Generator().manual_seed(seed)
    logits = distinct_logits(rows, vocab, dtype, gen, device)
    got = mod.topk(logits, k, num_splits=num_splits, block=block)
    assert_same_topk(logits, k, got, distinct=True)
    # sorted by value descending
    assert torch.all(got[0][:, 1:] <= got[0][:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1000), (3, 4099), (17, 1000)])
@pytest.mark.parametrize("k", [1, 8])
def test_topk(dtype: torch.dtype, rows: int, vocab: int, k: int) -> None:
    case_topk(CPU, dtype, rows, vocab, k, seed=rows * vocab + k)


@pytest.mark.parametrize(("splits", "block"), [(1, (256, 2)), (3, (256, 2)), (7, (64, 1)),
                                               (None, (32, 1))])
def test_topk_splits_and_tiles(splits: int | None, block: tuple[int, int]) -> None:
    """Split and tile shapes other than the chosen ones (a ragged last tile, splits with
    fewer than K ids of their own, tiles past the vocabulary in the last split)."""
    case_topk(CPU, torch.float32, 3, 4099, 8, seed=splits or 0, num_splits=splits, block=block)


def test_topk_ties_go_to_the_lowest_ids() -> None:
    """Few distinct values: the K-th place is tied across splits and tiles; the lowest ids of
    the tied value are taken, and every larger value is."""
    mod = _mod(CPU)
    gen = torch.Generator().manual_seed(5)
    vocab, k = 4099, 8
    logits = torch.randint(-3, 2, (3, vocab), generator=gen).to(torch.float32)
    logits[0, [4000, 17, 2500]] = 5.0  # three clear winners, then the lowest ids of 1.0
    logits[2] = 0.0  # one value everywhere: ids 0..7
    for splits in (None, 1, 5):
        vals, ids = mod.topk(logits, k, num_splits=splits, block=(256, 2))
        for r in range(3):
            row = logits[r]
            order = sorted(range(vocab), key=lambda i: (-row[i].item(), i))[:k]
            assert ids[r].tolist() == order, (splits, r)
            assert torch.equal(vals[r], row[order])
    assert ids[2].tolist() == list(range(k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_topk_many_ties_against_torch(dtype: torch.dtype) -> None:
    mod = _mod(CPU)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randint(-20, 4, (5, 4099), generator=gen).to(dtype)
    assert_topk_lowest_ids(logits, 8, mod.topk(logits, 8))


def test_topk_minus_inf_and_leading_dims() -> None:
    """-inf logits are real candidates (ranked by id), and [n, T, V] logits give [n, T, K]."""
    mod = _mod(CPU)
    logits = torch.full((2, 3, 1000), float("-inf"), dtype=torch.float16)
    logits[0, 1, 999] = 1.0
    vals, ids = mod.topk(logits, 4)
    assert ids.shape == (2, 3, 4)
    assert ids[0, 1].tolist() == [999, 0, 1, 2]
    assert ids[1, 2].tolist() == [0, 1, 2, 3]
    assert torch.isinf(vals[1, 2]).all()


def test_topk_ops_entry_and_bad_k() -> None:
    need_triton(CPU)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    for backend in ("torch", "triton"):
        got = K.ops(backend).topk(logits, 5)  # type: ignore[arg-type]
        assert_same_topk(logits, 5, got, distinct=True)
    with pytest.raises(ValueError, match="k"):
        K.ops("triton").topk(logits, 51)
