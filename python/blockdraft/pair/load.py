"""Which pair a command runs (``--target``/``--drafter``, the built-in pair, or the random demo
pair), known from its config files before any weights load, and the loaded pair; and the
readers and loaders of model directories that it is built on.

A wrong directory fails with one line that names the flag (:class:`blockdraft.ConfigError`)
after reading only ``config.json`` files, so that a command checks prompts and lengths
against :attr:`PairSource.max_positions` in a second instead of after loading weights.
Weights that do not load raise :class:`blockdraft.CheckpointError`, also naming the flag.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft._core import CheckpointError, ConfigError
from blockdraft.config import SUPPORTED_ARCHITECTURES
from blockdraft.errors import error_line
from blockdraft.pair.shape import DEMO_SHAPE, random_pair

BUILTIN_MODEL_NAME = "blockdraft-builtin"
DEMO_MODEL_NAME = "blockdraft-demo"


def quiet_transformers() -> None:
    """No transformers loading bars: the CLI has its own, and theirs bury error lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def read_model_config(flag: str, path: str | Path) -> dict[str, Any]:
    """The ``config.json`` object of the model directory given as ``flag``.

    Raises:
        ConfigError: not a directory, no ``config.json``, or one that is not a JSON object.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{flag} {path}: not a directory")
    file = root / "config.json"
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no config.json (expected a model directory)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read config.json: {error_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} {path}: config.json holds {type(raw).__name__}, not an object")
    return raw


def drafter_signs(raw: dict[str, Any]) -> str | None:
    """What in a ``config.json`` marks a DFlash drafter (its architecture or a
    ``dflash_config``), or ``None`` for any other model."""
    archs = raw.get("architectures")
    names = [archs] if isinstance(archs, str) else archs if isinstance(archs, list) else []
    found = [a for a in names if a in SUPPORTED_ARCHITECTURES]
    if found:
        return f"architectures {found}"
    if isinstance(raw.get("dflash_config"), dict):
        return "a dflash_config"
    return None


def _architectures(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    return f"architectures {archs}" if archs else "no architectures field"


def check_target_dir(path: str) -> dict[str, Any]:
    """The ``--target`` directory's ``config.json``.

    Raises:
        ConfigError: no readable config, or a DFlash drafter's.
    """
    raw = read_model_config("--target", path)
    signs = drafter_signs(raw)
    if signs is not None:
        raise ConfigError(f"--target {path} is a DFlash drafter ({signs}), not a target model; "
                          "pass it as --drafter")
    return raw


def check_pair_dirs(target: str, drafter: str) -> dict[str, Any]:
    """Check ``--target``/``--drafter`` from their ``config.json`` files (swapped flags
    included); returns the target's config.

    Raises:
        ConfigError: a directory without a readable config, or not a target and a DFlash drafter.
    """
    target_raw = read_model_config("--target", target)
    drafter_raw = read_model_config("--drafter", drafter)
    target_signs, drafter_signs_ = drafter_signs(target_raw), drafter_signs(drafter_raw)
    if target_signs is not None and drafter_signs_ is None:
        raise ConfigError(f"--target and --drafter are swapped: --target {target} is a DFlash "
                          f"drafter ({target_signs}) and --drafter {drafter} is not "
                          f"({_architectures(drafter_raw)})")
    if target_signs is not None:
        raise ConfigError(f"--target {target} is a DFlash drafter ({target_signs}), not a target model")
    if drafter_signs_ is None:
        raise ConfigError(f"--drafter {drafter} is not a DFlash drafter ({_architectures(drafter_raw)}; "
                          f"expected one of {list(SUPPORTED_ARCHITECTURES)} or a dflash_config)")
    return target_raw


def _mapped_key(cfg: dict[str, Any], name: str) -> str | None:
    """The key under which a ``config.json`` object of its ``model_type`` stores the standard
    field ``name`` (its Hugging Face config class's ``attribute_map``: GPT-2 keeps
    ``max_position_embeddings`` as ``n_positions``), or ``None``. transformers is imported only
    for a config without the standard key."""
    model_type = cfg.get("model_type")
    if name in cfg or not isinstance(model_type, str):
        return None
    from transformers import CONFIG_MAPPING

    try:
        mapped = CONFIG_MAPPING[model_type].attribute_map.get(name)
    except KeyError:  # a model type this transformers does not know (remote code)
        return None
    return mapped if isinstance(mapped, str) else None


def max_positions(raw: dict[str, Any]) -> int | None:
    """``max_position_embeddings`` of a target ``config.json`` (top level or ``text_config``),
    under its standard name or its family's own (:func:`_mapped_key`)."""
    for cfg in (raw, raw.get("text_config")):
        if isinstance(cfg, dict):
            for key in ("max_position_embeddings", _mapped_key(cfg, "max_position_embeddings")):
                value = cfg.get(key) if key is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def load_tokenizer(flag: str, path: str | Path) -> Any:
    """The tokenizer of the model directory given as ``flag``.

    Raises:
        CheckpointError: transformers cannot load it (its first line, after the flag).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - reported as one line naming the flag
        raise CheckpointError(f"{flag} {path}: cannot load the tokenizer: {error_line(exc)}") from exc


def load_target_model(flag: str, path: str | Path, device: Any, dtype: Any) -> Any:
    """A Hugging Face causal LM in eval mode on ``device``.

    Raises:
        CheckpointError: transformers cannot load it (its first line, after the flag).
    """
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - reported as one line naming the flag
        raise CheckpointError(f"{flag} {path}: cannot load the model: {error_line(exc)}") from exc
    return model.to(device).eval()


def load_drafter_dir(path: str | Path, device: Any, dtype: Any) -> Any:
    """:func:`blockdraft.load_drafter` with its errors naming ``--drafter``.

    Raises:
        CheckpointError: the drafter does not load (its first line, after the flag).
    """
    from blockdraft.checkpoint import load_drafter

    try:
        return load_drafter(path, device=device, dtype=dtype)
    except (CheckpointError, ValueError) as exc:
        raise CheckpointError(f"--drafter {path}: {error_line(exc)}") from exc


class ByteTokenizer:
    """The demo pair's tokenizer: UTF-8 bytes are ids 0..255."""

    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) or [32]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def build_demo_pair(*, device: Any = "cpu", dtype: Any = None, seed: int = 0) -> tuple[Any, Any]:
    """The random pair at :data:`~blockdraft.pair.DEMO_SHAPE` on ``device`` in ``dtype``
    (default fp32).

    Deterministic: the same seed gives the same weights on every machine (drawn on the CPU).
    """
    import torch

    target, drafter = random_pair(DEMO_SHAPE, "cpu", torch.float32, seed)
    dtype = dtype or torch.float32
    return target.to(device=device, dtype=dtype).eval(), drafter.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class Pair:
    """A loaded pair: the target, the drafter, the target's tokenizer and its
    ``max_position_embeddings`` (``None``: not stated)."""

    target: Any
    drafter: Any
    tokenizer: Any
    max_positions: int | None


Models = Callable[[Any, Any], tuple[Any, Any, Any]]
"""``(device, dtype) -> (target, drafter, tokenizer or None)``."""


@dataclass(frozen=True)
class PairSource:
    """A pair known from its config files: checked, and able to tokenize, before weights load.

    Attributes:
        name: the model id a server offers (the built-in name, or the target directory's name).
        config: the target's ``config.json`` (what ``--tp`` is checked against).
        builtin: whether it is the built-in trained pair.
        dtype: the pair's own dtype (the built-in pair runs in fp32 everywhere), else ``None``
            for the device's (:func:`blockdraft.devices.default_dtype`).
    """

    name: str
    description: str
    max_positions: int | None
    config: dict[str, Any]
    builtin: bool
    tokenizer: Callable[[], Any]
    models: Models
    dtype: Any = None

    def load(self, device: Any, dtype: Any = None, *, tokenizer: Any = None) -> Pair:
        """Load the weights on ``device`` (in ``dtype``, else the pair's, else the device's);
        ``tokenizer`` is one already loaded by :attr:`tokenizer`."""
        import torch

        from blockdraft.devices import default_dtype

        device = torch.device(device)
        target, drafter, own = self.models(device, dtype or self.dtype or default_dtype(device))
        if tokenizer is None:
            tokenizer = own if own is not None else self.tokenizer()
        return Pair(target, drafter, tokenizer, self.max_positions)


def find_pair(target: str | None, drafter: str | None, *, demo: bool = False,
              block_size: int | None = None) -> PairSource:
    """The pair ``--target``/``--drafter`` name, else the built-in pair, else (with ``demo``)
    the random demo pair; nothing but ``config.json`` files is read.

    Args:
        block_size: which of the built-in pair's drafters (8 or 16; default
            :data:`blockdraft.pretrained.DEFAULT_BLOCK_SIZE`). Given, a built-in pair without
            that drafter is an error, not the demo pair. Directories name their own drafter.

    Raises:
        ConfigError: one of the two flags alone, directories that do not hold a target and a
            DFlash drafter, or no pair (the built-in one, or its drafter with ``block_size``,
            not installed and no ``demo``).
    """
    if target is None and drafter is None:
        return _builtin_or_demo(demo, block_size)
    if target is None or drafter is None:
        raise ConfigError("give both --target DIR and --drafter DIR (or neither for the built-in pair)")
    target_dir, drafter_dir = target, drafter
    raw = check_pair_dirs(target_dir, drafter_dir)

    def from_dirs(device: Any, dtype: Any) -> tuple[Any, Any, Any]:
        return (load_target_model("--target", target_dir, device, dtype),
                load_drafter_dir(drafter_dir, device, dtype), None)

    return PairSource(Path(target_dir).resolve().name, f"target {target_dir}, drafter {drafter_dir}",
                      max_positions(raw), raw, False, lambda: load_tokenizer("--target", target_dir),
                      from_dirs)


def _builtin_or_demo(demo: bool, block_size: int | None) -> PairSource:
    import torch

    from blockdraft import pretrained

    block = pretrained.DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if pretrained.available(block):
        def builtin(device: Any, dtype: Any) -> tuple[Any, Any, Any]:
            quiet_transformers()
            return pretrained.builtin_pair(device=device, dtype=dtype, block_size=block)

        raw = read_model_config("the built-in target", pretrained.TARGET_DIR)
        # fp32 on every device: the pair is small, and fp32 makes the speculative output
        # exactly the target's own greedy output
        return PairSource(BUILTIN_MODEL_NAME, f"built-in trained pair ({pretrained.summary(block)})",
                          max_positions(raw), raw, True, pretrained.load_tokenizer, builtin,
                          torch.float32)
    if block_size is not None:
        raise ConfigError(f"the built-in pair has no B={block} drafter installed "
                          "(--block-size 8 or 16; or pass --target/--drafter)")
    if not demo:
        raise ConfigError("the built-in pair is not installed; pass --target DIR --drafter DIR")

    def demo_models(device: Any, dtype: Any) -> tuple[Any, Any, Any]:
        target, drafter = build_demo_pair(device=device, dtype=dtype)
        return target, drafter, None

    shape = DEMO_SHAPE
    # What the checks before loading read of the demo target's config.
    raw = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": shape.heads,
           "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.mlp,
           "max_position_embeddings": shape.max_positions}
    return PairSource(DEMO_MODEL_NAME,
                      "built-in trained pair not installed; using the demo pair with RANDOM weights "
                      "(output is noise; pass --target/--drafter for a real pair)",
                      shape.max_positions, raw, False, ByteTokenizer, demo_models)


def load_pair(target: str | None, drafter: str | None, *, device: Any, dtype: Any = None,
              demo: bool = False, block_size: int | None = None) -> Pair:
    """:func:`find_pair`, then :meth:`PairSource.load` on ``device``."""
    return find_pair(target, drafter, demo=demo, block_size=block_size).load(device, dtype)
