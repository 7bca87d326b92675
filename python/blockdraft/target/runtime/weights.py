"""Fused projection weights that are the model's own storage.

A decoder layer runs faster with ``q/k/v`` as one GEMM and ``gate/up`` as one. A fused copy
would hold those weights twice (9 GB at Qwen3-8B shapes), so :func:`fuse_linears` makes the
fused tensor the storage instead: the Hugging Face modules' ``weight`` (and ``bias``) become
views into it, the originals are released, and the model's own forward keeps working on the
same numbers. Applying it again to modules already fused this way returns the same tensor.

The views tie the modules to the fused storage: moving or casting the model afterwards
(``model.to(...)``) gives the modules new tensors and leaves the fused ones behind, so attach
the runtime after the model is where it will run.

Under tensor parallelism (:func:`shard_rows`, :func:`shard_cols`) a rank keeps only its part of
each projection: its rows of q/k/v and gate/up, fused the same way, and its input columns of
o and down; the full weights are released.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from blockdraft.parallel.split import part


def _is_fused(tensors: Sequence[Tensor]) -> Tensor | None:
    """The tensor whose consecutive row blocks ``tensors`` are (one storage, back to back,
    each contiguous), viewed as one; ``None`` if they are not laid out that way."""
    first = tensors[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    rows = 0
    for t in tensors:
        if (t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous()
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:]
                or t.dtype != first.dtype):
            return None
        offset += t.numel()
        rows += t.shape[0]
    shape = (rows, *first.shape[1:])
    return first.detach().new_empty(0).set_(storage, first.storage_offset(), shape,
                                           torch.empty(shape, device="meta").stride())


def _fuse(params: Sequence[Tensor]) -> Tensor:
    """One tensor holding ``params`` one after the other along dim 0 (their storage from now on
    is its row blocks; see the module docstring)."""
    found = _is_fused(params)
    if found is not None:
        return found
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in params], dim=0)
    return fused


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """``(weight [sum out_i, in], bias [sum out_i] or None)`` of ``linears`` stacked along
    their outputs, with every module's ``weight`` / ``bias`` re-pointed at its rows of them.

    Raises:
        ValueError: the modules disagree on input size, dtype, device, or on having a bias.
    """
    if not linears:
        raise ValueError("no linear layers to fuse")
    first = linears[0]
    has_bias = first.bias is not None
    for m in linears:
        if m.in_features != first.in_features:
            raise ValueError("fused linear layers must share their input size")
        if m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device:
            raise ValueError("fused linear layers must share dtype and device")
        if (m.bias is not None) != has_bias:
            raise ValueError("fused linear layers must all have a bias or none")
    weight = _fuse([m.weight for m in linears])
    bias = _fuse([m.bias for m in linears if m.bias is not None]) if has_bias else None
    row = 0
    for m in linears:
        rows = m.out_features
        if m.weight.data_ptr() != weight[row].data_ptr():
            m.weight = nn.Parameter(weight[row : row + rows], requires_grad=m.weight.requires_grad)
        if bias is not None and m.bias is not None and m.bias.data_ptr() != bias[row].data_ptr():
            m.bias = nn.Parameter(bias[row : row + rows], requires_grad=m.bias.requires_grad)
        row += rows
    return weight, bias


def shard_rows(linears: Sequence[nn.Linear], rank: int, size: int) -> None:
    """Keep rank ``rank``'s ``1/size`` of each module's output rows (and bias), laid out as one
    fused tensor that :func:`fuse_linears` then finds as it is: the modules' ``weight`` /
    ``bias`` become views of it and ``out_features`` their shard's rows; the full weights are
    released. ``size`` must divide every ``out_features``."""
    with torch.no_grad():
        parts = [part(m.out_features, rank, size) for m in linears]
        weight = torch.cat([m.weight.detach()[s] for m, s in zip(linears, parts)], dim=0)
        biases = [m.bias for m in linears]
        if len({b is None for b in biases}) > 1:
            raise ValueError("fused linear layers must all have a bias or none")
        bias = None
        if biases[0] is not None:
            bias = torch.cat([b.detach()[s] for b, s in zip(biases, parts) if b is not None], dim=0)
    row = 0
    for m, s in zip(linears, parts):
        rows = s.stop - s.start
        m.weight = nn.Parameter(weight[row : row + rows], requires_grad=m.weight.requires_grad)
        if bias is not None and m.bias is not None:
            m.bias = nn.Parameter(bias[row : row + rows], requires_grad=m.bias.requires_grad)
        m.out_features = rows
        row += rows


def shard_cols(linear: nn.Linear, rank: int, size: int) -> None:
    """Keep rank ``rank``'s ``1/size`` of ``linear``'s input columns (a row-parallel
    projection: each rank's product is a partial sum); the bias stays whole, added once after
    the sum. The full weight is released."""
    cols = part(linear.in_features, rank, size)
    with torch.no_grad():
        shard = linear.weight.detach()[:, cols].contiguous()
    linear.weight = nn.Parameter(shard, requires_grad=linear.weight.requires_grad)
    linear.in_features = cols.stop - cols.start


__all__ = ["fuse_linears", "shard_cols", "shard_rows"]
