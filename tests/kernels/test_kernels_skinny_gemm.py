"""The weight-streaming GEMMs (``linear``, ``linear_silu_mul``, ``linear_argmax``) vs their
references on odd sizes: 1, 3 and 16 rows, column and reduction sizes that are not multiples of
the blocks, fewer columns than one block, several split-K parts, with and without a bias.

The references are computed in fp32 and rounded once to the dtype, as the kernels do; the
argmax cases use integer-valued inputs, so every logit is exact in any summation order and
ties (constructed ones included) must resolve to the lowest column exactly as ``torch.argmax``.
Outputs are NaN-filled before the launch, so an element the kernel never writes fails.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.nn import functional as F

from support.kernel_support import K, assert_close, need_triton
from test_kernels_fused import nan_allocations

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16]
# (rows, weight rows N, K): N below one block, N and K off the block sizes, K of many tiles
SHAPES = [(1, 40, 37), (3, 100, 300), (16, 7, 520), (3, 130, 1100)]


def _sg():  # type: ignore[no-untyped-def]
    return importlib.import_module("blockdraft.kernels.skinny_gemm")


def _configs() -> list[object]:
    """``None`` (the module's own choice) and forced configs: small tiles split over K (an
    uneven last split), and the broadcast multiply-sum path."""
    sg = _sg()
    return [None, sg.GemmConfig(block_n=16, block_k=32, split_k=4, num_stages=2),
            sg.GemmConfig(block_n=32, block_k=64, split_k=2, dot=False)]


def _data(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, bias: bool,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def _product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + b`` in fp32, rounded once to ``x``'s dtype."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def case_linear(device: torch.device, dtype: torch.dtype, rows: int, n: int, k: int,
                bias: bool, config: object, seed: int = 0) -> None:
    need_triton(device)
    sg = _sg()
    x, w, b = _data(rows, n, k, dtype, device, bias, seed)
    prev = sg.set_config_override(config)
    try:
        with nan_allocations():
            got = K.ops("triton").linear(x, w, b)
    finally:
        sg.set_config_override(prev)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert_close(got.cpu(), _product(x, w, b).cpu(), "x @ w.T + b")


def case_silu_mul(device: torch.device, dtype: torch.dtype, rows: int, n: int, k: int,
                  bias: bool, config: object, seed: int = 0) -> None:
    need_triton(device)
    sg = _sg()
    x, w, b = _data(rows, 2 * n, k, dtype, device, bias, seed)
    prev = sg.set_config_override(config)
    try:
        with nan_allocations():
            got = K.ops("triton").linear_silu_mul(x, w, b)
    finally:
        sg.set_config_override(prev)
    assert got.shape == (rows, n) and got.dtype == dtype
    # the unfused path: the product rounded to the dtype, then SwiGLU
    gate, up = _product(x, w, b).float().chunk(2, dim=-1)
    want = (F.silu(gate).to(dtype).float() * up).to(dtype)
    assert_close(got.cpu(), want.cpu(), "silu(x @ gate.T) * (x @ up.T)")
    # and the definition: silu(x @ Wg.T + bg) * (x @ Wu.T + bu)
    bg, bu = (None, None) if b is None else b.chunk(2)
    plain = (F.silu(_product(x, w[:n], bg).float()) * _product(x, w[n:], bu).float()).to(dtype)
    assert_close(got.cpu(), plain.cpu(), "silu(x @ Wg.T) * (x @ Wu.T)")


def case_argmax(device: torch.device, dtype: torch.dtype, rows: int, n: int, k: int,
                config: object, seed: int = 0) -> None:
    need_triton(device)
    sg = _sg()
    gen = torch.Generator().manual_seed(seed)
    # Integers in [-2, 2]: every logit (|.| <= 4k) is exact in fp32 in any order (and in fp16
    # for k <= 512).
    x = torch.randint(-2, 3, (rows, k), generator=gen).to(dtype)
    w = torch.randint(-2, 3, (n, k), generator=gen).to(dtype)
    # Constructed ties at the maximum: row r's best weight row copied to later columns
    # (across tiles), and for row 0 an all-equal pair at the first and last column.
    logits = x.float() @ w.float().T  # exact; kept equal to x @ w.T as columns are copied
    for r in range(rows):
        best = int(torch.argmax(logits[r]))
        for j in (best + 1 + r, n - 1 - r, best + 17):
            if best < j < n:
                w[j] = w[best]
                logits[:, j] = logits[:, best]
    if rows and n > 1:
        w[n - 1] = w[0]
        x[0] = 0  # every logit of row 0 is 0: its argmax is column 0
    x, w = x.to(device), w.to(device)
    prev = sg.set_config_override(config)
    try:
        got = K.ops("triton").linear_argmax(x, w)
    finally:
        sg.set_config_override(prev)
    # exact integer logits, rounded once to the dtype (bf16 rounds large ones into new ties)
    logits = (x.cpu().float() @ w.cpu().float().T).to(dtype).float()
    want = torch.argmax(logits, dim=1)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), (got, want)
    if dtype == torch.float32:
        assert torch.equal(got.cpu(), K.reference.linear_argmax(x.cpu(), w.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", range(3))
def test_linear(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool, config: int) -> None:
    case_linear(CPU, dtype, rows, n, k, bias, _configs()[config])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 20, 37), (3, 50, 300), (16, 7, 520)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", range(3))
def test_linear_silu_mul(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool,
                         config: int) -> None:
    case_silu_mul(CPU, dtype, rows, n, k, bias, _configs()[config])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 37), (3, 300, 64), (16, 97, 130)])
@pytest.mark.parametrize("config", range(3))
def test_linear_argmax(dtype: torch.dtype, rows: int, n: int, k: int, config: int) -> None:
    case_argmax(CPU, dtype, rows, n, k, _configs()[config])


def test_argmax_combine_loops_over_many_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """More tile winners than the combine reads per step: its loop keeps the lowest column."""
    need_triton(CPU)
    sg = _sg()
    monkeypatch.setattr(sg, "ARGMAX_COMBINE_BLOCK", 2)
    case_argmax(CPU, torch.float32, 3, 150, 40, sg.GemmConfig(block_n=16, block_k=32))


def test_split_k_and_the_rule() -> None:
    """The rule splits K when the column tiles cannot fill the device, keeps no empty split,
    never splits the argmax, and the measured table overrides it."""
    sg = _sg()
    cfg = sg.rule_config("linear", 1, 4096, 4096, 132)
    tiles, steps = 4096 // cfg.block_n, 4096 // cfg.block_k
    assert cfg.split_k > 1 and tiles * cfg.split_k >= 132 and steps // cfg.split_k >= 4
    assert sg.rule_config("linear", 1, 151936, 4096, 132).split_k == 1
    assert sg.rule_config("argmax", 16, 64, 4096, 132).split_k == 1
    assert sg.rule_config("linear", 1, 64, 40, 132).split_k == 1  # one K tile
    assert [sg.m_bucket(r) for r in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    mine = sg.GemmConfig(block_n=128, block_k=64, split_k=3, num_warps=8, num_stages=3)
    sg.DEFAULT_CONFIGS[("linear", 4, 6144, 4096)] = mine
    try:
        assert sg.config_for("linear", 3, 6144, 4096, CPU) == mine
        assert sg.config_for("linear", 5, 6144, 4096, CPU) != mine
    finally:
        del sg.DEFAULT_CONFIGS[("linear", 4, 6144, 4096)]


@pytest.mark.parametrize(("fn", "args", "match"), [
    ("linear", (torch.zeros(17, 8), torch.zeros(4, 8)), "x: at most 16 rows"),
    ("linear_silu_mul", (torch.zeros(17, 8), torch.zeros(4, 8)), "x: at most 16 rows"),
    ("linear_argmax", (torch.zeros(17, 8), torch.zeros(4, 8)), "x: at most 16 rows"),
    ("linear", (torch.zeros(2, 8), torch.zeros(4, 9)), "weight"),
    ("linear", (torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16)), "weight"),
    ("linear", (torch.zeros(2, 8), torch.zeros(8, 4).T), "weight"),
    ("linear", (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(5)), "bias"),
    ("linear", (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(4, 8)), "x"),
    ("linear_silu_mul", (torch.zeros(2, 8), torch.zeros(5, 8)), "even row count"),
    ("linear_argmax", (torch.zeros(2, 8), torch.zeros(0, 8)), "empty vocabulary"),
])
def test_refusals(fn: str, args: tuple[torch.Tensor, ...], match: str) -> None:
    need_triton(CPU)
    with pytest.raises(ValueError, match=match):
        getattr(K.ops("triton"), fn)(*args)


def test_an_empty_reduction_gives_the_bias() -> None:
    need_triton(CPU)
    x, w, b = torch.zeros(3, 0), torch.zeros(5, 0), torch.arange(5.0)
    ops = K.ops("triton")
    assert torch.equal(ops.linear(x, w, b), b.expand(3, 5))
    assert torch.equal(ops.linear_silu_mul(x, torch.zeros(4, 0), b[:4]),
                       K.reference.linear_silu_mul(x, torch.zeros(4, 0), b[:4]))
    assert torch.equal(ops.linear_argmax(x, w), torch.zeros(3, dtype=torch.int64))


def test_bad_configs_are_refused() -> None:
    sg = _sg()
    for bad in (dict(block_n=48), dict(block_k=8), dict(split_k=0), dict(num_warps=3)):
        with pytest.raises(ValueError):
            sg.GemmConfig(**bad)
