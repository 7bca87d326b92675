"""The kernel checks of tests/kernels/test_kernels_*.py on a CUDA device, in bf16 and fp16, with larger
and sparse cases that need real device memory. Run: ``bash kernels/run_gpu.sh``."""

from __future__ import annotations

import pytest
import torch

import test_kernels_attention as att
import test_kernels_causal as causal
import test_kernels_fused as fused
import test_kernels_kv_store as kvs
import test_kernels_rows as rows
from support.kernel_support import K, assert_close

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("r", "layers", "heads", "dim", "page", "pages", "as_list"), [
    (1, 1, 1, 64, 4, 3, False), (17, 5, 8, 128, 16, 4, True), (63, 3, 2, 64, 8, 40, False),
    (1000, 5, 8, 128, 16, 100, False), (4096, 2, 4, 64, 16, 300, False),
])
def test_kv_store_gpu(dtype: torch.dtype, r: int, layers: int, heads: int, dim: int, page: int,
                      pages: int, as_list: bool) -> None:
    kvs.case_kv_store(GPU, dtype, r, layers, heads, dim, page, pages, as_list)


def test_kv_store_gpu_slots_beyond_2_pow_31() -> None:
    page, heads, dim = 16, 1, 4
    num_slots = (1 << 31) + 64 * page
    shape = (1, num_slots // page, page, heads, dim)
    k_c = torch.zeros(shape, dtype=torch.bfloat16, device=GPU)
    v_c = torch.zeros(shape, dtype=torch.bfloat16, device=GPU)
    sp = torch.zeros(num_slots, dtype=torch.int32, device=GPU)
    slots = torch.tensor([(1 << 31) + 5, 3, (1 << 31) + 1000, -1], device=GPU)
    kv = torch.randn(4, 1, 2, heads, dim, device=GPU).to(torch.bfloat16)
    pos = torch.tensor([7, 8, 9, 10], device=GPU)
    w = torch.ones(1, dim, dtype=torch.bfloat16, device=GPU)
    inv = torch.ones(dim // 2, device=GPU)
    K.ops("triton").ctx_kv_store(kv, pos, slots, w, inv, 1.0, 1e-6, k_c, v_c, sp)
    flat = v_c.view(-1, heads, dim)
    for i, s in enumerate(slots.tolist()[:3]):
        assert torch.equal(flat[s], kv[i, 0, 1]) and int(sp[s]) == int(pos[i])
    assert int(sp[(1 << 31) + 4]) == 0 and not flat[(1 << 31) + 6].any()
    del k_c, v_c, sp
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("ctx_lens", "num_q", "hq", "hkv", "dim", "page", "splits"), [
    ([0], 1, 1, 1, 64, 4, None), ([5, 17, 40], 4, 8, 2, 64, 8, 3),
    ([63], 16, 8, 1, 128, 16, 4), ([1, 30, 100], 3, 4, 4, 64, 4, 2),
    ([1000, 3, 777], 16, 32, 8, 128, 16, None), ([4099], 16, 32, 4, 128, 16, None),
    ([2000] * 3, 8, 16, 16, 64, 8, None),
])
def test_attention_gpu(dtype: torch.dtype, ctx_lens: list[int], num_q: int, hq: int, hkv: int,
                       dim: int, page: int, splits: int | None) -> None:
    pages = len(ctx_lens) * (max((c + page - 1) // page for c in ctx_lens) + 1) + 8
    att.case_attention(GPU, dtype, ctx_lens, num_q, hq, hkv, dim, page, pages, num_splits=splits)


@pytest.mark.parametrize(("window", "causal"), [(None, True), (7, True), (3, False), (300, False)])
def test_attention_gpu_sliding(window: int | None, causal: bool) -> None:
    att.case_attention(GPU, torch.bfloat16, [20, 450], 16, 32, 8, 128, 16, 64,
                       sliding_window=window, causal_block=causal)


def test_attention_gpu_page_ids_and_offsets_beyond_2_pow_31() -> None:
    page, hkv, dim = 16, 8, 128
    num_pages = (1 << 31) // (page * hkv * dim) + 64
    shape = (num_pages, page, hkv, dim)
    caches = (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16),
              torch.zeros(num_pages * page, dtype=torch.int32))
    x = att.make_attention_case(torch.device("cpu"), torch.bfloat16, [21, 40], 4, 16, hkv, dim,
                                page, num_pages, caches=caches, page_offset=num_pages - 64)
    x = {k: v.to(GPU) for k, v in x.items()}
    del caches
    want = att.run_attention(x, "torch")
    got = att.run_attention(x, "triton")
    assert_close(got, want, "attention output")


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_acc_gpu(dtype: torch.dtype, strided: bool) -> None:
    rows.case_acc(GPU, dtype, windows=[10, 5, 40, 2000], counts=[3, 0, 7, 999],
                  starts=[2, 5, 30, 1], cols=5 * 512 + 3, strided=strided)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("r", "vocab"), [(1, 1), (3, 33), (17, 151936), (63, 1000),
                                          (1000, 4096), (512, 151936)])
@pytest.mark.parametrize("with_mask", [True, False])
def test_masked_argmax_gpu(dtype: torch.dtype, r: int, vocab: int, with_mask: bool) -> None:
    rows.case_argmax(GPU, dtype, r, vocab, with_mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "block", "width", "hidden"), [(1, 16, 1024, 4096), (33, 16, 1030, 4096)])
def test_block_inputs_gpu(dtype: torch.dtype, m: int, block: int, width: int, hidden: int) -> None:
    rows.case_block_inputs(GPU, dtype, m, block, width, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("new", "ctx", "heads", "kv_heads", "dim", "page"), [
    ([1], [4095], 32, 8, 128, 16),  # decode at 4K, Qwen3-8B heads
    ([16] * 4, [4000, 17, 900, 0], 32, 8, 128, 16),  # verify blocks
    ([512], [1024], 32, 8, 128, 16),  # a prefill chunk
    ([3, 1, 20], [100, 7, 30], 12, 3, 64, 8),
])
def test_causal_attention_gpu(new: list[int], ctx: list[int], heads: int, kv_heads: int,
                              dim: int, page: int, dtype: torch.dtype) -> None:
    causal.case_causal(GPU, dtype, new, ctx, heads, kv_heads, dim, page)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("new", "ctx"), [([16], [4000]), ([1, 16], [4095, 700])])
def test_causal_attention_in_a_wide_table_gpu(new: list[int], ctx: list[int], dtype: torch.dtype) -> None:
    # Tables sized for 40960 tokens, as a runtime's for a target of that many positions.
    causal.case_causal(GPU, dtype, new, ctx, 32, 8, 128, 16, spare=2560 - 250)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_in_a_wide_table_gpu(dtype: torch.dtype) -> None:
    # The graph path's tables: as wide as the window's 16384-token ceiling.
    att.case_attention(GPU, dtype, [4000, 60], 16, 32, 8, 128, 16, 2100, spare=1024 - 250)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_sliding_gpu(dtype: torch.dtype) -> None:
    causal.case_causal(GPU, dtype, [16, 1], [300, 4000], 32, 8, 128, 16, window=128, splits=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_store_gpu(dtype: torch.dtype, norm: bool) -> None:
    causal.case_rope_store(GPU, dtype, 37, 32, 8, 128, norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("r", "size"), [(1, 1), (63, 4096), (512, 5120), (3, 4099)])
@pytest.mark.parametrize("with_y", [True, False])
def test_add_rms_norm_gpu(dtype: torch.dtype, r: int, size: int, with_y: bool) -> None:
    fused.case_add_rms_norm(GPU, dtype, r, size, with_y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("r", "heads", "kv_heads", "dim"), [
    (1, 32, 8, 128), (63, 12, 3, 64), (512, 32, 8, 128), (3, 5, 1, 6),
])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_gpu(dtype: torch.dtype, r: int, heads: int, kv_heads: int, dim: int,
                          norm: bool) -> None:
    fused.case_qk_norm_rope(GPU, dtype, r, heads, kv_heads, dim, norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("r", "inner"), [(1, 1), (63, 12288), (512, 3 * 1024 + 5)])
def test_silu_mul_gpu(dtype: torch.dtype, r: int, inner: int) -> None:
    fused.case_silu_mul(GPU, dtype, r, inner)
