"""One forward of the target over the new rows of many sequences, on paged K/V.

Per layer: RMSNorm (fused with the previous residual add) -> one q/k/v GEMM -> per-head q/k norm
(Qwen3) + RoPE, K and V written into the sequences' pages (one launch) -> causal attention of
the new rows over their sequences' pages (one launch for every sequence) -> o projection ->
residual add + RMSNorm -> one gate/up GEMM -> SwiGLU -> down projection. The rows of the layers
the drafter reads are copied into its ``[rows, k*H]`` buffer as the forward passes them, and the
head runs only on the rows whose logits are wanted.

Under tensor parallelism each rank runs the same forward on its heads and its part of the
MLP: q/k/v and gate/up are column-parallel (the rank's output rows), o and down row-parallel
(the rank's input columns), each followed by one all-reduce of its partial sums, after which
the hidden rows are whole (and the same bits) on every rank: the captured rows, the norms and
the head need no further communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from blockdraft.kernels import KernelOps
from blockdraft.kernels.projections import Projections
from blockdraft.kv_cache import PagedKVCache
from blockdraft.levers import read_skinny_gemm
from blockdraft.parallel.group import TPGroup
from blockdraft.target.runtime.spec import TargetSpec
from blockdraft.target.runtime.weights import fuse_linears


@dataclass
class ForwardBatch:
    """The device inputs of one forward over ``R`` new rows of ``n`` sequences.

    Attributes:
        input_ids / positions / slots: ``[R]`` int64, sequence by sequence.
        page_tables: ``[n, W]`` int32; q_starts ``[n + 1]`` int32; kv_lens ``[n]`` int32 (see
            ``reference.causal_attention``).
        max_rows: the most new rows of any sequence.
        logit_rows: ``[m]`` int64 rows whose logits are computed (``None``: every row).
    """

    input_ids: Tensor
    positions: Tensor
    slots: Tensor
    page_tables: Tensor
    q_starts: Tensor
    kv_lens: Tensor
    max_rows: int
    logit_rows: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class _Layer:
    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    input_norm: Tensor
    post_norm: Tensor
    window: int | None


class TargetForward:
    """The forward of one target over its paged cache.

    Building it fuses each layer's q/k/v and gate/up weights into single tensors that become
    the model's own storage (:func:`~blockdraft.target.runtime.weights.fuse_linears`): nothing is held
    twice.

    Args:
        spec: the target (:meth:`TargetSpec.from_model`).
        cache: its paged K/V.
        ops: the kernels of the runtime's backend.
        capture_layers: target layer ids whose outputs the drafter reads (output of layer
            ``i``, the last layer's after the final norm, as Hugging Face's
            ``hidden_states[i + 1]``), in the order of a ctx row.
        tp: the tensor-parallel group ``spec`` is this rank's part of (default: one rank).

    Raises:
        ConfigError: a ``BLOCKDRAFT_SKINNY_GEMM`` value that is not a boolean word.
    """

    def __init__(
        self, spec: TargetSpec, cache: PagedKVCache, ops: KernelOps,
        capture_layers: Sequence[int] = (), tp: TPGroup | None = None,
    ) -> None:
        self.spec = spec
        self.cache = cache
        self.ops = ops
        self.proj = Projections(ops, read_skinny_gemm())
        self.tp = tp if tp is not None else TPGroup.single(spec.device)
        if self.tp.size != spec.tp_size:
            raise ValueError(f"a spec of {spec.tp_size} ranks in a group of {self.tp.size}")
        for i in capture_layers:
            if not 0 <= i < spec.num_layers:
                raise ValueError(f"capture layer {i} is outside the target's {spec.num_layers} layers")
        self.capture_layers = tuple(int(i) for i in capture_layers)
        self._capture_slot = {layer: k for k, layer in enumerate(self.capture_layers)}
        layers = []
        for ls in spec.layers:
            qkv, qkv_b = fuse_linears([ls.q_proj, ls.k_proj, ls.v_proj])
            gate_up, gate_up_b = fuse_linears([ls.gate_proj, ls.up_proj])
            layers.append(_Layer(
                qkv=qkv, qkv_bias=qkv_b, o=ls.o_proj.weight, o_bias=ls.o_proj.bias,
                gate_up=gate_up, gate_up_bias=gate_up_b, down=ls.down_proj.weight,
                down_bias=ls.down_proj.bias, q_norm=ls.q_norm, k_norm=ls.k_norm,
                input_norm=ls.input_norm, post_norm=ls.post_norm, window=ls.sliding_window,
            ))
        self._layers = tuple(layers)

    @property
    def ctx_row_width(self) -> int:
        """``k * H``: values per captured row."""
        return len(self.capture_layers) * self.spec.hidden_size

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, capture: Tensor | None = None) -> Tensor:
        """Write the new rows' K/V into their pages and return the logits ``[m, V]`` of
        ``batch.logit_rows`` (every row when ``None``) in the target's dtype. ``capture`` ``[R,
        k*H]`` (any floating dtype) receives the captured layers' rows."""
        spec, ops, cache = self.spec, self.ops, self.cache
        rows = batch.num_rows
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        size = spec.hidden_size
        if capture is not None and tuple(capture.shape) != (rows, self.ctx_row_width):
            raise ValueError(
                f"capture must be [{rows}, {self.ctx_row_width}], not {list(capture.shape)}"
            )
        h = F.embedding(batch.input_ids, spec.embed.weight)
        h, x = ops.add_rms_norm(h, None, self._layers[0].input_norm, spec.eps)
        last = spec.num_layers - 1
        for i, layer in enumerate(self._layers):
            qkv = self.proj.linear(x, layer.qkv, layer.qkv_bias)
            q = ops.qk_norm_rope_store(
                qkv, batch.positions, batch.slots, layer.q_norm, layer.k_norm, spec.inv_freq,
                spec.rope_scale, spec.eps, hq, hkv, cache.k_layers[i], cache.v_layers[i],
            )
            o = ops.causal_attention(
                q, cache.k_layers[i], cache.v_layers[i], batch.page_tables, batch.q_starts,
                batch.kv_lens, batch.positions, scale=spec.scale, sliding_window=layer.window,
                max_rows=batch.max_rows,
            )
            y = self._row_parallel(o.view(rows, hq * d), layer.o, layer.o_bias)
            h, x = ops.add_rms_norm(h, y, layer.post_norm, spec.eps)
            y = self._row_parallel(self.proj.silu_mul(x, layer.gate_up, layer.gate_up_bias),
                                   layer.down, layer.down_bias)
            nxt = self._layers[i + 1].input_norm if i < last else spec.final_norm
            h, x = ops.add_rms_norm(h, y, nxt, spec.eps)
            slot = self._capture_slot.get(i)
            if slot is not None and capture is not None:
                capture[:, slot * size : (slot + 1) * size] = x if i == last else h
        head_rows = x if batch.logit_rows is None else x.index_select(0, batch.logit_rows)
        return self.proj.linear(head_rows, spec.lm_head.weight)

    def _row_parallel(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``x @ weight.T + bias`` for a row-parallel projection: each rank's product is a
        partial sum over its input columns; the bias is added once, after the sum."""
        if self.tp.size == 1:
            return self.proj.linear(x, weight, bias)
        y = self.tp.all_reduce_(self.proj.linear(x, weight))
        return y if bias is None else y.add_(bias)


__all__ = ["ForwardBatch", "TargetForward"]
