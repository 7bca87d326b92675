"""What a drafter reads of its target: the input embedding table and the output head, with the
sizes the drafter is checked against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from blockdraft._core import ConfigError
from blockdraft.pair.checks import check_fits
from blockdraft.target.layers import config_int


@dataclass(frozen=True)
class TargetHead:
    """The target pieces the drafter uses: the input embedding table ``[V_in, H]`` and the
    output head (a module or its weight ``[V, H]``).

    Attributes:
        vocab_size: V, the head's output size (draft ids and bitmasks cover it).
        vocab_in: the ids the embedding table takes (anchors must be below it).
        num_layers / hidden_size / max_positions: from the target's text config when it
            states them (:func:`~blockdraft.target.layers.config_int`).
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
        return cls(
            embed=embed,
            lm_head=head,
            vocab_size=int(weight.shape[0]),
            vocab_in=int(embed.shape[0]),
            num_layers=config_int(target, "num_hidden_layers"),
            hidden_size=config_int(target, "hidden_size"),
            max_positions=config_int(target, "max_position_embeddings"),
        )

    def check_fits(
        self, *, drafter_hidden: int, target_layer_ids: Sequence[int], mask_token_id: int
    ) -> None:
        """Raises ``ConfigError`` unless a drafter of this hidden size, reading these target
        layers, with this mask token can run on this target."""
        check_fits(drafter_hidden=drafter_hidden, target_layer_ids=target_layer_ids,
                   mask_token_id=mask_token_id, target_hidden=int(self.embed.shape[1]),
                   config_hidden=self.hidden_size, target_layers=self.num_layers,
                   embed_rows=self.vocab_in)


__all__ = ["TargetHead"]
