"""The proposer's fast path: the fused drafter view and the precompute inside the graph.

``FastDrafter`` (stacked q/k/v and gate/up weights, fused norm/RoPE/SwiGLU steps) must compute
the reference ``forward_block`` in fp32, with its torch steps and with its Triton kernels (run by
the interpreter here). The graph path with the ctx K/V precompute captured (``graphs="static"``
runs the same buffers eagerly) must draft exactly what the plain path drafts.
"""

from __future__ import annotations

import pytest
import torch
from tinypair import drafter_config, tiny_drafter

from blockdraft.kernels import triton_available
from blockdraft.models.attention import ReferenceAttend
from blockdraft.models.fast import FastDrafter

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="Triton is not importable here"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_forward_equals_the_reference_forward_in_fp32(backend: str) -> None:
    drafter = tiny_drafter(drafter_config(block=4, layers=2))
    fast = FastDrafter.from_drafter(drafter, backend)  # type: ignore[arg-type]
    assert fast is not None
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 7, 64, generator=gen)
    ctx_pos = [torch.arange(7), torch.arange(3, 10)]
    kv = [drafter.context_kv(drafter.fuse_context(ctx[i]), ctx_pos[i]) for i in range(2)]
    embeds = torch.randn(2, 4, 32, generator=gen)
    block_pos = torch.stack([torch.arange(7, 11), torch.arange(10, 14)])
    attend = ReferenceAttend(drafter.config, kv, ctx_pos, block_pos)
    want = drafter.forward_block(embeds, block_pos, attend)
    got = fast.forward_block(embeds, block_pos, attend)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(fast.fuse_context(ctx[0]), drafter.fuse_context(ctx[0]),
                               atol=2e-6, rtol=1e-5)
    # The view copies the weights: the reference drafter is unchanged and keeps its modules.
    assert fast.qkv_weight[0].shape == (4 * 8 + 2 * 2 * 8, 32)
    assert fast.gate_up_weight[1].shape == (2 * 48, 32)


def test_dflash2_drafters_have_no_fused_view() -> None:
    cfg = drafter_config(extra={"architectures": ["DFlash2DraftModel"], "conv_kernel_size": 2,
                                "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4})
    from blockdraft.models import DFlash2Drafter

    drafter = DFlash2Drafter(cfg, device="cpu", dtype=torch.float32)
    assert FastDrafter.from_drafter(drafter, "torch") is None
    assert FastDrafter.from_drafter(object(), "torch") is None
