"""The drafter a training run starts from: random, copied from the target, or continued or grown
from a saved drafter."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from blockdraft.config import DrafterConfig
from blockdraft.models import DFlash2Drafter, DFlashDrafter
from blockdraft.training.selector import init_dflash2_extras


def new_drafter(raw_config: dict[str, Any], seed: int) -> DFlashDrafter:
    """A freshly initialised fp32 drafter on the CPU (linear weights ~ N(0, 0.02), norms at 1).

    A DFlash2 drafter starts as its DFlash part: identity convolutions and a selector that adds
    nothing yet (:func:`~blockdraft.training.selector.init_dflash2_extras`).
    """
    config = DrafterConfig.from_dict(raw_config)
    torch.manual_seed(seed)
    cls = DFlash2Drafter if config.is_dflash2 else DFlashDrafter
    drafter = cls(config, device="cpu", dtype=torch.float32)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    if isinstance(drafter, DFlash2Drafter):
        init_dflash2_extras(drafter, seed)
    return drafter


def init_from_target(drafter: DFlashDrafter, target: Any) -> list[int]:
    """Start the drafter's layers as copies of the target's last ``num_layers`` layers.

    Each drafter layer has exactly the shape of a target layer (the recipe's config follows
    the target), so the copy is a start that already maps hidden states towards the target's
    next-token space, rather than noise. Also copied: the target's final norm into the
    drafter's ``norm`` (its output rows go through the same ``lm_head``) and the first copied
    layer's input norm into ``hidden_norm`` (the fused context rows are normalised once and then
    used as keys/values, as that layer's normalised input is in the target). ``fc`` starts as
    the projection that passes the deepest context layer through (identity on its slice, zero
    on the others). DFlash2 extras keep their own start.

    Returns:
        the target layer index each drafter layer was copied from.
    Raises:
        ValueError: the target's layers are not named like Llama/Qwen decoder layers or their
            shapes differ from the drafter's.
    """
    body = getattr(target, "model", None)
    layers = getattr(body, "layers", None)
    final_norm = getattr(body, "norm", None)
    if layers is None or final_norm is None:
        raise ValueError("init_from_target needs a Llama/Qwen-style target (model.layers, model.norm)")
    c = drafter.config
    chosen = list(range(len(layers) - c.num_layers, len(layers)))
    with torch.no_grad():
        for i, src in enumerate(chosen):
            mine = drafter.layer(i).state_dict()
            theirs = layers[src].state_dict()
            for name, tensor in mine.items():
                if name not in theirs:
                    continue  # DFlash2 convolutions
                if theirs[name].shape != tensor.shape:
                    raise ValueError(f"target layer {src} {name} is {tuple(theirs[name].shape)}, the drafter's "
                                     f"is {tuple(tensor.shape)}")
                tensor.copy_(theirs[name].to(tensor.dtype))
        drafter.norm.weight.copy_(final_norm.weight.to(drafter.norm.weight.dtype))
        first = layers[chosen[0]]
        drafter.hidden_norm.weight.copy_(first.input_layernorm.weight.to(drafter.hidden_norm.weight.dtype))
        h = c.hidden_size
        fc = drafter.fc.weight
        fc.zero_()
        fc[:, (c.num_context_layers - 1) * h :] = torch.eye(h, dtype=fc.dtype, device=fc.device)
    return chosen


def init_from_drafter(drafter: DFlashDrafter, path: Path) -> None:
    """Start ``drafter`` from the weights of the saved drafter at ``path`` (continued training).

    The block size may differ: no weight depends on it (a block is anchor + MASK embeddings,
    its positions come from RoPE), so a B = 16 drafter can start a B = 8 one.

    ``drafter`` may also have more layers than the saved one (growing it). Each extra layer
    starts as a copy of the saved drafter's last layer with its two output projections
    (``o_proj``, ``down_proj``) zeroed: it adds nothing to the residual stream, so the grown
    drafter drafts exactly what the saved one did, and training opens the new layers from there
    instead of from a worse start.

    Raises:
        ValueError: the saved drafter's config differs from ``drafter``'s in anything but the
            block size and a smaller layer count (the fields that differ are named).
        blockdraft.CheckpointError: ``path`` is not a readable drafter checkpoint.
    """
    from blockdraft.checkpoint import load_drafter

    saved = load_drafter(path, device="cpu", dtype=torch.float32)
    mine, theirs = asdict(drafter.config), asdict(saved.config)
    free = ("dtype", "block_size", "num_layers", "layer_types")
    differ = sorted(k for k in mine if k not in free and mine[k] != theirs.get(k))
    have, want = saved.config.num_layers, drafter.config.num_layers
    if have > want:
        differ.append("num_layers")
    # Extra layers copy the last one, so their attention kind (full or sliding) must be its kind.
    types, saved_types = tuple(drafter.config.layer_types), tuple(saved.config.layer_types)
    if have <= want and types != saved_types + saved_types[-1:] * (want - have):
        differ.append("layer_types")
    if differ:
        raise ValueError(f"cannot start from {path}: its config differs in {', '.join(differ)}")
    state = saved.state_dict()
    silent = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight")
    for i in range(have, want):
        for name, tensor in saved.layer(have - 1).state_dict().items():
            state[f"layers.{i}.{name}"] = torch.zeros_like(tensor) if name in silent else tensor
    with torch.no_grad():
        drafter.load_state_dict(state)
