"""A target split over tensor-parallel ranks: which weights a rank keeps, and its shapes.

Rank ``r`` of ``n`` keeps the ``r``-th ``1/n`` of the attention heads and K/V heads (its rows
of q/k/v, fused into one tensor as without TP, and the matching input columns of o) and of the
MLP's intermediate size (its rows of gate/up, fused, and its input columns of down). The
embedding table, the norms and ``lm_head`` stay whole on every rank. A query head's K/V head
stays on its rank: with ``g = Hq / Hkv`` query heads per K/V head, the rank's query heads
``r*Hq/n + i`` read K/V head ``r*Hkv/n + i // g``, its own local head ``i // g``.

The model is marked with the shard it holds: its own Hugging Face forward no longer works
(its projections are shards), attaching again with the same rank and size reuses the shard,
and any other attachment is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from blockdraft._core import ConfigError
from blockdraft.parallel.group import TPGroup
from blockdraft.parallel.split import check_split
from blockdraft.target.runtime.spec import TargetSpec
from blockdraft.target.runtime.weights import shard_cols, shard_rows

SHARD_ATTR = "_blockdraft_tp_shard"
"""The attribute on a sharded model: ``(rank, size)`` of the shard it holds."""


def model_shard(model: Any) -> tuple[int, int]:
    """``(rank, size)`` of the tensor-parallel shard ``model`` holds (``(0, 1)``: whole)."""
    got = getattr(model, SHARD_ATTR, (0, 1))
    return int(got[0]), int(got[1])


def split_sizes(spec: TargetSpec) -> dict[str, int]:
    """The counts a tensor-parallel size must divide, by their config names."""
    return {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
            "intermediate_size": spec.intermediate_size}


def shard_target(spec: TargetSpec, group: TPGroup) -> TargetSpec:
    """Keep only ``group.rank``'s part of ``spec``'s projections (in the model itself) and
    return the rank's spec. A group of one leaves a whole model as it is.

    Raises:
        ConfigError: a size the group does not divide (every such count named), a model
            already holding another shard, or a model on another device than the rank's.
    """
    rank, size = group.rank, group.size
    held = model_shard(spec.model)
    if held == (0, 1) and size == 1:
        return spec
    if held not in ((0, 1), (rank, size)):
        raise ConfigError(
            f"the model holds the weights of tensor-parallel rank {held[0]} of {held[1]}; "
            f"it cannot serve rank {rank} of {size} (load it again)"
        )
    if held == (0, 1):
        check_split(spec.architecture, split_sizes(spec), size)
        if spec.device.type == "cuda" and spec.device != group.device:
            raise ConfigError(
                f"tensor-parallel rank {rank} computes on {group.device} but the model is on "
                f"{spec.device}"
            )
        for ls in spec.layers:
            shard_rows([ls.q_proj, ls.k_proj, ls.v_proj], rank, size)
            shard_rows([ls.gate_proj, ls.up_proj], rank, size)
            shard_cols(ls.o_proj, rank, size)
            shard_cols(ls.down_proj, rank, size)
        setattr(spec.model, SHARD_ATTR, (rank, size))
    return dataclasses.replace(
        spec, num_heads=spec.num_heads // size, num_kv_heads=spec.num_kv_heads // size,
        intermediate_size=spec.intermediate_size // size, tp_rank=rank, tp_size=size,
    )


__all__ = ["SHARD_ATTR", "model_shard", "shard_target", "split_sizes"]
