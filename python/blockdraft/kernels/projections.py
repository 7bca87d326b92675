"""A forward's projections: ``torch.nn.functional.linear``, or the Triton weight-streaming
GEMMs (:mod:`blockdraft.kernels.skinny_gemm`) for forwards of few rows (the target runtime's
and the drafter's fused view).

A decode (one row per sequence), a verify (a block of rows) or a drafter's block of a small
batch reads every weight once for a handful of rows: the GEMMs are bound by how fast the
weights stream, which the streaming kernels are built for. They run when the
``BLOCKDRAFT_SKINNY_GEMM`` lever is on (:func:`~blockdraft.levers.read_skinny_gemm`; unset, it
is on except under Triton's CPU interpreter), the backend is Triton, the rows are at most
:data:`~blockdraft.kernels.SKINNY_MAX_ROWS` and the activations fp16 or bf16 (fp32 too under
Triton's CPU interpreter, where the tests run); every other call is ``F.linear`` as before.
The choice depends only on shapes and dtypes, so a captured CUDA graph holds one of the two.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from blockdraft.kernels import SKINNY_MAX_ROWS, KernelOps, interpreting


class Projections:
    """``linear`` and the gate/up + SwiGLU of one forward.

    Args:
        ops: the kernels of the runtime's backend.
        streaming: the lever: use the weight-streaming kernels where they apply; ``None``
            (unset) uses them unless Triton runs under its CPU interpreter.
    """

    def __init__(self, ops: KernelOps, streaming: bool | None) -> None:
        self.ops = ops
        if streaming is None:
            streaming = not interpreting()
        self.streaming = streaming and ops.backend == "triton"
        # bf16 tl.dot is wrong under the interpreter, fp32 is what the CPU tests run.
        self._dtypes = ((torch.float16, torch.bfloat16, torch.float32) if interpreting()
                        else (torch.float16, torch.bfloat16))

    def streams(self, x: Tensor, weight: Tensor) -> bool:
        """Whether ``x @ weight.T`` runs on the streaming kernel."""
        return (self.streaming and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS
                and x.dtype in self._dtypes and weight.dtype == x.dtype
                and weight.stride(-1) == 1)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``x @ weight.T (+ bias)`` in ``x``'s dtype."""
        if self.streams(x, weight):
            return self.ops.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def silu_mul(self, x: Tensor, gate_up: Tensor, bias: Tensor | None = None) -> Tensor:
        """``silu(x @ gate.T) * (x @ up.T)`` for the fused ``gate_up [2I, K]`` (gate rows,
        then up rows): one pass over the weight without the ``[M, 2I]`` product when
        streaming."""
        if self.streams(x, gate_up):
            return self.ops.linear_silu_mul(x, gate_up, bias)
        return self.ops.silu_mul(F.linear(x, gate_up, bias))


__all__ = ["Projections"]
