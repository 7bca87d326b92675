"""A fused view of a DFlash drafter for the proposer's graph path (same math, fewer kernels).

:class:`FastDrafter` is built from a :class:`~blockdraft.models.DFlashDrafter`'s weights and
leaves the drafter untouched (the drafter stays the reference). Per layer it runs four GEMMs
instead of seven — ``q/k/v`` stacked into one weight ``[(Hq+2Hkv)*D, H]``, ``gate/up`` into
one ``[2I, H]``, then ``o`` and ``down`` — and three fused elementwise steps instead of ~40 small
kernels: q/k RMSNorm + RoPE (+ the v split) in one launch, residual add + RMSNorm in one launch
(the next sub-block's input norm, or the final norm, fused into the previous residual add), and
SwiGLU's ``silu(gate) * up`` in one launch. Its projections go through a
:class:`~blockdraft.kernels.projections.Projections` (the proposer's: the weight-streaming GEMMs
for a block of at most 16 rows, a batch-1 proposal, with ``BLOCKDRAFT_SKINNY_GEMM`` on, as the
target runtime's; ``F.linear`` otherwise).

The fused steps are the ``add_rms_norm``, ``qk_norm_rope`` and ``silu_mul`` ops of the
:class:`~blockdraft.kernels.KernelOps` it is given (Triton kernels, or their torch references:
fp32 math, one rounding), so in fp32 the result equals ``DFlashDrafter.forward_block`` up to
GEMM summation order. The stacked weights are copies: about ``L x (Hq+2Hkv)*D x H + L x 2I x H``
extra elements (1.25 GB at qwen3-8b drafter shapes in bf16).

DFlash2 drafters add, per sub-block (attention, MLP), the ``kernel_projection`` GEMM of the
sub-block's input and two launches of the ``dynamic_conv`` op (the grouped dynamic causal
convolution of the input and of the output, over whole blocks of B rows). :meth:`from_drafter`
returns ``None`` for a drafter that is not a :class:`DFlashDrafter`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from blockdraft.kernels import KernelOps
from blockdraft.kernels.projections import Projections
from blockdraft.models import AttendFn, DFlashDrafter, GroupedDynamicConv

_Conv = tuple[Tensor, Tensor]


def _conv_weights(conv: GroupedDynamicConv | None) -> _Conv | None:
    return (conv.kernel_projection.weight, conv.base_kernel) if conv is not None else None


class FastDrafter:
    """Stacked-weight, fused-elementwise forward of a DFlash drafter's block rows.

    Attributes:
        qkv_weight: per layer ``[(Hq+2Hkv)*D, H]`` (q rows, then k, then v).
        qkv_bias: per layer ``[(Hq+2Hkv)*D]`` or ``None``.
        gate_up_weight: per layer ``[2I, H]`` (gate rows, then up).
    """

    def __init__(self, drafter: DFlashDrafter, ops: KernelOps, proj: Projections | None = None) -> None:
        c = drafter.config
        self.drafter = drafter
        self.config = c
        self.ops = ops
        self.proj = proj if proj is not None else Projections(ops, False)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_weight: list[Tensor] = []
        self.qkv_bias: list[Tensor | None] = []
        self.o_proj: list[tuple[Tensor, Tensor | None]] = []
        self.gate_up_weight: list[Tensor] = []
        self.down_weight: list[Tensor] = []
        self.q_norm: list[Tensor] = []
        self.k_norm: list[Tensor] = []
        self.in_norm: list[Tensor] = []
        self.post_norm: list[Tensor] = []
        # DFlash2, per layer: (kernel_projection weight [2*K*G, H], base_kernel [2, K, H]) of
        # the attention and the MLP convolution, or None (DFlash).
        self.convs: list[tuple[_Conv | None, _Conv | None]] = []
        self.conv_group = c.conv_group_size or 1
        with torch.no_grad():
            for i in range(c.num_layers):
                layer = drafter.layer(i)
                a = layer.self_attn
                self.qkv_weight.append(
                    torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), 0).contiguous()
                )
                biases = (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
                self.qkv_bias.append(
                    torch.cat([b for b in biases if b is not None], 0)
                    if all(b is not None for b in biases)
                    else None
                )
                self.o_proj.append((a.o_proj.weight, a.o_proj.bias))
                mlp = layer.mlp
                self.gate_up_weight.append(
                    torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight), 0).contiguous()
                )
                self.down_weight.append(mlp.down_proj.weight)
                self.q_norm.append(a.q_norm.weight)
                self.k_norm.append(a.k_norm.weight)
                self.in_norm.append(layer.input_layernorm.weight)
                self.post_norm.append(layer.post_attention_layernorm.weight)
                self.convs.append((_conv_weights(layer.attention_conv), _conv_weights(layer.mlp_conv)))
        self.final_norm = drafter.norm.weight
        self.eps = float(c.rms_norm_eps)
        self.inv_freq = drafter.rope.inv_freq.to(drafter.device, torch.float32)
        self.rope_scale = float(drafter.rope.attention_scaling)

    @classmethod
    def from_drafter(cls, drafter: object, ops: KernelOps, proj: Projections | None = None) -> FastDrafter | None:
        """The fused view, or ``None`` for a drafter that is not a :class:`DFlashDrafter`."""
        if not isinstance(drafter, DFlashDrafter):
            return None
        return cls(drafter, ops, proj)

    def conv_in(self, conv: _Conv, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """DFlash2: a sub-block's input ``x [M, H]`` (blocks of ``block`` rows) -> its
        convolution, and the dynamic taps ``[M, 2, K, G]`` for :meth:`conv_out`."""
        weight, base = conv
        taps = F.linear(x, weight).view(x.shape[0], 2, base.shape[1], -1)
        return self.ops.dynamic_conv(x, taps[:, 0], base[0], block, self.conv_group), taps

    def conv_out(self, conv: _Conv, y: Tensor, taps: Tensor, block: int) -> Tensor:
        """DFlash2: a sub-block's output ``y [M, H]`` -> its convolution (taps of
        :meth:`conv_in`)."""
        return self.ops.dynamic_conv(y, taps[:, 1], conv[1][1], block, self.conv_group)

    def add_rms_norm(self, h: Tensor, y: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        """``(h + y, rms_norm(h + y) * weight)`` over [M, H] (``y=None``: no add)."""
        return self.ops.add_rms_norm(h, y, weight, self.eps)

    def qk_norm_rope(self, qkv: Tensor, positions: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """``qkv [M, (Hq+2Hkv)*D]``, ``positions [M]`` -> q [M,Hq,D], k, v [M,Hkv,D]."""
        return self.ops.qk_norm_rope(
            qkv, positions, self.q_norm[layer], self.k_norm[layer], self.inv_freq,
            self.rope_scale, self.eps, self.num_heads, self.num_kv_heads,
        )

    def fuse_context(self, ctx_rows: Tensor) -> Tensor:
        """``hidden_norm(fc(ctx_rows))``: [R, k*H] -> [R, H] (the reference's math)."""
        d = self.drafter
        fused = F.linear(ctx_rows.to(d.fc.weight.dtype), d.fc.weight)
        return self.add_rms_norm(fused, None, d.hidden_norm.weight)[1]

    def forward_block(self, embeds: Tensor, positions: Tensor, attend: AttendFn) -> Tensor:
        """Same contract as :meth:`DFlashDrafter.forward_block`: embeds [n, B, H] raw target
        embeddings, positions [n, B] int64 -> [n, B, H] rows after the final norm."""
        c = self.config
        n, b, size = embeds.shape
        m = n * b
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = embeds.to(self.drafter.dtype).reshape(m, size)
        if c.input_embedding_scale != 1.0:  # x * 1.0 == x: skip a pass over the rows
            h = h * c.input_embedding_scale
        flat_pos = positions.reshape(m)
        h, x = self.add_rms_norm(h, None, self.in_norm[0])
        for i in range(c.num_layers):
            attn_conv, mlp_conv = self.convs[i]
            if attn_conv is not None:
                x, taps = self.conv_in(attn_conv, x, b)
            qkv = self.proj.linear(x, self.qkv_weight[i], self.qkv_bias[i])
            q, k, v = self.qk_norm_rope(qkv, flat_pos, i)
            o = attend(i, q.view(n, b, hq, d), k.view(n, b, hkv, d), v.view(n, b, hkv, d))
            w_o, b_o = self.o_proj[i]
            y = self.proj.linear(o.reshape(m, hq * d), w_o, b_o)
            if attn_conv is not None:
                y = self.conv_out(attn_conv, y, taps, b)
            h, x = self.add_rms_norm(h, y, self.post_norm[i])
            if mlp_conv is not None:
                x, taps = self.conv_in(mlp_conv, x, b)
            y = self.proj.linear(self.proj.silu_mul(x, self.gate_up_weight[i]), self.down_weight[i])
            if mlp_conv is not None:
                y = self.conv_out(mlp_conv, y, taps, b)
            nxt = self.in_norm[i + 1] if i + 1 < c.num_layers else self.final_norm
            h, x = self.add_rms_norm(h, y, nxt)
        return x.view(n, b, size)


__all__ = ["FastDrafter"]
