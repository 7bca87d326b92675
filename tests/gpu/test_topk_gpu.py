"""The split top-K kernel on a CUDA device at DFlash2's shapes (a Qwen-sized vocabulary, one
sequence's rows up to a batch's), against ``torch.topk``; and the CPU cases in bf16/fp16."""

from __future__ import annotations

import pytest
import torch

import test_kernels_topk as tk
from support.kernel_support import K

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda")
VOCAB = 151936


@pytest.mark.parametrize("rows", [1, 15, 480])
@pytest.mark.parametrize("k", [1, 8])
def test_topk_bf16_logits_gpu(rows: int, k: int) -> None:
    """Gaussian bf16 logits tie often (8 mantissa bits over 152K ids): sorted values equal
    torch's exactly, ids above the K-th value equal, the lowest ids at the K-th value."""
    gen = torch.Generator(device=GPU).manual_seed(rows * 10 + k)
    logits = (3 * torch.randn(rows, VOCAB, generator=gen, device=GPU)).to(torch.bfloat16)
    got = K.ops("triton").topk(logits, k)
    tk.assert_topk_lowest_ids(logits, k, got)


@pytest.mark.parametrize("rows", [1, 15, 480])
def test_topk_distinct_fp32_logits_gpu(rows: int) -> None:
    """Distinct values: the same id set as torch.topk."""
    gen = torch.Generator(device=GPU).manual_seed(rows)
    logits = torch.rand(rows, VOCAB, generator=gen, device=GPU).argsort(-1).to(torch.float32)
    got = K.ops("triton").topk(logits, 8)
    tk.assert_same_topk(logits, 8, got, distinct=True)


def test_topk_block_rows_gpu() -> None:
    """[n, T, V] logits, as DFlash2's select passes them."""
    gen = torch.Generator(device=GPU).manual_seed(3)
    logits = torch.randn(32, 15, VOCAB, generator=gen, device=GPU).to(torch.bfloat16)
    vals, ids = K.ops("triton").topk(logits, 8)
    assert vals.shape == ids.shape == (32, 15, 8)
    tk.assert_topk_lowest_ids(logits.view(-1, VOCAB), 8, (vals.view(-1, 8), ids.view(-1, 8)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1000), (3, 4099), (17, 1000), (64, 5000)])
@pytest.mark.parametrize("k", [1, 8])
def test_topk_small_gpu(dtype: torch.dtype, rows: int, vocab: int, k: int) -> None:
    tk.case_topk(GPU, dtype, rows, vocab, k, seed=rows + vocab + k)
