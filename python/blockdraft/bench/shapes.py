"""Named model shapes and the random-weight targets and drafters built at them.

Everything is built in memory (no downloads): a Hugging Face Qwen3 causal LM as the target, a
:class:`~blockdraft.DFlashDrafter` as the drafter, and the public reference's
``DFlashDraftModel`` holding the drafter's weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    """A target + drafter pair shape (Qwen3 layout)."""

    name: str
    target_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    drafter_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int

    @property
    def ctx_row_width(self) -> int:
        """Width of one ctx row: the target layers' hidden states side by side (``k * H``)."""
        return len(self.target_layer_ids) * self.hidden


SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 5, (1, 9, 17, 25, 33), 16, 151669),
    "qwen3-4b": Shape("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, 5, (1, 9, 17, 25, 33), 16, 151669),
    "tiny": Shape("tiny", 4, 64, 4, 2, 16, 128, 512, 2, (1, 2), 8, 511),
}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` for the block (modules built inside take it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def fill_random(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Norm weights 1, every other parameter N(0, std), drawn on the parameter's device."""
    gen: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
                continue
            g = gen.get(p.device)
            if g is None:
                g = torch.Generator(device=p.device).manual_seed(seed)
                gen[p.device] = g
            p.normal_(0.0, std, generator=g)
    module.requires_grad_(False)


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight Qwen3 causal LM at ``shape``, allocated and filled on ``device``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs: dict[str, Any] = dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.target_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.mlp,
        vocab_size=shape.vocab,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    cfg = Qwen3Config(**kwargs)
    # Built on the device directly: an 8B model initialised on the CPU would take minutes.
    with torch.device(device), default_dtype(dtype):
        model = Qwen3ForCausalLM(cfg)  # type: ignore[no-untyped-call]
    fill_random(model, seed)
    return model.eval()  # type: ignore[no-untyped-call]


def drafter_config_dict(shape: Shape) -> dict[str, Any]:
    """The drafter's ``config.json`` object (z-lab format)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.drafter_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.mlp,
        "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "num_target_layers": shape.target_layers,
        "block_size": shape.block_size,
        "dflash_config": {
            "target_layer_ids": list(shape.target_layer_ids),
            "mask_token_id": shape.mask_token_id,
        },
    }


def build_drafter(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 1) -> Any:
    """A random-weight DFlash drafter at ``shape`` on ``device``."""
    from blockdraft.config import DrafterConfig
    from blockdraft.models import DFlashDrafter

    cfg = DrafterConfig.from_dict(drafter_config_dict(shape))
    drafter = DFlashDrafter(cfg, device=device, dtype=dtype)
    fill_random(drafter, seed)
    return drafter.eval()


def build_reference_drafter(drafter: Any, shape: Shape) -> Any:
    """The public reference's ``DFlashDraftModel`` holding ``drafter``'s weights (same device
    and dtype). Raises ImportError without ``dflash``."""
    from dflash.model import DFlashDraftModel  # type: ignore[import-untyped]
    from transformers import Qwen3Config

    raw = drafter_config_dict(shape)
    raw.pop("architectures")
    cfg = Qwen3Config(**raw)
    weight = drafter.fc.weight
    with torch.device(weight.device), default_dtype(weight.dtype):
        ref = DFlashDraftModel(cfg)
    missing, unexpected = ref.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise RuntimeError(f"reference drafter weights differ: missing {missing}, unexpected {unexpected}")
    return ref.to(device=weight.device, dtype=weight.dtype).eval()
