"""Training DFlash drafters: corpora, the recipe (objective + loop), evaluation, the built-in pair."""

from __future__ import annotations

from blockdraft.training.recipe import (
    DrafterTrainConfig,
    TrainResult,
    block_attention_mask,
    block_loss,
    default_gamma,
    loss_weights,
    sample_anchors,
    token_hardness,
    train_drafter,
)

__all__ = [
    "DrafterTrainConfig",
    "TrainResult",
    "block_attention_mask",
    "block_loss",
    "default_gamma",
    "loss_weights",
    "sample_anchors",
    "token_hardness",
    "train_drafter",
]
