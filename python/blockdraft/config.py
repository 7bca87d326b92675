"""Drafter configuration, parsed from a z-lab style ``config.json``.

Every value the drafter needs is read from the file. Lookups of DFlash-specific fields follow the
public reference: ``dflash_config[name]`` first, then the top-level key, then a documented
default. Unknown keys are ignored. Any value that cannot be used raises
:class:`blockdraft.CheckpointError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockdraft._core import CheckpointError

logger = logging.getLogger(__name__)

DFLASH_ARCH = "DFlashDraftModel"
DFLASH2_ARCH = "DFlash2DraftModel"
SUPPORTED_ARCHITECTURES = (DFLASH_ARCH, DFLASH2_ARCH)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""DFlash2's extra ``dflash_config`` sizes: convolution taps and group width, selector rank
and candidates K."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu",)
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Values the reference (transformers' Qwen3Config and dflash 0.1.0) uses when a key is absent.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's rule for configs without ``target_layer_ids``.

    One draft layer reads the middle target layer; otherwise ``num_draft_layers`` ids spread
    evenly over ``[1, num_target_layers - 3]`` (rounded half to even, as Python's ``round``).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_parameters``, or legacy ``rope_theta``/``rope_scaling``).

    ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`; ``params`` keeps the remaining keys
    (``factor``, ``low_freq_factor``, ``original_max_position_embeddings``, ...).
    """

    rope_type: str
    theta: float
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DrafterConfig:
    """Everything that shapes a DFlash / DFlash2 drafter.

    Attributes:
        architecture: ``"DFlashDraftModel"`` or ``"DFlash2DraftModel"``.
        hidden_size: H; equals the target's hidden size.
        num_layers: drafter decoder layers L (``num_hidden_layers``).
        num_heads / num_kv_heads / head_dim: Hq, Hkv, D.
        intermediate_size: SwiGLU width.
        vocab_size: the drafter's vocabulary (sizes the DFlash2 codebooks).
        rms_norm_eps: epsilon of every RMSNorm.
        attention_bias: whether q/k/v/o projections carry a bias.
        hidden_act: MLP activation (only ``silu``).
        block_size: B, the block drafted per forward (anchor + B-1 masks).
        target_layer_ids: target layers whose outputs form a ctx row, in concatenation order.
        num_target_layers: layers of the target the drafter was trained on, when given.
        mask_token_id: id of the MASK token that fills block rows 1..B-1 (``None`` if absent).
        rope: rotary embedding parameters.
        max_position_embeddings: used by RoPE variants that need it (yarn).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: window of sliding layers in tokens (``None``: no window).
        is_causal: ``None`` = causal exactly in sliding layers; a bool forces every layer.
        input_embedding_scale: multiplies the block's input embeddings.
        output_multiplier: multiplies the logits.
        final_logit_softcapping: ``tanh(logits / c) * c`` when set and > 0.
        conv_kernel_size / conv_group_size: DFlash2 dynamic convolution taps and group width.
        selector_rank / selector_top_k: DFlash2 candidate selector rank and candidates K.
        dtype: the ``torch_dtype``/``dtype`` named in the file, if any.
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    hidden_act: str
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    mask_token_id: int | None
    rope: RopeConfig
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    dtype: str | None = None

    @property
    def is_dflash2(self) -> bool:
        """A DFlash2 drafter (dynamic convolutions and a candidate selector)."""
        return self.architecture == DFLASH2_ARCH

    @property
    def num_context_layers(self) -> int:
        """k = ``len(target_layer_ids)``; a ctx row has ``k * hidden_size`` values."""
        return len(self.target_layer_ids)

    def layer_sliding_window(self, layer: int) -> int | None:
        """Window of ``layer`` in tokens, ``None`` for full attention."""
        if self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def layer_is_causal(self, layer: int) -> bool:
        """Whether block rows of ``layer`` see only earlier block rows."""
        if self.is_causal is None:
            return self.layer_types[layer] == SLIDING_ATTENTION
        return self.is_causal

    @classmethod
    def from_file(cls, path: str | Path) -> DrafterConfig:
        """Parse ``config.json`` at ``path``.

        Raises:
            CheckpointError: missing or unreadable file, bad JSON, or an unusable value.
        """
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"config file not found: {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} must hold a JSON object, found {type(raw).__name__}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DrafterConfig:
        """Build from the parsed ``config.json`` object (see :class:`DrafterConfig`).

        Raises:
            CheckpointError: a missing required field or a value of the wrong kind.
        """
        return _parse(raw)


class _Reader:
    """Typed access to the config object with errors that name the field."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        nested = raw.get("dflash_config")
        if nested is None:
            nested = {}
        if not isinstance(nested, Mapping):
            raise CheckpointError(
                f"config field 'dflash_config' must be an object, found {type(nested).__name__}"
            )
        self.nested: Mapping[str, Any] = nested

    def draft_value(self, name: str) -> tuple[str, Any]:
        """(where, value) for a DFlash field: ``dflash_config`` first, then top level."""
        if name in self.nested:
            return f"dflash_config.{name}", self.nested[name]
        return name, self.raw.get(name)

    def int_(self, where: str, value: Any, *, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            # JSON writers sometimes emit integral floats (e.g. 16.0); accept only exact ones.
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise CheckpointError(f"config field '{where}' must be an integer, found {value!r}")
        if minimum is not None and value < minimum:
            raise CheckpointError(f"config field '{where}' must be >= {minimum}, found {value}")
        return int(value)

    def float_(self, where: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"config field '{where}' must be a number, found {value!r}")
        return float(value)

    def required_int(self, name: str, *, minimum: int | None = None) -> int:
        if self.raw.get(name) is None:
            raise CheckpointError(f"config field '{name}' is missing")
        return self.int_(name, self.raw[name], minimum=minimum)

    def optional_draft_int(self, name: str, *, minimum: int | None = None) -> int | None:
        where, value = self.draft_value(name)
        return None if value is None else self.int_(where, value, minimum=minimum)

    def draft_float(self, name: str, default: float) -> float:
        where, value = self.draft_value(name)
        return default if value is None else self.float_(where, value)


def _parse_architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs is None:
        raise CheckpointError(
            f"config field 'architectures' is missing; expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config field 'architectures' must be a list of names, found {archs!r}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise CheckpointError(
        f"unsupported architecture {archs!r}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
    )


def _parse_rope(r: _Reader) -> RopeConfig:
    raw = r.raw
    params = raw.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        # Legacy form, as transformers reads it: rope_scaling (if any) plus rope_theta.
        params = raw.get("rope_scaling")
        where = "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"config field '{where}' must be an object, found {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise CheckpointError(
            f"config field '{where}' gives RoPE per layer type; only one RoPE for all layers is supported"
        )
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported RoPE type {rope_type!r} in '{where}'; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    theta_value = params.pop("rope_theta", None)
    theta_where = f"{where}.rope_theta"
    if theta_value is None:
        theta_value, theta_where = raw.get("rope_theta"), "rope_theta"
    theta = DEFAULT_ROPE_THETA if theta_value is None else r.float_(theta_where, theta_value)
    if theta <= 0:
        raise CheckpointError(f"config field '{theta_where}' must be > 0, found {theta}")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise CheckpointError(f"config field '{where}.partial_rotary_factor' must be 1.0, found {partial!r}")
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")}
    for key in required.get(rope_type, ()):
        if params.get(key) is None:
            raise CheckpointError(f"RoPE type {rope_type!r} needs config field '{where}.{key}'")
        r.float_(f"{where}.{key}", params[key])
    return RopeConfig(rope_type=rope_type, theta=theta, params=params)


def _parse_layer_types(r: _Reader, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    raw = r.raw
    use_sliding = raw.get("use_sliding_window", False)
    if not isinstance(use_sliding, bool):
        raise CheckpointError(f"config field 'use_sliding_window' must be a boolean, found {use_sliding!r}")
    window_value = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    # As in Qwen3Config: the window only exists when use_sliding_window is set.
    window = None
    if use_sliding and window_value is not None:
        window = r.int_("sliding_window", window_value, minimum=1)
    layer_types = raw.get("layer_types")
    if layer_types is None:
        max_window_layers = raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        mwl = r.int_("max_window_layers", max_window_layers)
        layer_types = [
            SLIDING_ATTENTION if window is not None and i >= mwl else FULL_ATTENTION
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise CheckpointError(
            f"config field 'layer_types' must list {num_layers} layer types, found {layer_types!r}"
        )
    for i, kind in enumerate(layer_types):
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise CheckpointError(
                f"config field 'layer_types[{i}]' must be '{FULL_ATTENTION}' or "
                f"'{SLIDING_ATTENTION}', found {kind!r}"
            )
    return tuple(layer_types), window


def _parse_target_layer_ids(r: _Reader, num_layers: int) -> tuple[tuple[int, ...], int | None]:
    num_target = r.raw.get("num_target_layers")
    num_target_layers = None
    if num_target is not None:
        num_target_layers = r.int_("num_target_layers", num_target, minimum=1)
    where, ids = r.draft_value("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise CheckpointError(
                "config has neither 'dflash_config.target_layer_ids' nor 'num_target_layers' "
                "to derive them from"
            )
        ids = default_target_layer_ids(num_target_layers, num_layers)
        logger.info("target_layer_ids absent; derived %s from num_target_layers=%d", ids, num_target_layers)
    if not isinstance(ids, list) or not ids:
        raise CheckpointError(f"config field '{where}' must be a non-empty list, found {ids!r}")
    parsed = tuple(r.int_(f"{where}[{i}]", v, minimum=0) for i, v in enumerate(ids))
    if num_target_layers is not None and max(parsed) >= num_target_layers:
        raise CheckpointError(
            f"config field '{where}' names layer {max(parsed)} but num_target_layers is {num_target_layers}"
        )
    return parsed, num_target_layers


def _parse(raw: Mapping[str, Any]) -> DrafterConfig:
    r = _Reader(raw)
    architecture = _parse_architecture(raw)
    hidden = r.required_int("hidden_size", minimum=1)
    num_layers = r.required_int("num_hidden_layers", minimum=1)
    num_heads = r.required_int("num_attention_heads", minimum=1)
    kv_value = raw.get("num_key_value_heads")
    num_kv = num_heads if kv_value is None else r.int_("num_key_value_heads", kv_value, minimum=1)
    if num_heads % num_kv:
        raise CheckpointError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv})"
        )
    hd_value = raw.get("head_dim")
    head_dim = hidden // num_heads if hd_value is None else r.int_("head_dim", hd_value, minimum=2)
    if head_dim % 2:
        raise CheckpointError(f"head_dim must be even for RoPE, found {head_dim}")
    eps_value = raw.get("rms_norm_eps")
    eps = DEFAULT_RMS_NORM_EPS if eps_value is None else r.float_("rms_norm_eps", eps_value)
    bias = raw.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise CheckpointError(f"config field 'attention_bias' must be a boolean, found {bias!r}")
    act = raw.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise CheckpointError(f"unsupported hidden_act {act!r}; supported: {list(SUPPORTED_ACTIVATIONS)}")
    block_size = r.optional_draft_int("block_size", minimum=2)
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
        logger.info("block_size absent; using the reference default %d", block_size)
    target_layer_ids, num_target_layers = _parse_target_layer_ids(r, num_layers)
    layer_types, window = _parse_layer_types(r, num_layers)
    is_causal = raw.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise CheckpointError(f"config field 'is_causal' must be a boolean or null, found {is_causal!r}")
    max_pos_value = raw.get("max_position_embeddings")
    max_pos = (
        DEFAULT_MAX_POSITION_EMBEDDINGS
        if max_pos_value is None
        else r.int_("max_position_embeddings", max_pos_value, minimum=1)
    )
    softcap_where, softcap_value = r.draft_value("final_logit_softcapping")
    softcap = None if softcap_value is None else r.float_(softcap_where, softcap_value)
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    config = DrafterConfig(
        architecture=architecture,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=r.required_int("intermediate_size", minimum=1),
        vocab_size=r.required_int("vocab_size", minimum=1),
        rms_norm_eps=eps,
        attention_bias=bias,
        hidden_act=str(act),
        block_size=block_size,
        target_layer_ids=target_layer_ids,
        num_target_layers=num_target_layers,
        mask_token_id=r.optional_draft_int("mask_token_id", minimum=0),
        rope=_parse_rope(r),
        max_position_embeddings=max_pos,
        layer_types=layer_types,
        sliding_window=window,
        is_causal=is_causal,
        input_embedding_scale=r.draft_float("input_embedding_scale", 1.0),
        output_multiplier=r.draft_float("output_multiplier", 1.0),
        final_logit_softcapping=softcap,
        dtype=dtype if isinstance(dtype, str) else None,
    )
    if architecture != DFLASH2_ARCH:
        return config
    fields: dict[str, int] = {}
    for name in DFLASH2_FIELDS:
        value = r.optional_draft_int(name, minimum=1)
        if value is None:
            raise CheckpointError(f"DFlash2 config field '{name}' is missing")
        fields[name] = value
    if hidden % fields["conv_group_size"]:
        raise CheckpointError(
            f"hidden_size ({hidden}) must be a multiple of conv_group_size ({fields['conv_group_size']})"
        )
    if fields["selector_top_k"] > config.vocab_size:
        raise CheckpointError(
            f"selector_top_k ({fields['selector_top_k']}) exceeds vocab_size ({config.vocab_size})"
        )
    return dataclasses.replace(
        config,
        conv_kernel_size=fields["conv_kernel_size"],
        conv_group_size=fields["conv_group_size"],
        selector_rank=fields["selector_rank"],
        selector_top_k=fields["selector_top_k"],
    )
