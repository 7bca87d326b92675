"""Building blocks of the drafter: RMSNorm, SwiGLU MLP, the DFlash2 convolution and selector.

Parameter names equal the checkpoint's tensor names, so a module's ``state_dict`` is the
checkpoint (the DFlash2 codebooks are plain parameters, stored without ``.weight``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockdraft.sampling import sample_rows

Device = torch.device | str | None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)`` over the last dim; statistics in fp32, result in ``x``'s dtype."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)



def embed_blocks(
    anchors: Tensor,
    starts: Tensor,
    embed: Tensor,
    mask_id: int,
    block: int,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Anchors and their positions ``[n]`` -> the blocks ``[anchor, mask_id x (B-1)]`` embedded
    with ``embed [V, H]`` as ``[n, B, H]`` ``dtype``, and their positions ``[n, B]`` int64."""
    n = anchors.shape[0]
    ids = torch.full((n, block), mask_id, dtype=torch.int64, device=anchors.device)
    ids[:, 0] = anchors
    q_pos = starts[:, None] + torch.arange(block, dtype=torch.int64, device=anchors.device)[None, :]
    return F.embedding(ids, embed).to(dtype), q_pos

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inner: int, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


def grouped_dynamic_conv(
    hidden: Tensor, dynamic: Tensor, base: Tensor, group_size: int, segment: int | None = None
) -> Tensor:
    """Causal convolution along the block with a static per-channel and a dynamic per-group tap.

    ``out[t] = sum_o (base[o] + dynamic[t, o]) * hidden[t - o]``, with ``hidden[t - o] = 0``
    before the block start.

    Args:
        hidden: [n, T, H].
        dynamic: [n, T, K, G] per-group taps (G = H / group_size), computed from the row ``t``.
        base: [K, H] static taps.
        segment: when given, the T rows are T / segment blocks of ``segment`` rows each, one
            after the other (training runs many blocks in one row dimension); taps never cross
            from one block into the next. ``None``: the T rows are one block.
    Returns:
        [n, T, H] in ``hidden``'s dtype.
    """
    if segment is not None and segment != hidden.shape[1]:
        n, length, size = hidden.shape
        if segment < 1 or length % segment:
            raise ValueError(f"{length} rows do not split into blocks of {segment}")
        blocks_per_row = length // segment
        flat = grouped_dynamic_conv(
            hidden.reshape(n * blocks_per_row, segment, size),
            dynamic.reshape(n * blocks_per_row, segment, *dynamic.shape[2:]),
            base,
            group_size,
        )
        return flat.reshape(n, length, size)
    n, length, size = hidden.shape
    groups = size // group_size
    taps = base.shape[0]
    blocks = hidden.reshape(n, length, groups, group_size)
    dyn = dynamic.reshape(n, length, taps, groups, 1)
    out = torch.zeros_like(blocks)
    for offset in range(taps):
        if offset == 0:
            shifted = blocks
        elif offset >= length:
            continue
        else:
            shifted = torch.cat((torch.zeros_like(blocks[:, :offset]), blocks[:, :-offset]), dim=1)
        out = out + base[offset].reshape(1, 1, groups, group_size).to(hidden.dtype) * shifted
        out = out + dyn[:, :, offset] * shifted
    return out.reshape(n, length, size)


class GroupedDynamicConv(nn.Module):
    """DFlash2's convolution pair around one sub-block (attention or MLP).

    ``base_kernel`` [2, K, H]: static taps before (0) and after (1) the sub-block;
    ``kernel_projection`` H -> 2*K*G: dynamic taps, both predicted from the sub-block's input.
    """

    def __init__(
        self, hidden: int, kernel_size: int, group_size: int, *, device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden, device=device, dtype=dtype))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * groups, bias=False, device=device, dtype=dtype)

    def prepare(self, x: Tensor, segment: int | None = None) -> tuple[Tensor, Tensor]:
        """Convolve the sub-block input ``x`` [n, T, H]; return it and the taps for :meth:`finish`.

        ``segment``: see :func:`grouped_dynamic_conv`.
        """
        groups = x.shape[-1] // self.group_size
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, groups)
        before = grouped_dynamic_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, segment)
        return before, dynamic[..., 1, :, :]

    def finish(self, y: Tensor, dynamic: Tensor, segment: int | None = None) -> Tensor:
        """Convolve the sub-block output ``y`` [n, T, H] with the taps from :meth:`prepare`."""
        return grouped_dynamic_conv(y, dynamic, self.base_kernel[1], self.group_size, segment)


class CandidateSelector(nn.Module):
    """DFlash2's left-to-right rescoring of the top-K lm_head candidates of each block row.

    ``score(c) = logit(c) + sum_r Pred[prev, r] * h_r * Succ[c, r]`` with ``h =
    hidden_projection(row)`` and ``prev`` the token chosen for the previous row (the anchor for
    the first).
    """

    def __init__(
        self, hidden: int, vocab: int, rank: int, top_k: int, *, device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False, device=device, dtype=dtype)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank, device=device, dtype=dtype))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank, device=device, dtype=dtype))

    def pair_scores(self, projected: Tensor, prev: Tensor, candidates: Tensor) -> Tensor:
        """The pairwise part of each candidate's score, ``sum_r Pred[prev, r] * h_r * Succ[c, r]``.

        Args:
            projected: [..., R] ``hidden_projection`` of the rows.
            prev: [...] the token before each row.
            candidates: [..., K] the rows' candidates.
        Returns:
            [..., K] in the codebooks' dtype.
        """
        pred = F.embedding(prev, self.predecessor_codebook) * projected
        succ = F.embedding(candidates, self.successor_codebook)
        return torch.einsum("...r,...kr->...k", pred.to(succ.dtype), succ)

    def select(
        self,
        hidden: Tensor,
        logits: Tensor,
        anchor: Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Walk the block rows choosing one candidate each.

        Args:
            hidden: [n, T, H] drafter output rows 1..B-1.
            logits: [n, T, V] their logits (after the output transforms).
            anchor: [n] token before the first row.
            temperature: 0 picks the best score; > 0 samples from ``softmax(score / temperature)``.
        Returns:
            ``(tokens [n, T], candidates [n, T, K], q [n, T, K] fp32 or None when greedy)``;
            ``q[i, t]`` is the distribution the token of row ``t`` was drawn from, over
            ``candidates[i, t]``.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        prev = anchor
        tokens: list[Tensor] = []
        q_rows: list[Tensor] = []
        for t in range(hidden.shape[1]):
            scores = unary[:, t] + self.pair_scores(projected[:, t], prev, candidates[:, t])
            if temperature > 0:
                q = torch.softmax(scores.to(torch.float32) / temperature, dim=-1)
                index = sample_rows(q, generator)
                q_rows.append(q)
            else:
                index = torch.argmax(scores, dim=-1)
            prev = candidates[:, t].gather(-1, index[:, None])[:, 0]
            tokens.append(prev)
        q_all = torch.stack(q_rows, dim=1) if q_rows else None
        return torch.stack(tokens, dim=1), candidates, q_all
