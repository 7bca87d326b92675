"""The fused elementwise kernels of a decoder layer (residual add + RMSNorm, per-head q/k
RMSNorm + RoPE with the v split, SwiGLU's product) vs their references, on odd sizes.

Each launcher allocates its outputs; the cases make those allocations NaN-filled, so an element
the kernel never writes fails the comparison. The paged-store variant of q/k norm + RoPE is
checked in ``test_kernels_causal.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from support.kernel_support import K, assert_close, need_triton

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16]


@contextmanager
def nan_allocations() -> Iterator[None]:
    """``torch.empty_like`` and ``Tensor.new_empty`` return NaN-filled floating tensors."""
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty

    def nan_empty_like(t: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        out = empty_like(t, *args, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def nan_new_empty(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        out = new_empty(self, *args, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    torch.empty_like = nan_empty_like  # type: ignore[assignment]
    torch.Tensor.new_empty = nan_new_empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.empty_like = empty_like
        torch.Tensor.new_empty = new_empty  # type: ignore[method-assign]


def _no_nan(t: torch.Tensor, name: str) -> None:
    assert not torch.isnan(t).any(), f"{name}: elements left unwritten (NaN)"


def case_add_rms_norm(device: torch.device, dtype: torch.dtype, rows: int, size: int,
                      with_y: bool, seed: int = 0) -> None:
    need_triton(device)
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, size, generator=gen).to(dtype).to(device)
    y = torch.randn(rows, size, generator=gen).to(dtype).to(device) if with_y else None
    w = (1 + 0.1 * torch.randn(size, generator=gen)).to(dtype).to(device)
    h_want, x_want = K.reference.add_rms_norm(h, y, w, 1e-6)
    with nan_allocations():
        h_got, x_got = K.ops("triton").add_rms_norm(h, y, w, 1e-6)
    assert h_got.shape == x_got.shape == (rows, size)
    assert h_got.dtype == x_got.dtype == dtype
    _no_nan(h_got, "h + y")
    _no_nan(x_got, "rms_norm(h + y)")
    # the residual sum is one rounding of an exact fp32 sum: bit-identical to the reference
    assert torch.equal(h_got.cpu(), h_want.cpu()), "h + y"
    assert_close(x_got.cpu(), x_want.cpu(), "rms_norm(h + y) * w")
    if y is None:
        assert h_got.data_ptr() == h.data_ptr()  # no add: the input itself


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size"), [(1, 1), (3, 3), (63, 100), (5, 1025)])
@pytest.mark.parametrize("with_y", [True, False])
def test_add_rms_norm(dtype: torch.dtype, rows: int, size: int, with_y: bool) -> None:
    case_add_rms_norm(CPU, dtype, rows, size, with_y)


def test_add_rms_norm_matches_a_plain_loop() -> None:
    """The reference itself, row by row: ``x = (h + y) / sqrt(mean((h + y)^2) + eps) * w``."""
    need_triton(CPU)
    gen = torch.Generator().manual_seed(3)
    h, y = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    w = torch.randn(7, generator=gen)
    s, x = K.ops("triton").add_rms_norm(h, y, w, 0.5)
    for r in range(3):
        row = [float(h[r, j]) + float(y[r, j]) for j in range(7)]
        rms = (sum(v * v for v in row) / 7 + 0.5) ** 0.5
        for j in range(7):
            assert abs(float(s[r, j]) - row[j]) < 1e-6
            assert abs(float(x[r, j]) - row[j] / rms * float(w[j])) < 1e-5


def test_add_rms_norm_of_no_rows() -> None:
    need_triton(CPU)
    h, x = K.ops("triton").add_rms_norm(torch.empty(0, 8), torch.empty(0, 8), torch.ones(8), 1e-6)
    assert h.shape == x.shape == (0, 8)


def _inv_freq(dim: int, device: torch.device) -> torch.Tensor:
    return (1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(device)


def case_qk_norm_rope(device: torch.device, dtype: torch.dtype, rows: int, heads: int,
                      kv_heads: int, dim: int, norm: bool, rope_scale: float = 1.0,
                      seed: int = 0) -> None:
    need_triton(device)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(device)
    pos = torch.randint(0, 5000, (rows,), generator=gen).to(device)
    wq = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device) if norm else None
    wk = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device) if norm else None
    inv = _inv_freq(dim, device)
    args = (qkv, pos, wq, wk, inv, rope_scale, 1e-6, heads, kv_heads)
    want = K.reference.qk_norm_rope(*args)
    with nan_allocations():
        got = K.ops("triton").qk_norm_rope(*args)
    for name, g, w, h in zip("qkv", got, want, (heads, kv_heads, kv_heads)):
        assert g.shape == (rows, h, dim) and g.dtype == dtype, name
        _no_nan(g, name)
        assert_close(g.cpu(), w.cpu(), name)
    # v is split off unchanged
    v_cols = qkv.view(rows, heads + 2 * kv_heads, dim)[:, heads + kv_heads:]
    assert torch.equal(got[2].cpu(), v_cols.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [
    (1, 1, 1, 2),  # the smallest head: one RoPE pair
    (3, 3, 1, 6),  # 5 heads, a half of 3 (not a power of two)
    (63, 8, 2, 16),  # 12 heads: two groups of the kernel's 8, the second partly empty
    (4, 16, 16, 64),  # 48 heads: six full groups
])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope(dtype: torch.dtype, rows: int, heads: int, kv_heads: int, dim: int,
                      norm: bool) -> None:
    case_qk_norm_rope(CPU, dtype, rows, heads, kv_heads, dim, norm)


def test_qk_norm_rope_scaled() -> None:
    case_qk_norm_rope(CPU, torch.float32, 7, 4, 2, 8, True, rope_scale=1.25, seed=1)


def test_qk_norm_rope_matches_a_plain_rotation() -> None:
    """One head, no norm: the pair ``(x_j, x_{j+D/2})`` is rotated by ``pos * inv_freq[j]``."""
    need_triton(CPU)
    dim = 6
    qkv = torch.arange(3 * dim, dtype=torch.float32).view(1, 3 * dim) / 10
    pos = torch.tensor([7])
    inv = _inv_freq(dim, CPU)
    q, k, v = K.ops("triton").qk_norm_rope(qkv, pos, None, None, inv, 1.0, 1e-6, 1, 1)
    for out, src in ((q, qkv[0, :dim]), (k, qkv[0, dim : 2 * dim])):
        for j in range(dim // 2):
            a = 7 * float(inv[j])
            x1, x2 = float(src[j]), float(src[j + dim // 2])
            c, s = torch.cos(torch.tensor(a)).item(), torch.sin(torch.tensor(a)).item()
            assert abs(float(out[0, 0, j]) - (x1 * c - x2 * s)) < 1e-5
            assert abs(float(out[0, 0, j + dim // 2]) - (x2 * c + x1 * s)) < 1e-5
    assert torch.equal(v[0, 0], qkv[0, 2 * dim :])


def test_qk_norm_rope_needs_both_norm_weights() -> None:
    need_triton(CPU)
    qkv = torch.randn(2, 3 * 8)
    with pytest.raises(ValueError, match="q_norm_w"):
        K.ops("triton").qk_norm_rope(qkv, torch.arange(2), torch.ones(8), None, _inv_freq(8, CPU),
                                     1.0, 1e-6, 1, 1)


def case_silu_mul(device: torch.device, dtype: torch.dtype, rows: int, inner: int,
                  seed: int = 0) -> None:
    need_triton(device)
    gen = torch.Generator().manual_seed(seed)
    gate_up = (3 * torch.randn(rows, 2 * inner, generator=gen)).to(dtype).to(device)
    want = K.reference.silu_mul(gate_up)
    with nan_allocations():
        got = K.ops("triton").silu_mul(gate_up)
    assert got.shape == (rows, inner) and got.dtype == dtype
    _no_nan(got, "silu(gate) * up")
    assert_close(got.cpu(), want.cpu(), "silu(gate) * up")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inner"), [(1, 1), (3, 3), (63, 63), (2, 1025)])
def test_silu_mul(dtype: torch.dtype, rows: int, inner: int) -> None:
    """1025 columns cross the kernel's 1024-column tile."""
    case_silu_mul(CPU, dtype, rows, inner)


def test_silu_mul_matches_a_plain_loop() -> None:
    need_triton(CPU)
    gate_up = torch.tensor([[-2.0, 0.0, 3.0, 1.5, -4.0, 2.0]])
    got = K.ops("triton").silu_mul(gate_up)
    for j, (g, u) in enumerate(zip([-2.0, 0.0, 3.0], [1.5, -4.0, 2.0])):
        want = g / (1 + torch.exp(torch.tensor(-g)).item()) * u
        assert abs(float(got[0, j]) - want) < 1e-6


def test_silu_mul_of_no_rows() -> None:
    need_triton(CPU)
    assert K.ops("triton").silu_mul(torch.empty(0, 6)).shape == (0, 3)


def test_nan_allocations_are_seen() -> None:
    """The NaN fill reaches the launchers' outputs: a kernel that wrote nothing would fail."""
    with nan_allocations():
        assert torch.isnan(torch.empty_like(torch.zeros(3))).all()
        assert torch.isnan(torch.zeros(2).new_empty((4,))).all()
    assert not torch.isnan(torch.zeros(3).new_empty((2,)).zero_()).any()
