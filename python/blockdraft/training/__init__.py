"""Training DFlash drafters.

==============================================  ===============================================
:mod:`~blockdraft.training.data`                corpora, token streams, training windows
:mod:`~blockdraft.training.rollouts`            continuations written by the target itself
:mod:`~blockdraft.training.objective`           anchors, the block attention mask, the loss
:mod:`~blockdraft.training.selector`            the DFlash2 candidate selector's objective
:mod:`~blockdraft.training.drafter`             the drafter's start: random, from the target, grown
:mod:`~blockdraft.training.optim`               AdamW, the schedule, the time budget
:mod:`~blockdraft.training.loop`                the training loop (:func:`train_drafter`)
:mod:`~blockdraft.training.evaluate`            tau and speed on held-out prompts
:mod:`~blockdraft.training.builtin`             the built-in pair's factory
==============================================  ===============================================
"""

from __future__ import annotations

from blockdraft.training.loop import DrafterTrainConfig, TrainResult, train_drafter
from blockdraft.training.objective import (
    block_attention_mask,
    block_loss,
    default_gamma,
    loss_weights,
    sample_anchors,
    token_hardness,
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
