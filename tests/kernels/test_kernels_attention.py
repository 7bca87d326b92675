"""Block attention over paged ctx K/V: Triton kernel vs the plain-torch reference."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from support.kernel_support import K, assert_close, nan_like, need_triton, sparse_tensor

CPU = torch.device("cpu")


def make_attention_case(
    device: torch.device, dtype: torch.dtype, ctx_lens: list[int], num_q: int, heads: int,
    kv_heads: int, dim: int, page: int, num_pages: int, seed: int = 0,
    caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    page_offset: int = 0,
    spare: int = 1,
) -> dict[str, torch.Tensor]:
    """Random queries/keys; each sequence gets distinct random pages ``>= page_offset``, in
    tables of ``spare`` columns past the longest sequence's pages.

    ``caches`` (k_cache, v_cache, slot_pos) may be given (e.g. sparse-file backed); only the
    pages in the tables are written.
    """
    gen = torch.Generator().manual_seed(seed)
    n = len(ctx_lens)
    width = max(1, max((c + page - 1) // page for c in ctx_lens)) + spare
    chosen = torch.randperm(num_pages - page_offset, generator=gen)[: n * width] + page_offset
    tables = chosen.view(n, width).to(torch.int32)
    if caches is None:
        k_cache = nan_like([num_pages, page, kv_heads, dim], dtype, CPU)
        v_cache = nan_like([num_pages, page, kv_heads, dim], dtype, CPU)
        slot_pos = torch.full((num_pages * page,), -(10**6), dtype=torch.int32)
    else:
        k_cache, v_cache, slot_pos = caches
    # write the used pages (unused tokens of a used page keep garbage that must be ignored)
    for blk in tables.flatten().tolist():
        k_cache[blk] = torch.randn(page, kv_heads, dim, generator=gen).to(dtype)
        v_cache[blk] = torch.randn(page, kv_heads, dim, generator=gen).to(dtype)
        slot_pos[blk * page : (blk + 1) * page] = 10**6
    q_pos = torch.empty(n, num_q, dtype=torch.int64)
    for s, ctx in enumerate(ctx_lens):
        # context positions with a gap (a slid window keeps old positions); block follows
        base = int(torch.randint(0, 50, (1,), generator=gen))
        for t in range(ctx):
            slot = int(tables[s, t // page]) * page + t % page
            slot_pos[slot] = base + t
        q_pos[s] = base + ctx + torch.arange(num_q)
    out = dict(
        q=torch.randn(n, num_q, heads, dim, generator=gen).to(dtype),
        k_blk=torch.randn(n, num_q, kv_heads, dim, generator=gen).to(dtype),
        v_blk=torch.randn(n, num_q, kv_heads, dim, generator=gen).to(dtype),
        page_tables=tables,
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        q_pos=q_pos,
    )
    moved = {k: v.to(device) for k, v in out.items()}
    if caches is None:
        moved.update(k_cache=k_cache.to(device), v_cache=v_cache.to(device),
                     slot_pos=slot_pos.to(device))
    else:
        moved.update(k_cache=k_cache, v_cache=v_cache, slot_pos=slot_pos)
    return moved


def run_attention(x: dict[str, torch.Tensor], backend: str, **kw: object) -> torch.Tensor:
    dim = x["q"].shape[-1]
    out: torch.Tensor = K.ops(backend).block_attention(  # type: ignore[arg-type]
        x["q"], x["k_blk"], x["v_blk"], x["k_cache"], x["v_cache"], x["page_tables"],
        x["ctx_lens"], x["q_pos"], x["slot_pos"], scale=dim**-0.5, **kw)
    return out


def case_attention(device: torch.device, dtype: torch.dtype, ctx_lens: list[int], num_q: int,
                   heads: int, kv_heads: int, dim: int, page: int, num_pages: int,
                   sliding_window: int | None = None, causal_block: bool = False,
                   num_splits: int | None = None, seed: int = 0, split_len: int | None = None,
                   spare: int = 1) -> None:
    x = make_attention_case(device, dtype, ctx_lens, num_q, heads, kv_heads, dim, page,
                            num_pages, seed, spare=spare)
    kw = dict(sliding_window=sliding_window, causal_block=causal_block)
    want = run_attention(x, "torch", **kw)
    if num_splits is None:
        got = run_attention(x, "triton", **kw)
    else:
        ba = importlib.import_module("blockdraft.kernels.paged_attention")
        got = ba.block_attention(
            x["q"], x["k_blk"], x["v_blk"], x["k_cache"], x["v_cache"], x["page_tables"],
            x["ctx_lens"], x["q_pos"], x["slot_pos"], scale=dim**-0.5,
            out=nan_like(list(x["q"].shape), dtype, device), num_splits=num_splits,
            split_len=split_len, **kw)
    assert not got.isnan().any(), "an output element was not written"
    assert_close(got, want, "attention output")


@pytest.mark.parametrize(
    ("ctx_lens", "num_q", "heads", "kv_heads", "dim", "page", "splits"),
    [
        ([0], 1, 1, 1, 64, 4, None),
        ([5, 17, 40], 4, 8, 2, 64, 8, 3),
        ([63], 16, 8, 1, 128, 16, 4),  # GQA 8
        ([1, 30, 100], 3, 4, 4, 64, 4, 2),  # GQA 1, many pages
        ([129], 8, 8, 2, 128, 16, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_matches_reference(ctx_lens: list[int], num_q: int, heads: int, kv_heads: int,
                                     dim: int, page: int, splits: int | None,
                                     dtype: torch.dtype) -> None:
    need_triton(CPU)
    case_attention(CPU, dtype, ctx_lens, num_q, heads, kv_heads, dim, page, 96,
                   num_splits=splits)


@pytest.mark.parametrize(("splits", "split_len"), [(4, None), (7, None), (2, 1024), (3, 512)])
def test_attention_splits_in_a_wide_table(splits: int, split_len: int | None) -> None:
    """Tables far wider than the contexts (as the graph path's, sized for the window's
    ceiling): the splits share each sequence's own context by default, or a fixed span."""
    need_triton(CPU)
    case_attention(CPU, torch.float32, [0, 9, 150], 4, 4, 2, 64, 4, 400, num_splits=splits,
                   split_len=split_len, spare=60)


@pytest.mark.parametrize(("window", "causal"), [(None, True), (7, True), (3, False), (50, False)])
def test_attention_sliding_and_causal(window: int | None, causal: bool) -> None:
    need_triton(CPU)
    case_attention(CPU, torch.float32, [20, 45], 5, 4, 2, 64, 8, 30, sliding_window=window,
                   causal_block=causal, num_splits=2)


def test_attention_reference_is_softmax_over_visible_keys() -> None:
    """The reference on one query row, recomputed by hand: softmax over context + block keys."""
    x = make_attention_case(CPU, torch.float32, [6], 2, 2, 1, 64, 4, 8, seed=5)
    got = run_attention(x, "torch")
    page = 4
    keys, values = [], []
    for t in range(6):
        slot = int(x["page_tables"][0, t // page]) * page + t % page
        keys.append(x["k_cache"].view(-1, 1, 64)[slot, 0])
        values.append(x["v_cache"].view(-1, 1, 64)[slot, 0])
    keys += [x["k_blk"][0, 0, 0], x["k_blk"][0, 1, 0]]
    values += [x["v_blk"][0, 0, 0], x["v_blk"][0, 1, 0]]
    qv = x["q"][0, 1, 1]
    w = torch.softmax(torch.stack([qv @ k for k in keys]) * 64**-0.5, dim=0)
    want = sum(wi * v for wi, v in zip(w, values))
    torch.testing.assert_close(got[0, 1, 1], want, atol=1e-5, rtol=1e-5)


def test_attention_page_ids_above_65535_and_offsets_above_2_pow_31(tmp_path: Path) -> None:
    """Pages with ids > 2**17 in caches whose element offsets pass 2**31 (sparse files)."""
    need_triton(CPU)
    page, kv_heads, dim = 16, 8, 128
    num_pages = (1 << 31) // (page * kv_heads * dim) + 64  # 131136 pages, 4.3 GB per cache
    numel = num_pages * page * kv_heads * dim
    shape = (num_pages, page, kv_heads, dim)
    caches = (
        sparse_tensor(tmp_path / "k", numel, torch.float16).view(shape),
        sparse_tensor(tmp_path / "v", numel, torch.float16).view(shape),
        sparse_tensor(tmp_path / "sp", num_pages * page, torch.int32),
    )
    x = make_attention_case(CPU, torch.float16, [21, 40], 4, 16, kv_heads, dim, page,
                            num_pages, caches=caches, page_offset=num_pages - 64)
    assert int(x["page_tables"].min()) > 65535
    want = run_attention(x, "torch")
    got = run_attention(x, "triton")
    assert_close(got, want, "attention output")


def test_default_splits_are_few_powers_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """About 2 programs per SM (the batch rounded up to a power of two), as a power of two
    no larger than the context's tiles rounded up: 132 SMs, 8 KV heads, 16K: 33 wanted ->
    32; 3 sequences count as 4 (9 wanted -> 8). The count is a compile-time constant of the
    kernel, so over all batch sizes and contexts it takes only a few values."""
    need_triton(CPU)
    import importlib

    mod = importlib.import_module("blockdraft.kernels.paged_attention")
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    cases = {(1, 8, 16384): 32, (1, 8, 4096): 32, (32, 8, 16384): 2, (1, 8, 64): 1,
             (1, 1, 16384): 256, (3, 8, 6400): 8, (4, 8, 6400): 8, (1, 8, 5 * 64): 4,
             (1, 8, 3 * 64): 2}
    for (n, kvh, ctx), want in cases.items():
        got = mod.default_num_splits(n, kvh, ctx, CPU, 64)
        assert got == want, (n, kvh, ctx)
    seen = {mod.default_num_splits(n, 8, ctx, CPU, 64)
            for n in range(1, 33) for ctx in range(1, 20000, 37)}
    assert seen == {1, 2, 4, 8, 16, 32}


def test_causal_launch_config_follows_power_of_two_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's attention compiles one variant per (sequences, longest new rows) class:
    any call's compile-time constants equal those of the call at the powers of two above its
    sizes, which is the call the engine's warm-up runs (132 SMs, Qwen3-8B heads, a full-width
    table). A ragged prefill chunk of 5 sequences, the longest 100 rows, is the (8, 128) call."""
    need_triton(CPU)
    mod = importlib.import_module("blockdraft.kernels.causal_attention")
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)

    def constants(n: int, rows: int) -> tuple[int, ...]:
        block_q, _, block_m, block_n, splits = mod.launch_config(n, rows, 4, 8, 4096 * 16, CPU)
        return block_q, block_m, block_n, splits

    def up(x: int) -> int:
        return 1 << (x - 1).bit_length()

    seen = set()
    for n in range(1, 33):
        for rows in (*range(1, 70), *range(70, 513, 7)):
            got = constants(n, rows)
            assert got == constants(up(n), up(rows)), (n, rows)
            seen.add(got)
    assert constants(5, 100) == constants(8, 128)
    assert len({s for *_, s in seen}) > 1  # the split count does vary with the class
