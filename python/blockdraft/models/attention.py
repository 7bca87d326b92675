"""Reference attention of the drafter's block rows over context K/V plus the block's own K/V.

Plain torch, fp32 math, masks by absolute position; the ground truth that the paged Triton
attention is checked against. Rules (docs/design/dflash.md, "The drafter"):

* full-attention layers: every block row sees every ctx row and every block row
  (bidirectional in the block), unless the config forces ``is_causal: true``;
* sliding-window layers: causal in the block unless ``is_causal: false``, and a key is visible
  only when ``q_pos - k_pos < window`` (and ``k_pos - q_pos < window`` when not causal).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from blockdraft.config import DrafterConfig


def visibility_mask(
    q_pos: Tensor, k_pos: Tensor, *, causal: bool, sliding_window: int | None
) -> Tensor:
    """[n, B, S] bool: which keys at ``k_pos`` [n, S] each query at ``q_pos`` [n, B] may see."""
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    visible = torch.ones(qp.shape[0], qp.shape[1], kp.shape[2], dtype=torch.bool, device=q_pos.device)
    if causal:
        visible &= kp <= qp
    if sliding_window is not None:
        visible &= (qp - kp) < sliding_window
        if not causal:
            visible &= (kp - qp) < sliding_window
    return visible


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    scale: float,
    causal: bool = False,
    sliding_window: int | None = None,
    key_valid: Tensor | None = None,
) -> Tensor:
    """Softmax attention with GQA, in fp32.

    Args:
        q: [n, B, Hq, D] queries of the block rows.
        k, v: [n, S, Hkv, D] all keys/values a row may see (ctx rows, then block rows).
        q_pos: [n, B] positions of the queries; k_pos: [n, S] positions of the keys.
        key_valid: [n, S] bool, False for padding keys of ragged batches.
    Returns:
        [n, B, Hq, D] in ``q``'s dtype.
    """
    n, b, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    qf = q.to(torch.float32).reshape(n, b, hkv, group, d)
    kf = k.to(torch.float32)
    vf = v.to(torch.float32)
    scores = torch.einsum("nbhgd,nshd->nhgbs", qf, kf) * scale
    visible = visibility_mask(q_pos, k_pos, causal=causal, sliding_window=sliding_window)
    if key_valid is not None:
        visible = visible & key_valid[:, None, :]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhgbs,nshd->nbhgd", probs, vf)
    return out.reshape(n, b, hq, d).to(q.dtype)


class ReferenceAttend:
    """The ``attend`` callable of :meth:`DFlashDrafter.forward_block` over gathered context K/V.

    Args:
        config: the drafter's config (per-layer causality and window).
        ctx_kv: per sequence, per layer ``(K [R_i, Hkv, D], V [R_i, Hkv, D])`` (normed and
            roped, as :meth:`DFlashDrafter.context_kv` returns them).
        ctx_positions: per sequence [R_i] int64 positions of its ctx rows.
        block_positions: [n, B] int64 positions of the block rows.
    """

    def __init__(
        self,
        config: DrafterConfig,
        ctx_kv: Sequence[Sequence[tuple[Tensor, Tensor]]],
        ctx_positions: Sequence[Tensor],
        block_positions: Tensor,
    ) -> None:
        if len(ctx_kv) != len(ctx_positions) or len(ctx_kv) != block_positions.shape[0]:
            raise ValueError("ctx_kv, ctx_positions and block_positions disagree on the batch size")
        self.config = config
        self.block_positions = block_positions
        self.scale = config.head_dim**-0.5
        n = len(ctx_kv)
        rows = max((int(p.shape[0]) for p in ctx_positions), default=0)
        device = block_positions.device
        self.ctx_pos = torch.zeros(n, rows, dtype=torch.int64, device=device)
        self.ctx_valid = torch.zeros(n, rows, dtype=torch.bool, device=device)
        self.ctx_k: list[Tensor] = []
        self.ctx_v: list[Tensor] = []
        for i, pos in enumerate(ctx_positions):
            self.ctx_pos[i, : pos.shape[0]] = pos
            self.ctx_valid[i, : pos.shape[0]] = True
        for layer in range(config.num_layers):
            k_pad = v_pad = None
            for i, seq in enumerate(ctx_kv):
                k_i, v_i = seq[layer]
                if k_pad is None or v_pad is None:
                    shape = (n, rows, *k_i.shape[1:])
                    k_pad = torch.zeros(shape, dtype=k_i.dtype, device=device)
                    v_pad = torch.zeros(shape, dtype=v_i.dtype, device=device)
                k_pad[i, : k_i.shape[0]] = k_i
                v_pad[i, : v_i.shape[0]] = v_i
            if k_pad is None or v_pad is None:
                raise ValueError("ReferenceAttend needs at least one sequence")
            self.ctx_k.append(k_pad)
            self.ctx_v.append(v_pad)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``q`` [n, B, Hq, D], block ``k``/``v`` [n, B, Hkv, D] -> [n, B, Hq, D]."""
        n, b = q.shape[:2]
        keys = torch.cat((self.ctx_k[layer].to(k.dtype), k), dim=1)
        values = torch.cat((self.ctx_v[layer].to(v.dtype), v), dim=1)
        block_valid = torch.ones(n, b, dtype=torch.bool, device=q.device)
        return attention_reference(
            q,
            keys,
            values,
            self.block_positions,
            torch.cat((self.ctx_pos, self.block_positions), dim=1),
            scale=self.scale,
            causal=self.config.layer_is_causal(layer),
            sliding_window=self.config.layer_sliding_window(layer),
            key_valid=torch.cat((self.ctx_valid, block_valid), dim=1),
        )
