"""The accumulator append, masked argmax, graph inputs and staged-row gather kernels vs their
references."""

from __future__ import annotations

import pytest
import torch

from blockdraft._core import GraphMeta

from support.kernel_support import K, need_triton, pack_bitmask, random_bitmask

CPU = torch.device("cpu")


def case_acc(device: torch.device, dtype: torch.dtype, windows: list[int], counts: list[int],
             starts: list[int], cols: int, seed: int = 0, strided: bool = False) -> None:
    """The batched append (accumulators by address) against the reference; accumulators must
    be bit-identical (plain copies), rows outside the appended ones untouched. ``strided``:
    the rows given are every other row of a column band of a wider buffer whose other cells
    are NaN (a read from the wrong place shows)."""
    need_triton(device)
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(w, cols, generator=gen).to(dtype).to(device) for w in windows]
    rows = torch.randn(sum(counts), cols, generator=gen).to(dtype).to(device)
    want = [a.clone() for a in init]
    K.reference.acc_append(want, rows, counts, starts)
    got = [a.clone() for a in init]
    ops = K.ops("triton")
    assert ops.acc_append is not None and ops.append_table is not None
    row_map = [i for i, c in enumerate(counts) for _ in range(c)]
    row_map += [s + j for s, c in zip(starts, counts) for j in range(c)]
    given = rows
    if strided:
        wide = torch.full((2 * len(rows), cols + 3), float("nan"), dtype=dtype, device=device)
        wide[::2, 1 : cols + 1] = rows
        given = wide[::2, 1 : cols + 1]
    ops.acc_append(given, ops.append_table([a.data_ptr() for a in got], row_map, device))
    for i in range(len(windows)):
        assert torch.equal(got[i], want[i]), f"append: accs[{i}]"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_acc_append(dtype: torch.dtype) -> None:
    # seq 1: nothing appended; seq 3: 63 rows crossing several column tiles
    case_acc(CPU, dtype, windows=[10, 5, 40, 64], counts=[3, 0, 7, 63], starts=[2, 5, 30, 1],
             cols=1037)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_acc_append_strided_rows(dtype: torch.dtype) -> None:
    case_acc(CPU, dtype, windows=[10, 5, 40, 64], counts=[3, 0, 7, 63], starts=[2, 5, 30, 1],
             cols=1037, strided=True)


def test_acc_single_row_sequences() -> None:
    case_acc(CPU, torch.float32, windows=[1, 3, 17], counts=[1, 1, 1], starts=[0, 2, 16], cols=3)


def case_argmax(device: torch.device, dtype: torch.dtype, rows: int, vocab: int,
                with_mask: bool, seed: int = 0, num_splits: int | None = None,
                tile: tuple[int, ...] | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    # few distinct values: many exact ties, which must go to the lowest allowed id
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype).to(device)
    bitmask = random_bitmask(rows, vocab, gen, device, density=0.3) if with_mask else None
    if bitmask is not None and rows > 2:
        bitmask[1] = 0  # nothing allowed -> -1
    want = K.reference.masked_argmax(logits, bitmask)
    if num_splits is None and tile is None:
        got = K.ops("triton").masked_argmax(logits, bitmask)
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
    want = K.reference.masked_argmax(logits, mask)
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
        assert int(K.ops(backend).masked_argmax(logits, mask)[0]) == 63  # type: ignore[arg-type]


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
    got = K.ops("triton").block_inputs(meta, 3, width, embed, vocab - 1, block, dtype)
    want = K.reference.block_inputs(meta, 3, width, embed, vocab - 1, block, dtype)
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
