"""Loading drafter checkpoints in the z-lab format (docs/design/dflash.md, "Checkpoints").

A checkpoint is a directory with ``config.json`` and either ``model.safetensors`` or sharded
``model-XXXXX-of-YYYYY.safetensors`` files listed by ``model.safetensors.index.json``. Tensor
names are unprefixed (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...); DFlash2 stores
its selector codebooks without ``.weight`` (with it is accepted too). Tensors are read with
``safetensors`` (memory-mapped, straight to the device); pickle files are never opened.

Every check runs before the drafter is built, so a failure leaves nothing half-loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from blockdraft._core import CheckpointError
from blockdraft.config import DrafterConfig
from blockdraft.models.drafter import DFlash2Drafter, DFlashDrafter
from blockdraft.models.rope import Rope

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LOAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Stored names without ``.weight`` that the module holds as plain parameters.
_BARE_PARAMETERS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def _drafter_class(config: DrafterConfig) -> type[DFlashDrafter]:
    return DFlash2Drafter if config.is_dflash2 else DFlashDrafter


def expected_tensors(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that a checkpoint for ``config`` must hold."""
    skeleton = _drafter_class(config)(config, device="meta")
    return {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}


def _canonical(name: str) -> str:
    for bare in _BARE_PARAMETERS:
        if name == f"{bare}.weight":
            return bare
    return name


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _weight_files(root: Path) -> dict[Path, set[str] | None]:
    """Files holding the tensors, each with the names the index assigns to it (``None``: all)."""
    single = root / WEIGHTS_FILE
    if single.is_file():
        return {single: None}
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = f" (found {pickles}; pickle checkpoints are not loaded)" if pickles else ""
        raise CheckpointError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {root}{hint}")
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path} has no 'weight_map' object of tensor name -> file name")
    files: dict[Path, set[str] | None] = {}
    for name, file_name in weight_map.items():
        shard = root / file_name
        if shard.parent != root:
            raise CheckpointError(f"{index_path} names a file outside the checkpoint: {file_name!r}")
        names = files.setdefault(shard, set())
        assert names is not None
        names.add(name)
    for shard in files:
        if not shard.is_file():
            raise CheckpointError(f"shard {shard.name} listed in {INDEX_FILE} is missing from {root}")
    return files


def _resolve_dtype(dtype: torch.dtype | str | None, config: DrafterConfig, stored: set[torch.dtype]) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
        return _DTYPE_NAMES[dtype]
    if dtype is not None:
        if dtype not in _LOAD_DTYPES:
            raise ValueError(f"dtype must be one of {list(_LOAD_DTYPES)}, got {dtype}")
        return dtype
    if len(stored) == 1:
        return next(iter(stored))
    if config.dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[config.dtype]
    return torch.float32


def load_drafter(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> DFlashDrafter:
    """Load a DFlash or DFlash2 drafter from a checkpoint directory.

    Args:
        path: the checkpoint directory.
        device: where the weights go (default CPU); tensors are read straight there.
        dtype: ``float32``, ``float16`` or ``bfloat16`` (default: the stored dtype when all
            tensors share one, else the config's ``dtype``/``torch_dtype``, else fp32).
    Returns:
        A :class:`DFlashDrafter` or :class:`DFlash2Drafter` (by ``architectures``) in eval mode,
        without gradients.
    Raises:
        CheckpointError: missing directory or file, unreadable JSON, missing or extra tensors,
            a shape that disagrees with the config, an unsupported architecture or dtype.
        ValueError: ``dtype`` is not a supported floating dtype.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path is not a directory: {root}")
    config = DrafterConfig.from_file(root / CONFIG_FILE)
    dev = torch.device("cpu" if device is None else device)
    expected = expected_tensors(config)
    files = _weight_files(root)

    with contextlib.ExitStack() as stack:
        located: dict[str, tuple[Any, str]] = {}
        for file, listed in files.items():
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device=str(dev)))
                keys = set(handle.keys())
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {file}: {exc}") from exc
            if listed is not None and not listed <= keys:
                missing = sorted(listed - keys)
                raise CheckpointError(f"{file.name} lacks tensors that {INDEX_FILE} assigns to it: {missing}")
            for stored in sorted(keys if listed is None else listed):
                name = _canonical(stored)
                if name in located:
                    raise CheckpointError(f"tensor {name!r} is stored twice (as {located[name][1]!r} and {stored!r})")
                located[name] = (handle, stored)

        missing = sorted(set(expected) - set(located))
        if missing:
            raise CheckpointError(f"checkpoint {root} is missing tensors: {missing}")
        extra = sorted(set(located) - set(expected))
        if extra:
            raise CheckpointError(f"checkpoint {root} has unexpected tensors: {extra}")
        stored_dtypes: set[torch.dtype] = set()
        for name, shape in expected.items():
            handle, stored = located[name]
            view = handle.get_slice(stored)
            found = tuple(view.get_shape())
            if found != shape:
                raise CheckpointError(
                    f"tensor {stored!r} has shape {list(found)}, expected {list(shape)} from the config"
                )
            kind = view.get_dtype()
            if kind not in _SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"tensor {stored!r} has unsupported dtype {kind}; supported: {sorted(_SAFETENSORS_DTYPES)}"
                )
            stored_dtypes.add(_SAFETENSORS_DTYPES[kind])
        target_dtype = _resolve_dtype(dtype, config, stored_dtypes)
        state: dict[str, Tensor] = {}
        for name in expected:
            handle, stored = located[name]
            state[name] = handle.get_tensor(stored).to(dtype=target_dtype)

    drafter = _drafter_class(config)(config, device="meta")
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.rope = Rope.from_config(config, dev)
    drafter.requires_grad_(False)
    drafter.eval()
    logger.info(
        "loaded %s from %s: %d layers, H=%d, B=%d, target layers %s, %s on %s",
        config.architecture, root, config.num_layers, config.hidden_size, config.block_size,
        list(config.target_layer_ids), target_dtype, dev,
    )
    return drafter


def save_drafter(drafter: DFlashDrafter, raw_config: dict[str, Any], out: Path, dtype: str = "bfloat16") -> Path:
    """Write ``out/config.json`` + ``out/model.safetensors`` (z-lab format, what
    :func:`load_drafter` reads) with the weights in ``dtype`` (``float32``, ``float16`` or
    ``bfloat16``); returns ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(raw_config)
    cfg["dtype"] = dtype
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tensors = {k: v.detach().to("cpu", _DTYPE_NAMES[dtype]).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
