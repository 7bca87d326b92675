"""Which Hugging Face targets the runtime runs, and what it reads from one.

A target is recognised by its architecture (``config.architectures`` or the model's class
name) and checked module by module: the runtime reads the weights of the loaded model in place,
so every piece it relies on (projections, norms, rotary frequencies, sliding windows) is taken
from the model itself and anything it does not implement is refused with a
:class:`~blockdraft.ConfigError` naming the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from blockdraft._core import ConfigError

FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""Supported architectures -> family."""

ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3"})
"""Rotary scalings with frequencies fixed for every position the runtime serves (``dynamic``
NTK scaling is the default rotary embedding up to ``max_position_embeddings``, the most a
sequence may hold)."""


def architecture(model: Any) -> str:
    """The model's architecture name: ``config.architectures[0]``, else its class name."""
    cfg = getattr(model, "config", None)
    names = getattr(cfg, "architectures", None) or []
    return str(names[0]) if names else type(model).__name__


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's modules, in place (nothing copied)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: Tensor | None
    k_norm: Tensor | None
    input_norm: Tensor
    post_norm: Tensor
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    sliding_window: int | None


@dataclass(frozen=True)
class TargetSpec:
    """A supported target: its shapes and modules.

    Attributes:
        family: ``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"qwen3"``.
        num_heads / num_kv_heads / intermediate_size: this rank's (the model's divided by
            ``tp_size``; the whole model's without tensor parallelism).
        inv_freq: ``[D/2]`` fp32 rotary frequencies; ``rope_scale`` multiplies cos and sin.
        max_positions: the model's ``max_position_embeddings``.
        tp_rank / tp_size: this rank's place in its tensor-parallel group (0 of 1 without).
    """

    model: nn.Module
    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    eps: float
    scale: float
    inv_freq: Tensor
    rope_scale: float
    max_positions: int
    embed: nn.Embedding
    final_norm: Tensor
    lm_head: nn.Linear
    layers: tuple[LayerSpec, ...]
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @classmethod
    def from_model(cls, model: Any) -> TargetSpec:
        """Read and check a loaded Hugging Face causal LM.

        Raises:
            ConfigError: an architecture outside :data:`FAMILIES`, or a supported one with a
                feature the runtime does not implement (named in the message).
        """
        arch = architecture(model)
        family = FAMILIES.get(arch)
        if family is None:
            raise ConfigError(
                f"the blockdraft runtime does not support {arch} (supported: "
                f"{', '.join(sorted(FAMILIES))}); use runtime='hf'"
            )
        cfg = model.config
        decoder: Any = getattr(model, "model", None)
        if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
            raise ConfigError(f"{arch}: no decoder layers at model.model.layers")

        def refuse(what: str) -> ConfigError:
            return ConfigError(f"the blockdraft runtime does not support {arch} with {what}")

        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise refuse(f"hidden_act={act!r} (only silu)")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = str(rope.get("rope_type", "default"))
        if rope_type not in ROPE_TYPES:
            raise refuse(f"rope_type={rope_type!r} (supported: {', '.join(sorted(ROPE_TYPES))})")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise refuse("a partial rotary factor")
        rotary = getattr(decoder, "rotary_emb", None)
        inv_freq = getattr(rotary, "original_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
        if not isinstance(inv_freq, Tensor):
            raise refuse("no rotary embedding at model.model.rotary_emb")
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        hidden = int(cfg.hidden_size)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        if head_dim % 2:
            raise refuse(f"an odd head_dim ({head_dim})")
        if heads % kv_heads:
            raise refuse(f"{heads} query heads over {kv_heads} K/V heads")
        if int(inv_freq.numel()) != head_dim // 2:
            raise refuse(f"{inv_freq.numel()} rotary frequencies for head_dim {head_dim}")
        layers = tuple(
            _layer_spec(arch, family, cfg, layer, i) for i, layer in enumerate(decoder.layers)
        )
        embed = decoder.embed_tokens
        head = getattr(model, "lm_head", None)
        if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear):
            raise refuse("no embed_tokens / lm_head")
        if head.bias is not None:
            raise refuse("an lm_head bias")
        for p in model.parameters():
            if not p.is_floating_point() or p.device.type == "meta":
                raise refuse(f"{p.dtype} parameters on {p.device} (load real floating weights)")
        return cls(
            model=model,
            architecture=arch,
            family=family,
            num_layers=len(layers),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(cfg.intermediate_size),
            vocab_size=int(head.weight.shape[0]),
            eps=float(cfg.rms_norm_eps),
            scale=float(head_dim**-0.5),
            inv_freq=inv_freq.detach().to(device=embed.weight.device, dtype=torch.float32),
            rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
            max_positions=int(cfg.max_position_embeddings),
            embed=embed,
            final_norm=decoder.norm.weight,
            lm_head=head,
            layers=layers,
        )


def _norm_weight(module: Any, what: str, arch: str) -> Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise ConfigError(f"{arch}: {what} has no weight")
    return weight


def _layer_spec(arch: str, family: str, cfg: Any, layer: nn.Module, i: int) -> LayerSpec:
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    linears = {}
    for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                         (mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            mod = getattr(owner, name, None)
            if not isinstance(mod, nn.Linear):
                raise ConfigError(f"{arch}: layer {i} has no {name} linear layer")
            linears[name] = mod
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    if (q_norm is None) != (k_norm is None):
        raise ConfigError(f"{arch}: layer {i} has only one of q_norm / k_norm")
    if family == "mistral":
        window = getattr(cfg, "sliding_window", None)
    else:
        window = getattr(attn, "sliding_window", None)
    return LayerSpec(
        q_norm=None if q_norm is None else _norm_weight(q_norm, f"layer {i} q_norm", arch),
        k_norm=None if k_norm is None else _norm_weight(k_norm, f"layer {i} k_norm", arch),
        input_norm=_norm_weight(getattr(layer, "input_layernorm", None), f"layer {i} input_layernorm", arch),
        post_norm=_norm_weight(getattr(layer, "post_attention_layernorm", None),
                               f"layer {i} post_attention_layernorm", arch),
        sliding_window=None if window is None else int(window),
        **linears,
    )


__all__ = ["FAMILIES", "ROPE_TYPES", "LayerSpec", "TargetSpec", "architecture"]
