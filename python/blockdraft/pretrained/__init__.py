"""The built-in trained pair: a small Qwen3 Python-code model and its DFlash drafters.

Shipped inside the package (bf16 safetensors, about 51 MB), made from scratch and offline by
``python -m blockdraft.training.builtin.make_builtin_pair --preset h200``; see ``MODEL_CARD.md`` here.

Layout::

    target/            Hugging Face Qwen3ForCausalLM (16.9 M parameters, tuned against loops) + its BPE tokenizer
    drafter-b8/        DFlash2 drafter, block size 8
    drafter-b16/       DFlash2 drafter, block size 16 (the default)
    heldout_prompts.json   prompts from files held out of training (token ids and text)
    build_report.json  every number the build measured
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from blockdraft.models import DFlashDrafter

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent
TARGET_DIR = ROOT / "target"
DEFAULT_BLOCK_SIZE = 16


def summary(block_size: int) -> str:
    """What the built-in pair with the B = ``block_size`` drafter is, for the CLI's one-line
    descriptions."""
    return f"Python code model + B={block_size} drafter, fp32"


DEFAULT_PROMPT = "def fibonacci(n):"
"""The prompt ``blockdraft generate`` continues when given none."""


def drafter_dir(block_size: int = DEFAULT_BLOCK_SIZE) -> Path:
    """Directory of the shipped drafter with ``block_size``."""
    return ROOT / f"drafter-b{block_size}"


def available(block_size: int = DEFAULT_BLOCK_SIZE) -> bool:
    """Whether the target and the drafter with ``block_size`` are present (weights included)."""
    need = [TARGET_DIR / "config.json", TARGET_DIR / "model.safetensors", TARGET_DIR / "tokenizer.json",
            drafter_dir(block_size) / "config.json", drafter_dir(block_size) / "model.safetensors"]
    return all(p.is_file() for p in need)


def heldout_prompts() -> list[list[int]]:
    """Token ids of the shipped held-out prompts (beginnings of files the pair never saw)."""
    data = json.loads((ROOT / "heldout_prompts.json").read_text(encoding="utf-8"))
    return [list(map(int, p["ids"])) for p in data["prompts"]]


def load_tokenizer() -> Any:
    """The shipped target's byte-level BPE tokenizer (``transformers.PreTrainedTokenizerFast``).

    Raises:
        FileNotFoundError: the pair is not installed.
    """
    from transformers import AutoTokenizer

    if not (TARGET_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the built-in pair's tokenizer is not installed under {TARGET_DIR}")
    return AutoTokenizer.from_pretrained(str(TARGET_DIR))


def builtin_pair(
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[Any, DFlashDrafter, Any]:
    """Load the shipped pair: a small Qwen3 Python-code target, a DFlash drafter, the tokenizer.

    Called without arguments it works on any machine, a CPU-only one included (about 51 MB
    of weights)::

        target, drafter, tokenizer = builtin_pair()
        prompt = tokenizer.encode("def fibonacci(n):")
        result = blockdraft.generate(target, drafter, [prompt], max_new_tokens=32)

    Args:
        device: where both models go; default CUDA when present, else CPU.
        dtype: default fp32 on every device: the pair is small, and in fp32 speculative output
            equals the target's own greedy output exactly (the files are bf16).
        block_size: the drafter's block size B: 16 (default: the DFlash2 drafter, higher tau and
            faster on the CPU) or 8 (DFlash).

    Returns:
        ``(target, drafter, tokenizer)``: the target, a ``transformers`` ``Qwen3ForCausalLM``
        in eval mode; the drafter, a :class:`blockdraft.DFlashDrafter` in eval mode without
        gradients; and the target's tokenizer (:func:`load_tokenizer`: ``encode`` a prompt to
        token ids, ``decode`` ids to text; its ``eos_token_id`` ends a generation).

    Raises:
        FileNotFoundError: the pair (or the drafter with ``block_size``) is not installed.
    """
    from transformers import AutoModelForCausalLM

    from blockdraft.checkpoint import load_drafter

    if not available(block_size):
        raise FileNotFoundError(f"the built-in pair with a B={block_size} drafter is not installed under {ROOT}")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = dtype or torch.float32
    tokenizer = load_tokenizer()
    model: Any = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=dt)
    target = model.to(dev).eval()
    drafter = load_drafter(drafter_dir(block_size), device=dev, dtype=dt)
    log.info("built-in pair: target %s, drafter B=%d, %s on %s", TARGET_DIR, block_size, dt, dev)
    return target, drafter, tokenizer
