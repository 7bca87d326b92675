"""The target runtime's kernels vs their references: causal attention of new rows over paged
K/V, and q/k norm + RoPE with the paged K/V write."""

from __future__ import annotations

import math

import pytest
import torch

from support.kernel_support import K, assert_close, nan_like, need_triton

CPU = torch.device("cpu")


def make_causal_case(
    device: torch.device, dtype: torch.dtype, new: list[int], ctx: list[int], heads: int,
    kv_heads: int, dim: int, page: int, seed: int = 0, spare: int = 1,
) -> dict[str, torch.Tensor]:
    """Sequence ``i`` has ``ctx[i]`` earlier tokens and ``new[i]`` new rows (their K/V in the
    pages too), in distinct random pages; unused slots hold NaN, which must never be read.
    The tables have ``spare`` columns past the longest sequence's pages (a runtime's tables
    are as wide as its longest possible sequence)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(new)
    kv = [a + b for a, b in zip(new, ctx)]
    need = [math.ceil(k / page) for k in kv]
    width = max(need) + spare
    num_pages = sum(need) + 5
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(n, width, dtype=torch.int32)
    k_cache = nan_like([num_pages, page, kv_heads, dim], dtype, CPU)
    v_cache = nan_like([num_pages, page, kv_heads, dim], dtype, CPU)
    used = 0
    for i, count in enumerate(need):
        tables[i, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
        for p in range(kv[i]):
            pg, off = int(tables[i, p // page]), p % page
            k_cache[pg, off] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
            v_cache[pg, off] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
    starts = [0]
    for r in new:
        starts.append(starts[-1] + r)
    positions = torch.cat([torch.arange(c, c + r) for c, r in zip(ctx, new)]).to(torch.int64)
    case = dict(
        q=torch.randn(starts[-1], heads, dim, generator=gen).to(dtype),
        k_cache=k_cache, v_cache=v_cache, page_tables=tables,
        q_starts=torch.tensor(starts, dtype=torch.int32),
        kv_lens=torch.tensor(kv, dtype=torch.int32), positions=positions,
    )
    return {k: v.to(device) for k, v in case.items()}


def case_causal(device: torch.device, dtype: torch.dtype, new: list[int], ctx: list[int],
                heads: int, kv_heads: int, dim: int, page: int, window: int | None = None,
                splits: int | None = None, seed: int = 0, spare: int = 1,
                split_len: int | None = None) -> None:
    x = make_causal_case(device, dtype, new, ctx, heads, kv_heads, dim, page, seed, spare)
    args = [x[k] for k in ("q", "k_cache", "v_cache", "page_tables", "q_starts", "kv_lens", "positions")]
    kw = dict(scale=dim**-0.5, sliding_window=window)
    want = K.reference.causal_attention(*[a.cpu() for a in args], **kw)  # type: ignore[arg-type]
    out = nan_like(list(x["q"].shape), dtype, device)
    got = K.ops("triton").causal_attention(*args, **kw, num_splits=splits, split_len=split_len, out=out)
    assert got is out
    assert not torch.isnan(got).any(), "an output row was not written"
    assert_close(got.cpu(), want, f"causal_attention {new}/{ctx} window {window} splits {splits}")


@pytest.mark.parametrize(("new", "ctx"), [
    ([1], [0]),  # a one-token prompt
    ([1, 1, 1], [63, 0, 7]),  # decode rows
    ([5, 16, 3], [11, 40, 0]),  # verify blocks
    ([37], [0]),  # a prefill chunk longer than a tile
    ([9, 1, 20], [3, 100, 64]),  # ragged, across page boundaries
])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (6, 3), (8, 1)])
def test_causal_attention(new: list[int], ctx: list[int], heads: int, kv_heads: int) -> None:
    need_triton(CPU)
    case_causal(CPU, torch.float32, new, ctx, heads, kv_heads, 16, 4)


@pytest.mark.parametrize("window", [1, 3, 17])
@pytest.mark.parametrize("splits", [None, 3])
def test_causal_attention_sliding_window_and_splits(window: int, splits: int | None) -> None:
    need_triton(CPU)
    case_causal(CPU, torch.float32, [6, 1, 30], [50, 9, 2], 4, 2, 16, 8, window, splits)


@pytest.mark.parametrize(("splits", "split_len"), [(None, None), (4, None), (7, None), (2, 512), (5, 256)])
def test_causal_attention_splits_in_a_wide_table(splits: int | None, split_len: int | None) -> None:
    """Tables far wider than the sequences (as a runtime's, sized for its longest sequence):
    the splits share each sequence's own keys by default, or a fixed span of the width."""
    need_triton(CPU)
    case_causal(CPU, torch.float32, [4, 1, 16], [70, 5, 130], 4, 2, 16, 4, splits=splits,
                spare=200, split_len=split_len)


def test_causal_attention_rejects_a_split_len_that_misses_keys() -> None:
    need_triton(CPU)
    x = make_causal_case(CPU, torch.float32, [2], [30], 4, 2, 16, 4, spare=20)
    args = [x[k] for k in ("q", "k_cache", "v_cache", "page_tables", "q_starts", "kv_lens", "positions")]
    # The table holds 28 pages of 4 tokens (112); key tiles are 64 wide: 0 and 48 are not a
    # tile multiple, and one split of 64 would leave keys 64..111 unread.
    for bad in (0, 48, 64):
        with pytest.raises(ValueError, match="split_len"):
            K.ops("triton").causal_attention(*args, scale=0.25, num_splits=1, split_len=bad)


def test_causal_attention_fp16_odd_head_dim_and_page() -> None:
    need_triton(CPU)
    case_causal(CPU, torch.float16, [3, 7], [20, 1], 2, 1, 24, 3, splits=2)


def test_causal_attention_reference_is_causal_and_windowed() -> None:
    """The reference's rule on a case small enough to check by hand: each row's output is the
    softmax-weighted mean of exactly the values it may see."""
    x = make_causal_case(CPU, torch.float32, [3], [2], 1, 1, 8, 2)
    for window in (None, 2):
        out = K.reference.causal_attention(
            x["q"], x["k_cache"], x["v_cache"], x["page_tables"], x["q_starts"], x["kv_lens"],
            x["positions"], scale=1.0, sliding_window=window)
        pages = x["page_tables"][0].tolist()
        k = torch.stack([x["k_cache"][pages[p // 2], p % 2, 0] for p in range(5)])
        v = torch.stack([x["v_cache"][pages[p // 2], p % 2, 0] for p in range(5)])
        for r, pos in enumerate(range(2, 5)):
            lo = 0 if window is None else pos - window + 1
            w = torch.softmax(x["q"][r, 0] @ k[lo : pos + 1].T, dim=0)
            torch.testing.assert_close(out[r, 0], w @ v[lo : pos + 1])


def case_rope_store(device: torch.device, dtype: torch.dtype, rows: int, heads: int,
                    kv_heads: int, dim: int, norm: bool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    page = 4
    pages = max(9, -(-rows // page) + 1)  # room for every row: slots are distinct
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(device)
    pos = torch.randint(0, 500, (rows,), generator=gen).to(device)
    slots = torch.randperm(page * pages, generator=gen)[:rows].to(device)
    if rows > 1:
        slots[1] = -1  # PAD_SLOT: not written
    wq = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device) if norm else None
    wk = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device) if norm else None
    inv = (1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(device)
    out = {}
    for name, fn in (("torch", K.reference.qk_norm_rope_store),
                     ("triton", K.ops("triton").qk_norm_rope_store)):
        kc = nan_like([pages, page, kv_heads, dim], dtype, device)
        vc = nan_like([pages, page, kv_heads, dim], dtype, device)
        q = fn(qkv, pos, slots, wq, wk, inv, 1.25, 1e-6, heads, kv_heads, kc, vc)
        out[name] = (q, kc, vc)
    (q_r, k_r, v_r), (q_t, k_t, v_t) = out["torch"], out["triton"]
    assert_close(q_t.cpu(), q_r.cpu(), "q")
    written = torch.zeros(pages * page, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    for name, got, want in (("k", k_t, k_r), ("v", v_t, v_r)):
        got, want = got.cpu().view(pages * page, kv_heads, dim), want.cpu().view(pages * page, kv_heads, dim)
        assert torch.isnan(got[~written]).all(), f"{name}: a slot outside `slots` was written"
        assert_close(got[written], want[written], name)
    # the same q as the unpaged op
    q_plain = K.reference.qk_norm_rope(qkv.cpu(), pos.cpu(), None if wq is None else wq.cpu(),
                                       None if wk is None else wk.cpu(), inv.cpu(), 1.25, 1e-6,
                                       heads, kv_heads)[0]
    assert_close(q_r.cpu(), q_plain, "q vs qk_norm_rope")


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [(1, 4, 4, 8), (7, 6, 2, 16), (33, 8, 1, 32)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope_store(rows: int, heads: int, kv_heads: int, dim: int, norm: bool,
                            dtype: torch.dtype) -> None:
    need_triton(CPU)
    case_rope_store(CPU, dtype, rows, heads, kv_heads, dim, norm)


def test_qk_norm_rope_store_rejects_bad_caches() -> None:
    need_triton(CPU)
    qkv = torch.randn(3, 4 * 8)
    inv = torch.ones(4)
    slots = torch.arange(3)
    good = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="k_cache"):
        K.ops("triton").qk_norm_rope_store(qkv, slots, slots, None, None, inv, 1.0, 1e-6, 2, 1,
                                           torch.zeros(2, 4, 2, 8), good)
    with pytest.raises(ValueError, match="slots"):
        K.ops("triton").qk_norm_rope_store(qkv, slots, slots.to(torch.int32), None, None, inv,
                                           1.0, 1e-6, 2, 1, good, good.clone())
    with pytest.raises(ValueError, match="q_norm_w"):
        K.ops("triton").qk_norm_rope_store(qkv, slots, slots, torch.ones(8), None, inv, 1.0,
                                           1e-6, 2, 1, good, good.clone())
