"""What a proposer reads from its drafter and target once, checked: shapes, ids, the target's
embedding table and output head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from blockdraft._core import ConfigError
from blockdraft.config import DrafterConfig
from blockdraft.pair.checks import check_fits


@dataclass(frozen=True)
class DraftSpec:
    """The drafter's shapes and attention kinds (from its :class:`~blockdraft.DrafterConfig`).

    Attributes:
        block_size: B (anchor + B-1 drafts).
        layer_window: per layer the sliding window in tokens, ``None`` for full attention.
        layer_causal: per layer whether block rows see only earlier block rows.
        ctx_row_width: ``k * H`` values per ctx row.
        scale: the attention softmax scale.
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
        )


@dataclass(frozen=True)
class TargetHead:
    """The target pieces the drafter uses: the input embedding table ``[V_in, H]`` and the
    output head (a module or its weight ``[V, H]``).

    Attributes:
        vocab_size: V, the head's output size (draft ids and bitmasks cover it).
        vocab_in: the ids the embedding table takes (anchors must be below it).
        num_layers / hidden_size: from the target's config when it has one.
    """

    embed: Tensor
    lm_head: Any
    vocab_size: int
    vocab_in: int
    num_layers: int | None
    hidden_size: int | None
    max_positions: int | None

    @classmethod
    def from_target(cls, target: Any) -> TargetHead:
        """From a Hugging Face causal LM, a :class:`~blockdraft.TargetAdapter`, or anything with
        ``embed_weight`` / ``get_input_embeddings()`` and ``lm_head`` /
        ``get_output_embeddings()``. Raises ``ConfigError`` when a piece is missing."""
        embed: Any = getattr(target, "embed_weight", None)
        if embed is None:
            get_in = getattr(target, "get_input_embeddings", None)
            if get_in is None:
                raise ConfigError("target has neither get_input_embeddings() nor embed_weight")
            embed = get_in().weight
        head = getattr(target, "lm_head", None)
        if head is None:
            get_out = getattr(target, "get_output_embeddings", None)
            head = get_out() if get_out is not None else None
        if head is None:
            raise ConfigError("target has no lm_head / output embeddings")
        weight: Any = head.weight if isinstance(head, nn.Module) else head
        cfg: Any = getattr(target, "config", None)
        get_text = getattr(cfg, "get_text_config", None)
        text = get_text() if callable(get_text) else cfg
        layers = getattr(text, "num_hidden_layers", None)
        hidden = getattr(text, "hidden_size", None)
        positions = getattr(text, "max_position_embeddings", None)
        return cls(
            embed=embed,
            lm_head=head,
            vocab_size=int(weight.shape[0]),
            vocab_in=int(embed.shape[0]),
            num_layers=None if layers is None else int(layers),
            hidden_size=None if hidden is None else int(hidden),
            max_positions=None if positions is None else int(positions),
        )

    def check_fits(self, spec: DraftSpec) -> None:
        """Raises ``ConfigError`` unless a drafter of ``spec`` can run on this target."""
        check_fits(drafter_hidden=spec.hidden_size, target_layer_ids=spec.target_layer_ids,
                   mask_token_id=spec.mask_token_id, target_hidden=int(self.embed.shape[1]),
                   config_hidden=self.hidden_size, target_layers=self.num_layers,
                   embed_rows=self.vocab_in)


__all__ = ["DraftSpec", "TargetHead"]
