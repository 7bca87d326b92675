"""The weight-streaming GEMM checks of tests/kernels/test_kernels_skinny_gemm.py on a CUDA
device in bf16 and fp16, at Qwen3-8B projection shapes too; split-K sums are the same bits on
every run, and a launch captured in a CUDA graph replays the eager result."""

from __future__ import annotations

import pytest
import torch

import test_kernels_skinny_gemm as sk
from support.kernel_support import K

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]
QWEN3_8B = [(6144, 4096), (4096, 4096), (4096, 12288)]  # q/k/v fused, o, down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), sk.SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", range(3))
def test_linear_gpu(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool, config: int) -> None:
    sk.case_linear(GPU, dtype, rows, n, k, bias, sk._configs()[config])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B)
def test_linear_gpu_qwen3_shapes(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    sk.case_linear(GPU, dtype, rows, n, k, False, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 20, 37), (3, 50, 300), (16, 7, 520),
                                              (4, 12288, 4096)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", range(3))
def test_linear_silu_mul_gpu(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool,
                             config: int) -> None:
    sk.case_silu_mul(GPU, dtype, rows, n, k, bias, sk._configs()[config])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 37), (3, 300, 64), (16, 97, 130),
                                              (16, 151936, 4096), (1, 151936, 4096)])
@pytest.mark.parametrize("config", range(3))
def test_linear_argmax_gpu(dtype: torch.dtype, rows: int, n: int, k: int, config: int) -> None:
    sk.case_argmax(GPU, dtype, rows, n, k, sk._configs()[config])


def test_split_k_is_deterministic_and_graph_safe() -> None:
    x, w, b = sk._data(16, 4096, 12288, torch.bfloat16, GPU, True, seed=3)
    lin = K.ops("triton").linear
    first = lin(x, w, b)
    assert all(torch.equal(lin(x, w, b), first) for _ in range(5))
    xs = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lin(xs, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(xs, w, b)
    x2 = torch.randn_like(x)
    xs.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lin(x2, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_drafter_fused_view_streams_its_block(dtype: torch.dtype) -> None:
    """The drafter's fused view of one sequence's block (16 rows) on the streaming GEMMs gives
    its ``F.linear`` result within the dtype's rounding."""
    from blockdraft import kernels
    from blockdraft import pair as bd_pair
    from blockdraft.kernels.projections import Projections
    from blockdraft.proposer.fast import FastDrafter

    shape = bd_pair.SHAPES["qwen3-8b"]
    drafter = bd_pair.random_drafter(shape, GPU, dtype)
    ops = kernels.ops("triton")
    views = [FastDrafter.from_drafter(drafter, ops, Projections(ops, on)) for on in (True, False)]
    gen = torch.Generator(device=GPU).manual_seed(0)
    embeds = torch.randn(1, shape.block_size, shape.hidden, generator=gen, device=GPU, dtype=dtype)
    pos = torch.arange(100, 100 + shape.block_size, device=GPU)[None]

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Each block row attends to the block's rows only: enough to compare two projections.
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)

    got, want = (view.forward_block(embeds, pos, attend) for view in views if view is not None)
    assert views[0] is not None and views[0].proj.streams(embeds.view(-1, shape.hidden), views[0].qkv_weight[0])
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
