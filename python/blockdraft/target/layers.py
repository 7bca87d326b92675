"""Where a Hugging Face causal LM's decoder layers are, found without knowing its family.

The drafter reads the target's hidden states by layer id: id ``i`` is the output of decoder
layer ``i``, Hugging Face's ``output_hidden_states`` entry ``hidden_states[i + 1]`` (entry 0
is the embedding output, the input of layer 0). Hugging Face replaces the last entry,
``hidden_states[L]``, with the decoder's ``last_hidden_state``: in a causal LM with a final
norm that is the last layer's output *after* the norm. :func:`find_layers` therefore returns
the layer list together with the decoder module whose output that is, so a capture can take
the last layer where Hugging Face does.

Families differ only in names: Llama, Qwen, Mistral, Phi and Gemma keep their layers at
``model.layers``, GPT-2 and Falcon at ``transformer.h``, GPT-NeoX at ``gpt_neox.layers``, OPT at
``model.decoder.layers``. The search starts from the model's own ``get_decoder()`` and
``base_model``, so a new family that follows Hugging Face's conventions needs no entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

LAYER_LIST_NAMES = ("layers", "h", "blocks", "block")
"""Attribute names under which decoders keep their layer list, tried in this order."""


@dataclass(frozen=True)
class DecoderLayers:
    """A causal LM's decoder layers.

    Attributes:
        decoder: the module whose output's ``last_hidden_state`` (or first element) is
            Hugging Face's last ``hidden_states`` entry: the decoder, final norm included.
        layers: the decoder layers in the order they run; ``layers[i]``'s output is
            ``hidden_states[i + 1]`` for every layer but the last.
        where: the list's dotted name in the model (``"transformer.h"``), for log lines.
    """

    decoder: nn.Module
    layers: nn.ModuleList
    where: str


def text_config(target: Any) -> Any:
    """The config that describes a target's text decoder.

    ``target`` is a config, or anything with a ``config`` (a model, a
    :class:`~blockdraft.TargetAdapter`). A multimodal config keeps the decoder's sizes in its
    text config (``get_text_config()``); Hugging Face's attribute maps then make the standard
    names read each family's own (GPT-2's ``n_embd``, ``n_layer`` and ``n_positions`` answer
    to ``hidden_size``, ``num_hidden_layers`` and ``max_position_embeddings``).
    """
    cfg = target if callable(getattr(target, "get_text_config", None)) else getattr(target, "config", target)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except (TypeError, ValueError):  # a config with several text configs of its own
            return cfg
    return cfg


def config_int(target: Any, name: str) -> int | None:
    """``name`` (``hidden_size``, ``num_hidden_layers``, ...) of the target's text config, or
    ``None`` where it is absent or not a positive integer."""
    value = getattr(text_config(target), name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _owns_head(module: nn.Module) -> bool:
    """Whether ``module`` is a whole causal LM (its output is logits, not hidden states)."""
    if getattr(module, "lm_head", None) is not None:
        return True
    get_out = getattr(module, "get_output_embeddings", None)
    try:
        return callable(get_out) and get_out() is not None
    except (AttributeError, NotImplementedError, TypeError):
        return False


def _decoder_candidates(model: nn.Module) -> list[nn.Module]:
    """Hugging Face's decoders in ``model``: ``get_decoder()`` and ``base_model`` of the model
    and of every submodule that has them (a module wrapping a causal LM), each once, in module
    order; never a module that owns the output head."""
    found: list[nn.Module] = []
    for module in model.modules():
        picks: list[Any] = []
        get_decoder = getattr(module, "get_decoder", None)
        if callable(get_decoder):
            try:
                picks.append(get_decoder())
            except (AttributeError, NotImplementedError, TypeError, ValueError):
                pass
        picks.append(getattr(module, "base_model", None))
        for pick in picks:
            if isinstance(pick, nn.Module) and not _owns_head(pick) and all(pick is not f for f in found):
                found.append(pick)
    return found


def _named_list(decoder: nn.Module, count: int | None) -> nn.ModuleList | None:
    """The decoder's :data:`LAYER_LIST_NAMES` attribute holding a non-empty ``nn.ModuleList``
    (of ``count`` modules where the count is known)."""
    for name in LAYER_LIST_NAMES:
        found = getattr(decoder, name, None)
        if isinstance(found, nn.ModuleList) and len(found) and (count is None or len(found) == count):
            return found
    return None


def _counted_list(decoder: nn.Module, count: int | None) -> nn.ModuleList | None:
    """The decoder's first ``nn.ModuleList`` of ``count`` modules (nested ones included)."""
    if count is None:
        return None
    return next((m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)


def find_layers(model: nn.Module) -> DecoderLayers | None:
    """The decoder layers of ``model`` (a Hugging Face causal LM, or a module wrapping one).

    The decoder is the model's ``get_decoder()`` or ``base_model`` (see
    :func:`_decoder_candidates`); its layers the list under a :data:`LAYER_LIST_NAMES` name,
    else its first ``nn.ModuleList`` as long as the text config's ``num_hidden_layers``. A
    list of another length than that count is not the layer list. ``None`` when nothing fits.
    """
    count = config_int(model, "num_hidden_layers")
    candidates = _decoder_candidates(model)
    for pick in (_named_list, _counted_list):
        for decoder in candidates:
            layers = pick(decoder, count)
            if layers is not None:
                where = next((name for name, m in model.named_modules() if m is layers), "?")
                return DecoderLayers(decoder, layers, where)
    return None


__all__ = ["LAYER_LIST_NAMES", "DecoderLayers", "config_int", "find_layers", "text_config"]
