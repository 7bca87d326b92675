"""Tiny random target + DFlash drafter pairs for the proposer, engine and CLI tests (CPU, fp32).

Everything is built in memory from fixed seeds, so each test sees the same weights every run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from blockdraft.config import DFLASH2_ARCH, DrafterConfig
from blockdraft.models import DFlash2Drafter, DFlashDrafter
from blockdraft.pair import DrafterShape

HIDDEN = 32
K_H = 2 * HIDDEN  # k * H: the default drafter reads 2 target layers of hidden size 32


def tiny_target(kind: str = "qwen3", *, vocab: int = 64, layers: int = 3, seed: int = 0) -> Any:
    """A random causal LM (fp32, eval) with hidden size 32."""
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model: Any
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))  # type: ignore[no-untyped-call]
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))  # type: ignore[no-untyped-call]
    else:
        raise ValueError(kind)
    return model.eval()


def drafter_config(**kw: Any) -> DrafterConfig:
    """The tiny drafter's config (see :func:`tiny_drafter_shape` for the arguments)."""
    return DrafterConfig.from_dict(tiny_drafter_shape(**kw).config_dict())


def tiny_drafter_shape(
    *,
    vocab: int = 64,
    target_layers: int = 3,
    block: int = 4,
    layers: int = 1,
    mask: int | None = None,
    hidden: int = HIDDEN,
    extra: dict[str, Any] | None = None,
) -> DrafterShape:
    """The tiny drafter's config fields: it reads target layers 0 and last."""
    return DrafterShape(
        hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=vocab, num_target_layers=target_layers, block_size=block,
        target_layer_ids=(0, target_layers - 1), mask_token_id=vocab - 1 if mask is None else mask,
        max_positions=512, rope_theta=10000.0, extra=extra or {},
    )


def tiny_drafter(config: DrafterConfig | None = None, *, seed: int = 1) -> DFlashDrafter:
    """A random DFlash drafter (fp32, CPU); norms start at 1, matrices ~ N(0, 0.1)."""
    cfg = config or drafter_config()
    drafter = DFlashDrafter(cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    drafter.requires_grad_(False)
    return drafter.eval()


def make_proposer(drafter: Any, target: Any, **kw: Any) -> Any:
    """A torch-backend proposer over the tiny pair (max_seq_len 256, 64 pages of 4 tokens,
    max_batch 4 unless given)."""
    from blockdraft.proposer import DFlashProposer

    for key, value in (("max_seq_len", 256), ("num_pages", 64), ("page_size", 4),
                       ("max_batch", 4), ("backend", "torch")):
        kw.setdefault(key, value)
    return DFlashProposer(drafter, target, **kw)



DFLASH2_SIZES = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}
"""The tiny DFlash2 drafter's sizes: taps reaching past the previous row, 4 of 64 candidates."""


def tiny_dflash2(block: int = 4, layers: int = 2, seed: int = 3) -> DFlash2Drafter:
    """A random DFlash2 drafter (fp32, CPU) for the tiny target; norms 1, the rest ~ N(0, 0.1)."""
    shape = dataclasses.replace(tiny_drafter_shape(block=block, layers=layers),
                                architecture=DFLASH2_ARCH, dflash_extra=DFLASH2_SIZES)
    drafter = DFlash2Drafter(DrafterConfig.from_dict(shape.config_dict()), device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 and "norm" in name
                    else torch.randn(p.shape, generator=gen) * 0.1)
    drafter.requires_grad_(False)
    return drafter.eval()
