"""A pair's shape: the drafter's ``config.json`` built from typed fields, the named shapes, and
random-weight targets and drafters built at them.

Everything is built in memory (no downloads): a Hugging Face Qwen3 causal LM as the target and
a :class:`~blockdraft.DFlashDrafter` (or DFlash2 drafter) as the drafter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from blockdraft.config import DFLASH2_ARCH, DFLASH2_FIELDS, DFLASH_ARCH, default_target_layer_ids


@dataclass(frozen=True)
class DrafterShape:
    """The fields of a DFlash drafter's ``config.json`` (z-lab layout); :meth:`config_dict`
    writes the object that :func:`blockdraft.load_drafter` and ``dflash.DFlashDraftModel`` read.

    Attributes:
        extra: further top-level keys (they override the ones built from the fields).
        dflash_extra: further ``dflash_config`` keys (DFlash2's convolution and selector sizes).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    max_positions: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    architecture: str = DFLASH_ARCH
    extra: Mapping[str, Any] = field(default_factory=dict)
    dflash_extra: Mapping[str, Any] = field(default_factory=dict)

    def config_dict(self) -> dict[str, Any]:
        """The drafter's ``config.json`` object."""
        raw: dict[str, Any] = {
            "architectures": [self.architecture],
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_positions,
            "rope_theta": self.rope_theta,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                **self.dflash_extra,
            },
        }
        raw.update(self.extra)
        return raw

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        dflash2: Mapping[str, int] | None = None,
    ) -> DrafterShape:
        """A drafter of ``target_config``'s hidden size, to be trained on that target.

        Heads, head dim, RoPE, norm epsilon and (by default) the MLP width follow the target's
        text config, read by Hugging Face's standard names (its attribute maps make GPT-2's
        ``n_embd``/``n_layer``/``n_head`` answer to them); a target without an
        ``intermediate_size`` (GPT-2: ``n_inner``, unset meaning 4 × hidden) gives that width.
        A target without RoPE (GPT-2's learned positions) gives the drafter RoPE base 10000.
        With ``dflash2`` (``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
        ``selector_top_k``) it is a DFlash2 drafter (``dflash.DFlash2DraftModel``).

        Raises:
            ValueError: the target's RoPE is not the default kind.
        """
        get_text = getattr(target_config, "get_text_config", None)
        tc = get_text() if callable(get_text) else target_config
        num_target = int(tc.num_hidden_layers)
        ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(num_target, num_layers)
        hidden = int(tc.hidden_size)
        heads = int(tc.num_attention_heads)
        rope_params = getattr(tc, "rope_parameters", None)
        theta = None
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                raise ValueError(f"target RoPE {rope_params} is not supported by the recipe (default RoPE only)")
        theta = float(theta or getattr(tc, "rope_theta", None) or 10000.0)
        dflash_extra: dict[str, Any] = {"block_size": block_size}
        if dflash2:
            dflash_extra.update({k: int(dflash2[k]) for k in DFLASH2_FIELDS})
        return cls(
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(tc, "head_dim", None) or hidden // heads),
            intermediate_size=int(intermediate_size or getattr(tc, "intermediate_size", None)
                                  or getattr(tc, "n_inner", None) or 4 * hidden),
            vocab_size=int(tc.vocab_size),
            num_target_layers=num_target,
            block_size=block_size,
            target_layer_ids=tuple(ids),
            mask_token_id=mask_token_id,
            max_positions=int(getattr(tc, "max_position_embeddings", 4096)),
            rope_theta=theta,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            architecture=DFLASH2_ARCH if dflash2 else DFLASH_ARCH,
            extra={
                "model_type": "qwen3",
                "hidden_act": "silu",
                "attention_bias": False,
                "attention_dropout": 0.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                "tie_word_embeddings": False,
                "use_sliding_window": False,
                "layer_types": ["full_attention"] * num_layers,
            },
            dflash_extra=dflash_extra,
        )


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
    max_positions: int = 40960
    rope_theta: float = 1_000_000.0
    dflash2: tuple[int, int, int, int] | None = None
    """A DFlash2 drafter's sizes (conv kernel, conv group, selector rank, selector top-K;
    :data:`~blockdraft.config.DFLASH2_FIELDS`); ``None``: a DFlash drafter."""

    @property
    def ctx_row_width(self) -> int:
        """Width of one ctx row: the target layers' hidden states side by side (``k * H``)."""
        return len(self.target_layer_ids) * self.hidden

    @property
    def drafter(self) -> DrafterShape:
        """The drafter's config fields at this shape."""
        return DrafterShape(
            hidden_size=self.hidden,
            num_layers=self.drafter_layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.mlp,
            vocab_size=self.vocab,
            num_target_layers=self.target_layers,
            block_size=self.block_size,
            target_layer_ids=self.target_layer_ids,
            mask_token_id=self.mask_token_id,
            max_positions=self.max_positions,
            rope_theta=self.rope_theta,
            architecture=DFLASH2_ARCH if self.dflash2 else DFLASH_ARCH,
            dflash_extra=dict(zip(DFLASH2_FIELDS, self.dflash2)) if self.dflash2 else {},
        )


_QWEN3_8B = Shape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 5, (1, 9, 17, 25, 33), 16, 151669)
_TINY = Shape("tiny", 4, 64, 4, 2, 16, 128, 512, 2, (1, 2), 8, 511)

SHAPES: dict[str, Shape] = {
    "qwen3-8b": _QWEN3_8B,
    # the same pair with a DFlash2 drafter: convolutions of 3 taps over groups of 32 channels,
    # a selector of rank 32 over the top 8 candidates
    "qwen3-8b-dflash2": replace(_QWEN3_8B, name="qwen3-8b-dflash2", dflash2=(3, 32, 32, 8)),
    "qwen3-4b": Shape("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, 5, (1, 9, 17, 25, 33), 16, 151669),
    "tiny": _TINY,
    "tiny-dflash2": replace(_TINY, name="tiny-dflash2", dflash2=(3, 16, 8, 4)),
}
"""The shapes ``blockdraft bench --shape`` offers (``*-dflash2``: the pair with a DFlash2
drafter)."""

DEMO_SHAPE = Shape("demo", 4, 128, 4, 2, 32, 256, 320, 1, (1, 2), 8, 256, max_positions=4096)
"""The CLI's demo pair: a byte vocabulary (ids 0..255), a mask id past it, 4096 positions."""


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


def random_target(shape: Shape, device: Any, dtype: torch.dtype, seed: int = 0) -> Any:
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
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    cfg = Qwen3Config(**kwargs)
    # Built on the device directly: an 8B model initialised on the CPU would take minutes.
    with torch.device(device), default_dtype(dtype):
        model = Qwen3ForCausalLM(cfg)  # type: ignore[no-untyped-call]
    fill_random(model, seed)
    return model.eval()  # type: ignore[no-untyped-call]


def random_drafter(shape: Shape | DrafterShape, device: Any, dtype: torch.dtype, seed: int = 1) -> Any:
    """A random-weight DFlash (or DFlash2) drafter at ``shape`` (a pair's shape, or a
    drafter's fields such as :meth:`DrafterShape.for_target` gives) on ``device``."""
    from blockdraft.config import DrafterConfig
    from blockdraft.models import DFlash2Drafter, DFlashDrafter

    fields = shape.drafter if isinstance(shape, Shape) else shape
    config = DrafterConfig.from_dict(fields.config_dict())
    cls = DFlash2Drafter if config.is_dflash2 else DFlashDrafter
    drafter = cls(config, device=device, dtype=dtype)
    fill_random(drafter, seed)
    return drafter.eval()


def random_pair(shape: Shape, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> tuple[Any, Any]:
    """``(target, drafter)`` with random weights at ``shape``, drawn on ``device`` (the target
    from ``seed``, the drafter from ``seed + 1``)."""
    return random_target(shape, device, dtype, seed), random_drafter(shape, device, dtype, seed + 1)
