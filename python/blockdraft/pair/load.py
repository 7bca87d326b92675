"""Which pair a command runs (``--target``/``--drafter``, the built-in pair, or the random demo
pair), known from its config files before any weights load, and the loaded pair.

A wrong flag fails with one line that names it (:class:`~blockdraft.cli.common.CliError`)
after reading only ``config.json`` files, so that a command checks prompts and lengths
against :attr:`PairSource.max_positions` in a second instead of after loading weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.cli.common import (
    CliError,
    check_pair_dirs,
    load_drafter_dir,
    load_target_model,
    load_tokenizer,
    max_positions,
    quiet_transformers,
    read_model_config,
)
from blockdraft.pair.shape import DEMO_SHAPE, random_pair

BUILTIN_MODEL_NAME = "blockdraft-builtin"
DEMO_MODEL_NAME = "blockdraft-demo"


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


def find_pair(target: str | None, drafter: str | None, *, demo: bool = False) -> PairSource:
    """The pair ``--target``/``--drafter`` name, else the built-in pair, else (with ``demo``)
    the random demo pair; nothing but ``config.json`` files is read.

    Raises:
        CliError: one of the two flags alone, directories that do not hold a target and a
            DFlash drafter, or no pair (the built-in one not installed and no ``demo``).
    """
    if target is None and drafter is None:
        return _builtin_or_demo(demo)
    if target is None or drafter is None:
        raise CliError("give both --target DIR and --drafter DIR (or neither for the built-in pair)")
    target_dir, drafter_dir = target, drafter
    raw = check_pair_dirs(target_dir, drafter_dir)

    def from_dirs(device: Any, dtype: Any) -> tuple[Any, Any, Any]:
        return (load_target_model("--target", target_dir, device, dtype),
                load_drafter_dir(drafter_dir, device, dtype), None)

    return PairSource(Path(target_dir).resolve().name, f"target {target_dir}, drafter {drafter_dir}",
                      max_positions(raw), raw, False, lambda: load_tokenizer("--target", target_dir),
                      from_dirs)


def _builtin_or_demo(demo: bool) -> PairSource:
    import torch

    from blockdraft import pretrained

    if pretrained.available():
        def builtin(device: Any, dtype: Any) -> tuple[Any, Any, Any]:
            quiet_transformers()
            return pretrained.builtin_pair(device=device, dtype=dtype)

        raw = read_model_config("the built-in target", pretrained.TARGET_DIR)
        # fp32 on every device: the pair is small, and fp32 makes the speculative output
        # exactly the target's own greedy output
        return PairSource(BUILTIN_MODEL_NAME, f"built-in trained pair ({pretrained.SUMMARY})",
                          max_positions(raw), raw, True, pretrained.load_tokenizer, builtin,
                          torch.float32)
    if not demo:
        raise CliError("the built-in pair is not installed; pass --target DIR --drafter DIR")

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
              demo: bool = False) -> Pair:
    """:func:`find_pair`, then :meth:`PairSource.load` on ``device``."""
    return find_pair(target, drafter, demo=demo).load(device, dtype)
