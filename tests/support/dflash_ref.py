"""Shared by the parity tests: random checkpoints of the public reference drafter (dflash
0.1.0), the logged test seed, and the normwise relative error."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel  # type: ignore[import-untyped]
from transformers import Qwen3Config

log = logging.getLogger(__name__)


def save_reference_drafter(
    tmp: Path,
    *,
    dflash2: bool,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    num_target_layers: int,
    mask: int,
    target_ids: list[int],
    block_size: int,
    std: float,
    head_dim: int | None = None,
    dflash2_config: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
    dflash_extra: dict[str, Any] | None = None,
    **save_kwargs: Any,
) -> Any:
    """A reference DFlash (or DFlash2) drafter on a small Qwen3Config, weights ~ N(0, std),
    written to ``tmp`` with ``save_pretrained`` (``save_kwargs`` passed on); returns it.

    ``dflash2_config``: DFlash2's conv/selector sizes (``conv_kernel_size``,
    ``conv_group_size``, ``selector_rank``, ``selector_top_k``)."""
    config = Qwen3Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim or hidden // heads,
        intermediate_size=intermediate, vocab_size=vocab, num_target_layers=num_target_layers,  # type: ignore[call-arg]
        **(extra or {}),
    )
    dflash_config: dict[str, Any] = {
        "mask_token_id": mask, "target_layer_ids": target_ids, "block_size": block_size,
    }
    if dflash2:
        dflash_config.update(dflash2_config or {})
    dflash_config.update(dflash_extra or {})
    config.dflash_config = dflash_config
    cls = DFlash2DraftModel if dflash2 else DFlashDraftModel
    config.architectures = [cls.__name__]
    ref = cls(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, std)
    ref.save_pretrained(tmp, **save_kwargs)
    return ref


def logged_seed() -> int:
    """``BLOCKDRAFT_TEST_SEED`` or a random seed, logged for replay; seeds torch with it."""
    value = int(os.environ.get("BLOCKDRAFT_TEST_SEED", random.randrange(2**31)))
    log.warning("seed=%d (set BLOCKDRAFT_TEST_SEED to replay)", value)
    torch.manual_seed(value)
    return value


def rel_err(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error: max |mine - ref| / max |ref|."""
    return float((mine.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))

