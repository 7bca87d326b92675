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
