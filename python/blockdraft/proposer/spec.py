"""What a proposer reads from its drafter once, checked: shapes, attention kinds, ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockdraft._core import ConfigError
from blockdraft.config import DrafterConfig


@dataclass(frozen=True)
class DraftSpec:
    """The drafter's shapes and attention kinds (from its :class:`~blockdraft.DrafterConfig`).

    Attributes:
        block_size: B (anchor + B-1 drafts).
        layer_window: per layer the sliding window in tokens, ``None`` for full attention.
        layer_causal: per layer whether block rows see only earlier block rows.
        ctx_row_width: ``k * H`` values per ctx row.
        scale: the attention softmax scale.
        max_positions: the drafter's ``max_position_embeddings``: every row a proposal runs
            (its block's included) must sit at a position below it.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    eps: float
    scale: float
    layer_window: tuple[int | None, ...]
    layer_causal: tuple[bool, ...]
    is_dflash2: bool
    max_positions: int

    @property
    def ctx_row_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_drafter(cls, drafter: Any) -> DraftSpec:
        """Raises ``ConfigError`` for a drafter a proposer cannot drive (no config, no mask
        token, a block of fewer than 2 rows)."""
        cfg = getattr(drafter, "config", None)
        if not isinstance(cfg, DrafterConfig):
            raise ConfigError(
                f"the drafter ({type(drafter).__name__}) has no DrafterConfig: load it with "
                "blockdraft.load_drafter"
            )
        if cfg.mask_token_id is None:
            raise ConfigError("the drafter config has no mask_token_id")
        if cfg.block_size < 2:
            raise ConfigError(f"the drafter's block_size must be >= 2, not {cfg.block_size}")
        layers = range(cfg.num_layers)
        return cls(
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=cfg.block_size,
            target_layer_ids=tuple(cfg.target_layer_ids),
            mask_token_id=int(cfg.mask_token_id),
            eps=float(cfg.rms_norm_eps),
            scale=float(cfg.head_dim**-0.5),
            layer_window=tuple(cfg.layer_sliding_window(i) for i in layers),
            layer_causal=tuple(bool(cfg.layer_is_causal(i)) for i in layers),
            is_dflash2=cfg.is_dflash2,
            max_positions=int(cfg.max_position_embeddings),
        )


__all__ = ["DraftSpec"]
