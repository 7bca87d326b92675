"""Rotary position embedding (rotate-half style) with the RoPE variants of Qwen3/Llama drafters.

The frequencies reproduce transformers' initialisation functions for ``default``, ``linear``,
``llama3`` and ``yarn``; cos/sin are computed in fp32 from absolute positions, scaled by
``attention_scaling`` and cast to the activation dtype, as the reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from blockdraft._core import CheckpointError
from blockdraft.config import DrafterConfig, RopeConfig


def _base_inv_freq(theta: float, head_dim: int, device: torch.device | None) -> Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    factor = float(rope.params["factor"])
    low = float(rope.params["low_freq_factor"])
    high = float(rope.params["high_freq_factor"])
    old_len = float(rope.params["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    rope: RopeConfig, head_dim: int, max_pos: int, device: torch.device | None
) -> tuple[Tensor, float]:
    p = rope.params
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor")
    factor = float(max_pos / original if factor is None else factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1
    theta = rope.theta

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).to(device=device, dtype=torch.float32)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float32) / head_dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_frequencies(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, device: torch.device | None = None
) -> tuple[Tensor, float]:
    """``(inv_freq [head_dim/2] fp32, attention_scaling)`` for ``rope``.

    Raises:
        CheckpointError: an unsupported RoPE type.
    """
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, head_dim, device), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, head_dim, device) / float(rope.params["factor"]), 1.0
    if rope.rope_type == "llama3":
        return _llama3(_base_inv_freq(rope.theta, head_dim, device), rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_position_embeddings, device)
    raise CheckpointError(f"unsupported RoPE type {rope.rope_type!r}")


@dataclass
class Rope:
    """Rotary embedding of one drafter.

    Attributes:
        inv_freq: [D/2] fp32 inverse frequencies.
        attention_scaling: factor applied to cos and sin (1.0 except for yarn).
    """

    inv_freq: Tensor
    attention_scaling: float

    @classmethod
    def from_config(cls, config: DrafterConfig, device: torch.device | str | None = None) -> Rope:
        dev = None if device is None else torch.device(device)
        if dev is not None and dev.type == "meta":
            dev = torch.device("cpu")
        inv_freq, scaling = rope_frequencies(config.rope, config.head_dim, config.max_position_embeddings, dev)
        return cls(inv_freq=inv_freq.to(torch.float32), attention_scaling=scaling)

    def to(self, device: torch.device | str) -> Rope:
        return Rope(self.inv_freq.to(device), self.attention_scaling)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin for integer ``positions`` [...]: each [..., D], in ``dtype``."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [..., T, heads, D] with ``cos``/``sin`` [..., T, D] (broadcast over heads)."""
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)
