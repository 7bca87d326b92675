"""Accumulator append/slide, masked selection and DFlash2 kernels vs their references."""

from __future__ import annotations

import pytest
import torch

from kernel_support import K, assert_close, need_triton, pack_bitmask, random_bitmask

from blockdraft._core import GraphMeta

CPU = torch.device("cpu")


def case_acc(device: torch.device, dtype: torch.dtype, windows: list[int], counts: list[int],
             starts: list[int], src_starts: list[int], keeps: list[int], cols: int,
             seed: int = 0) -> None:
    """Append then slide on both backends; accumulators must be bit-identical (plain copies)."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(w, cols, generator=gen).to(dtype).to(device) for w in windows]
    rows = torch.randn(sum(counts), cols, generator=gen).to(dtype).to(device)
    res = {}
    for backend in ("triton", "torch"):
        accs = [a.clone() for a in init]
        K.acc_append(accs, rows, counts, starts, backend=backend)  # type: ignore[arg-type]
        appended = [a.clone() for a in accs]
        K.acc_slide(accs, src_starts, keeps, backend=backend)  # type: ignore[arg-type]
        res[backend] = (appended, accs)
    for i in range(len(windows)):
        assert torch.equal(res["triton"][0][i], res["torch"][0][i]), f"append: accs[{i}]"
        assert torch.equal(res["triton"][1][i], res["torch"][1][i]), f"slide: accs[{i}]"
        # rows past the kept ones are left as they were
        assert torch.equal(res["triton"][1][i][keeps[i]:], res["triton"][0][i][keeps[i]:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_acc_append_and_overlapping_slide(dtype: torch.dtype) -> None:
    need_triton(CPU)
    # seq 0: src 1 < keep (heavy overlap); seq 1: nothing appended; seq 2: disjoint ranges;
    # seq 3: 63 rows, keep 40 from 20 (overlap crossing several 16-row tiles)
    case_acc(CPU, dtype, windows=[10, 5, 40, 64], counts=[3, 0, 7, 63], starts=[2, 5, 30, 1],
             src_starts=[1, 0, 20, 20], keeps=[9, 5, 17, 40], cols=1037)


def test_acc_single_row_sequences() -> None:
    need_triton(CPU)
    case_acc(CPU, torch.float32, windows=[1, 3, 17], counts=[1, 1, 1], starts=[0, 2, 16],
             src_starts=[0, 2, 16], keeps=[1, 1, 1], cols=3)


def test_acc_slide_reference_semantics() -> None:
    acc = torch.arange(10.0)[:, None].repeat(1, 2)
    K.acc_slide([acc], [3], [6], backend="torch")
    assert acc[:, 0].tolist() == [3, 4, 5, 6, 7, 8, 6, 7, 8, 9]


def case_argmax(device: torch.device, dtype: torch.dtype, rows: int, vocab: int,
                with_mask: bool, seed: int = 0, num_splits: int | None = None,
                tile: tuple[int, ...] | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    # few distinct values: many exact ties, which must go to the lowest allowed id
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype).to(device)
    bitmask = random_bitmask(rows, vocab, gen, device, density=0.3) if with_mask else None
    if bitmask is not None and rows > 2:
        bitmask[1] = 0  # nothing allowed -> -1
    want = K.masked_argmax(logits, bitmask, backend="torch")
    if num_splits is None and tile is None:
        got = K.masked_argmax(logits, bitmask, backend="triton")
    else:
        import importlib

        sel = importlib.import_module("blockdraft.kernels.selection")
        got = sel.masked_argmax(logits, bitmask, num_splits=num_splits, tile=tile)
    assert torch.equal(got, want)
    if bitmask is None:
        assert torch.equal(got, torch.argmax(logits.float(), dim=1))


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 33), (17, 5000), (63, 1000), (1000, 64),
                                           (260, 4100)])
@pytest.mark.parametrize("with_mask", [True, False])
def test_masked_argmax(rows: int, vocab: int, with_mask: bool) -> None:
    need_triton(CPU)
    case_argmax(CPU, torch.float16, rows, vocab, with_mask)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_masked_argmax_split_vocab(splits: int) -> None:
    need_triton(CPU)
    case_argmax(CPU, torch.float32, 5, 7000, True, num_splits=splits)


@pytest.mark.parametrize("tile", [(1, 1), (2, 4), (16, 4), (128, 8), (1, 1, 2), (2, 2, 2),
                                  (32, 2, 2)])
@pytest.mark.parametrize(("vocab", "splits"), [(33, None), (4097, 2), (7000, None), (7000, 3)])
def test_masked_argmax_tiles(tile: tuple[int, ...], vocab: int, splits: int | None) -> None:
    """Every tile shape the kernel lab sweeps, with one or two tiles per loop step, gives the
    reference's ids (ragged last step, a second tile wholly or partly past the vocabulary; a
    split boundary inside a mask word's range never happens: splits are whole steps)."""
    need_triton(CPU)
    case_argmax(CPU, torch.float32, 4, vocab, True, seed=vocab, num_splits=splits, tile=tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_masked_argmax_minus_inf_rows(dtype: torch.dtype) -> None:
    """Allowed ids whose logits are all -inf: the lowest allowed id (the reference's answer),
    on a row where -inf sits in every split; and -inf mixed with finite values elsewhere."""
    need_triton(CPU)
    import importlib

    sel = importlib.import_module("blockdraft.kernels.selection")
    vocab = 5000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    logits[0] = float("-inf")  # everything -inf, some ids allowed
    logits[1, :] = float("-inf")
    logits[1, 4321] = 2.0  # one finite value, allowed
    logits[2, 100:] = float("-inf")  # finite values only on disallowed ids
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[0, [977, 3000, 4999]] = True
    allowed[1, [5, 4321]] = True
    allowed[2, [150, 4000]] = True
    allowed[3] = True
    mask = pack_bitmask(allowed)
    want = K.masked_argmax(logits, mask, backend="torch")
    assert want.tolist()[:3] == [977, 4321, 150]
    for splits in (None, 1, 3):
        for tile in ((2, 1), (2, 1, 2)):
            got = sel.masked_argmax(logits, mask, num_splits=splits, tile=tile)
            assert torch.equal(got, want), (splits, tile)
    no_mask = torch.full((2, vocab), float("-inf"), dtype=dtype)
    assert sel.masked_argmax(no_mask, None).tolist() == [0, 0]


def test_masked_argmax_bad_tile() -> None:
    import importlib

    need_triton(CPU)
    sel = importlib.import_module("blockdraft.kernels.selection")
    with pytest.raises(ValueError, match="tile"):
        sel.masked_argmax(torch.zeros(2, 40), None, tile=(3, 4))
    with pytest.raises(ValueError, match="tile"):
        sel.masked_argmax(torch.zeros(2, 40), None, tile=(4, 3))
    with pytest.raises(ValueError, match="tile"):
        sel.masked_argmax(torch.zeros(2, 40), None, tile=(4, 2, 3))
    with pytest.raises(ValueError, match="tile"):
        sel.masked_argmax(torch.zeros(2, 40), None, tile=(4,))


def test_bitmask_bit_order() -> None:
    """Bit j of word w allows id 32*w + j, including bit 31 (the int32 sign bit)."""
    logits = torch.zeros(1, 64)
    logits[0, 63] = -5.0
    allowed = torch.zeros(1, 64, dtype=torch.bool)
    allowed[0, 63] = True
    mask = pack_bitmask(allowed)
    assert int(mask[0, 1]) == -(1 << 31)
    for backend in ("torch", "triton"):
        if backend == "triton":
            need_triton(CPU)
        assert int(K.masked_argmax(logits, mask, backend=backend)[0]) == 63  # type: ignore[arg-type]


def case_sample(device: torch.device, dtype: torch.dtype, rows: int, vocab: int, top_k: int,
                top_p: float, with_mask: bool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
    bitmask = random_bitmask(rows, vocab, gen, device) if with_mask else None
    out = {}
    for backend in ("triton", "torch"):
        g = torch.Generator(device=device).manual_seed(seed + 1)
        out[backend] = K.masked_sample(logits, bitmask, 0.8, top_k, top_p, g,
                                       backend=backend)  # type: ignore[arg-type]
    (tok_t, q_t), (tok_r, q_r) = out["triton"], out["torch"]
    assert torch.equal(tok_t, tok_r)
    torch.testing.assert_close(q_t, q_r, atol=1e-5, rtol=1e-4)
    assert (q_t > 0).all() and (q_t <= 1).all()
    if bitmask is not None:
        allowed = K.reference.unpack_bitmask(bitmask, vocab)
        assert allowed.gather(1, tok_t[:, None]).all(), "a masked-out token was sampled"


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.7), (3, 0.5)])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 10), (17, 1000)])
def test_masked_sample_matches_reference(rows: int, vocab: int, top_k: int, top_p: float) -> None:
    need_triton(CPU)
    case_sample(CPU, torch.float32, rows, vocab, top_k, top_p, with_mask=True)


def test_masked_sample_distribution_and_q() -> None:
    """Empirical token frequencies match q (the probability the sampler reports)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(4000, 1)
    allowed = torch.tensor([[True, True, False, True, True]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, q = K.masked_sample(logits, pack_bitmask(allowed), 1.0, 3, 1.0, g, backend="torch")
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)  # top-3 of the allowed ids 0, 1, 4
    for tok, p in zip((0, 1, 4), probs.tolist()):
        freq = (tokens == tok).float().mean().item()
        assert abs(freq - p) < 0.03, (tok, freq, p)
        assert torch.allclose(q[tokens == tok], torch.tensor(p))
    assert not ((tokens == 2) | (tokens == 3)).any()


def test_masked_sample_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50)
    tokens, q = K.masked_sample(logits, None, 0.0, backend="torch")
    assert torch.equal(tokens, torch.argmax(logits, 1)) and torch.equal(q, torch.ones(4))


def case_conv(device: torch.device, dtype: torch.dtype, n: int, length: int, hidden: int,
              taps: int, group: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, hidden, generator=gen).to(dtype).to(device)
    proj = torch.randn(n, length, 2, taps, hidden // group, generator=gen).to(dtype).to(device)
    base = torch.randn(taps, hidden, generator=gen).to(dtype).to(device)
    dyn = proj[:, :, 0]  # a strided view, as the drafter produces it
    got = K.dynamic_conv(x, dyn, base, group, backend="triton")
    want = K.dynamic_conv(x, dyn, base, group, backend="torch")
    assert_close(got, want, "dynamic_conv")


@pytest.mark.parametrize(("n", "length", "hidden", "taps", "group"),
                         [(1, 1, 64, 3, 64), (3, 8, 96, 4, 32), (2, 16, 300, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dynamic_conv(n: int, length: int, hidden: int, taps: int, group: int,
                      dtype: torch.dtype) -> None:
    need_triton(CPU)
    case_conv(CPU, dtype, n, length, hidden, taps, group)


def test_dynamic_conv_matches_public_dflash() -> None:
    """The reference equals the public dflash package's convolution (fp32)."""
    dflash_model = pytest.importorskip("dflash.model")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=gen)
    dyn = torch.randn(2, 8, 3, 4, generator=gen)
    base = torch.randn(3, 64, generator=gen)
    want = dflash_model._grouped_dynamic_convolve(x, dyn, base, 16)
    got = K.dynamic_conv(x, dyn, base, 16, backend="torch")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def case_selector(device: torch.device, dtype: torch.dtype, n: int, positions: int, cands: int,
                  rank: int, vocab: int, temperature: float, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    args = [
        torch.randn(n, positions, cands, generator=gen).to(dtype),
        torch.randint(0, vocab, (n, positions, cands), generator=gen),
        torch.randn(n, positions, rank, generator=gen).to(dtype),
        torch.randn(vocab, rank, generator=gen).to(dtype),
        torch.randn(vocab, rank, generator=gen).to(dtype),
        torch.randint(0, vocab, (n,), generator=gen),
    ]
    args = [a.to(device) for a in args]
    u = torch.rand(n, positions, generator=gen).to(device)
    p_t, q_t = K.selector_walk(*args, temperature, u, backend="triton")
    p_r, q_r = K.selector_walk(*args, temperature, u, backend="torch")
    assert torch.equal(p_t, p_r)
    if temperature > 0:
        assert q_t is not None and q_r is not None
        torch.testing.assert_close(q_t, q_r, atol=1e-5, rtol=1e-4)
    else:
        assert q_t is None and q_r is None


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize(("n", "positions", "cands", "rank"), [(1, 1, 1, 3), (3, 15, 9, 12), (4, 7, 32, 64)])
def test_selector_walk(n: int, positions: int, cands: int, rank: int, temperature: float) -> None:
    need_triton(CPU)
    case_selector(CPU, torch.float32, n, positions, cands, rank, 200, temperature)


def test_selector_reference_matches_public_dflash_greedy() -> None:
    """Greedy walk of the reference == dflash's CandidateSelector.select on the same tensors."""
    dflash_model = pytest.importorskip("dflash.model")
    from types import SimpleNamespace

    torch.manual_seed(0)
    cfg = SimpleNamespace(vocab_size=100, hidden_size=32,
                          dflash_config={"selector_rank": 8, "selector_top_k": 6})
    sel = dflash_model.CandidateSelector(cfg)
    for p in sel.parameters():
        torch.nn.init.normal_(p)
    hidden = torch.randn(2, 5, 32)
    logits = torch.randn(2, 5, 100)
    anchor = torch.randint(0, 100, (2,))
    with torch.no_grad():
        path, cands, _ = sel.select(hidden, logits, anchor, 0.0)
        unary = logits.gather(-1, cands)
        got, _ = K.selector_walk(unary, cands, sel.hidden_projection(hidden),
                                 sel.predecessor_codebook.weight, sel.successor_codebook.weight,
                                 anchor, 0.0, backend="torch")
    assert torch.equal(got, path)


def case_block_inputs(device: torch.device, dtype: torch.dtype, m: int, block: int, width: int,
                      hidden: int, vocab: int = 50, seed: int = 0) -> None:
    """The graph metadata -> drafter inputs kernel equals its reference exactly (copies and
    integer conversions only), padding rows (length 0, the mask token) included."""
    gen = torch.Generator().manual_seed(seed)
    cols = 3 + width + 2 * block
    meta = torch.randint(0, 2**40, (m, cols), generator=gen)
    meta[:, 3 : 3 + width] = torch.randint(0, 70000, (m, width), generator=gen)
    meta[:, 0] = torch.randint(0, 5000, (m,), generator=gen)
    meta[:, 1] = torch.randint(0, vocab, (m,), generator=gen)
    meta[:, 2] = torch.randint(0, 2**40, (m,), generator=gen)
    if m > 1:
        meta[-1, :3] = torch.tensor([0, vocab - 1, 0])  # a bucket's padding row
    meta = meta.to(device)
    embed = torch.randn(vocab, hidden, generator=gen).to(device)
    got = K.block_inputs(meta, 3, width, embed, vocab - 1, block, dtype, backend="triton")
    want = K.block_inputs(meta, 3, width, embed, vocab - 1, block, dtype, backend="torch")
    for name, g, w in zip(("lens", "tables", "embeds", "positions"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize(("m", "block", "width", "hidden"),
                         [(1, 4, 1, 8), (3, 8, 17, 33), (4, 16, 1030, 64), (17, 2, 5, 4100)])
def test_block_inputs(m: int, block: int, width: int, hidden: int) -> None:
    need_triton(CPU)
    case_block_inputs(CPU, torch.float32, m, block, width, hidden)


def test_block_inputs_validation() -> None:
    need_triton(CPU)
    import importlib

    mod = importlib.import_module("blockdraft.kernels.graph_inputs")
    embed = torch.zeros(10, 8)
    with pytest.raises(ValueError, match="meta"):
        mod.block_inputs(torch.zeros(2, 9, dtype=torch.int32), 3, 2, embed, 9, 2, torch.float32)
    with pytest.raises(ValueError, match="meta"):
        mod.block_inputs(torch.zeros(2, 4, dtype=torch.int64), 3, 2, embed, 9, 2, torch.float32)
    with pytest.raises(ValueError, match="block"):
        mod.block_inputs(torch.zeros(2, 9, dtype=torch.int64), 3, 2, embed, 9, 0, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stage_gather_reads_rows_by_address(dtype: torch.dtype) -> None:
    """The graph path's gather: staged row j (metadata row j // B, entry j % B) is the
    accumulator row its source column points at; unused entries (slot -1, address 0 here)
    give zero rows and are never read."""
    need_triton(CPU)
    from blockdraft.kernels.accumulator import stage_gather

    gamma, width, cols = 3, 2, 1037
    gen = torch.Generator().manual_seed(5)
    accs = [torch.randn(w, cols, generator=gen).to(dtype) for w in (5, 9)]
    picks = [(0, 1), (0, 4), (1, 0), (1, 8), (1, 3)]  # (accumulator, row) of staged rows
    rows = 3
    _, _, slot_col, src_col, cols_meta = GraphMeta.layout(width, gamma)
    meta = torch.zeros((rows, cols_meta), dtype=torch.int64)
    meta[:, slot_col : slot_col + gamma] = -1
    elem = accs[0].element_size()
    for j, (a, r) in enumerate(picks):
        meta[j // gamma, slot_col + j % gamma] = 100 + j
        meta[j // gamma, src_col + j % gamma] = accs[a].data_ptr() + r * cols * elem
    stage = torch.full((rows * gamma, cols), 7.0, dtype=dtype)
    stage_gather(meta, slot_col, src_col, gamma, stage)
    for j, (a, r) in enumerate(picks):
        assert torch.equal(stage[j], accs[a][r]), j
    assert not stage[len(picks) :].any()
    # a capacity below the staged rows gathers only those
    part = torch.full((2, cols), 7.0, dtype=dtype)
    stage_gather(meta, slot_col, src_col, gamma, part)
    assert torch.equal(part, torch.stack([accs[0][1], accs[0][4]]))
