"""ctx K/V store: Triton kernel vs the plain-torch reference (CPU interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.kernel_support import K, assert_close, nan_like, need_triton, sparse_tensor

CPU = torch.device("cpu")


def _inputs(rows: int, layers: int, heads: int, dim: int, page: int, num_pages: int,
            dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(rows, layers, 2, heads, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 40_000, (rows,), generator=gen)
    slots = torch.randperm(num_pages * page, generator=gen)[:rows].to(torch.int64)
    slots[::5] = K.PAD_SLOT
    k_norm_w = (1 + 0.3 * torch.randn(layers, dim, generator=gen)).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return {n: t.to(device) for n, t in dict(kv=kv, positions=positions, slots=slots,
                                              k_norm_w=k_norm_w, inv_freq=inv_freq).items()}


def case_kv_store(device: torch.device, dtype: torch.dtype, rows: int, layers: int, heads: int,
                  dim: int, page: int, num_pages: int, list_caches: bool, seed: int = 0) -> None:
    """Both backends write the same slots with the same values; nothing else changes."""
    x = _inputs(rows, layers, heads, dim, page, num_pages, dtype, device, seed)
    shape = [layers, num_pages, page, heads, dim]
    results = {}
    for backend in ("triton", "torch"):
        k_c, v_c = nan_like(shape, dtype, device), nan_like(shape, dtype, device)
        slot_pos = torch.full((num_pages * page,), -7, dtype=torch.int32, device=device)
        k_arg = list(k_c.unbind(0)) if list_caches else k_c
        v_arg = list(v_c.unbind(0)) if list_caches else v_c
        K.ops(backend).ctx_kv_store(x["kv"], x["positions"], x["slots"], x["k_norm_w"],  # type: ignore[arg-type]
                                    x["inv_freq"], 1.25, 1e-6, k_arg, v_arg, slot_pos)
        results[backend] = (k_c, v_c, slot_pos)
    (k_t, v_t, sp_t), (k_r, v_r, sp_r) = results["triton"], results["torch"]
    written = torch.zeros(num_pages * page, dtype=torch.bool, device=device)
    live = x["slots"][x["slots"] >= 0]
    written[live] = True
    # every written slot filled, every other slot untouched (still NaN / sentinel)
    for name, cache in (("k", k_t), ("v", v_t)):
        flat = cache.view(layers, -1, heads, dim)
        assert not flat[:, written].isnan().any(), f"{name}: a written slot holds NaN"
        assert flat[:, ~written].isnan().all(), f"{name}: a slot outside the plan was written"
    assert torch.equal(sp_t, sp_r)
    assert (sp_t[~written] == -7).all()
    assert torch.equal(sp_t[live], x["positions"][x["slots"] >= 0].to(torch.int32))
    assert_close(k_t, k_r, "k_cache")
    assert torch.equal(v_t.nan_to_num(7.0), v_r.nan_to_num(7.0)), "v_cache must be a plain copy"


@pytest.mark.parametrize(
    ("rows", "layers", "heads", "dim", "page", "num_pages", "list_caches"),
    [
        (1, 1, 1, 64, 4, 3, False),
        (3, 2, 4, 128, 8, 5, True),
        (17, 5, 8, 128, 16, 4, False),
        (63, 3, 2, 64, 4, 40, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_store_matches_reference(rows: int, layers: int, heads: int, dim: int, page: int,
                                    num_pages: int, list_caches: bool, dtype: torch.dtype) -> None:
    need_triton(CPU)
    case_kv_store(CPU, dtype, rows, layers, heads, dim, page, num_pages, list_caches)


def test_kv_store_thousand_rows() -> None:
    need_triton(CPU)
    case_kv_store(CPU, torch.float16, 1000, 1, 1, 64, 16, 80, False)


def test_kv_store_reference_matches_hf_style_rope() -> None:
    """The reference itself: RMSNorm then rotate-half RoPE, written out by hand for one row."""
    x = _inputs(1, 1, 1, 8, 4, 1, torch.float32, CPU, seed=3)
    x["slots"][0] = 2
    k_c = torch.zeros(1, 1, 4, 1, 8)
    v_c = torch.zeros(1, 1, 4, 1, 8)
    sp = torch.zeros(4, dtype=torch.int32)
    K.reference.ctx_kv_store(x["kv"], x["positions"], x["slots"], x["k_norm_w"], x["inv_freq"],
                             1.0, 1e-6, k_c, v_c, sp)
    k = x["kv"][0, 0, 0, 0]
    k = k / torch.sqrt(k.pow(2).mean() + 1e-6) * x["k_norm_w"][0]
    pos = float(x["positions"][0])
    want = torch.empty(8)
    for i in range(4):
        a = pos * float(x["inv_freq"][i])
        c, s = torch.cos(torch.tensor(a)), torch.sin(torch.tensor(a))
        want[i] = k[i] * c - k[i + 4] * s
        want[i + 4] = k[i + 4] * c + k[i] * s
    torch.testing.assert_close(k_c[0, 0, 2, 0], want, atol=1e-5, rtol=1e-5)
    assert int(sp[2]) == int(x["positions"][0])


def test_kv_store_slots_beyond_2_pow_31(tmp_path: Path) -> None:
    """Slot numbers above 2**31 (element offsets above 2**32) on sparse-file-backed caches."""
    need_triton(CPU)
    page, heads, dim = 16, 1, 4
    num_slots = (1 << 31) + 64 * page
    k_c = sparse_tensor(tmp_path / "k", num_slots * heads * dim, torch.float16)
    v_c = sparse_tensor(tmp_path / "v", num_slots * heads * dim, torch.float16)
    slot_pos = sparse_tensor(tmp_path / "sp", num_slots, torch.int32)
    shape = (1, num_slots // page, page, heads, dim)
    slots = torch.tensor([(1 << 31) + 5, 3, (1 << 31) + 1000, K.PAD_SLOT, (1 << 31) - 1])
    x = _inputs(5, 1, heads, dim, page, 1, torch.float16, CPU, seed=1)
    K.ops("triton").ctx_kv_store(x["kv"], x["positions"], slots, x["k_norm_w"], x["inv_freq"],
                                 1.0, 1e-6, k_c.view(shape), v_c.view(shape), slot_pos)
    small = {n: torch.zeros(1, 1, page, heads, dim, dtype=torch.float16) for n in ("k", "v")}
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        # the reference on a one-page cache gives the expected row for this slot
        sp_small = torch.zeros(page, dtype=torch.int32)
        K.reference.ctx_kv_store(x["kv"][i : i + 1], x["positions"][i : i + 1],
                       torch.tensor([slot % page]), x["k_norm_w"], x["inv_freq"], 1.0, 1e-6,
                       small["k"], small["v"], sp_small)
        got_k = k_c.view(-1, heads, dim)[slot]
        assert_close(got_k, small["k"].view(-1, heads, dim)[slot % page], f"k slot {slot}")
        assert torch.equal(v_c.view(-1, heads, dim)[slot], x["kv"][i, 0, 1])
        assert int(slot_pos[slot]) == int(x["positions"][i])
    # neighbours of written slots stay zero
    for slot in ((1 << 31) + 4, (1 << 31) + 6, (1 << 31) + 999, 2, 4):
        assert not k_c.view(-1, heads, dim)[slot].any()
        assert int(slot_pos[slot]) == 0
