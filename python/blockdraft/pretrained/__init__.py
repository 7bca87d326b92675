"""The built-in trained pair: a small Qwen3 Python-code model and its DFlash drafters.

Shipped inside the package (bf16 safetensors, about 21 MB), made from scratch and offline by
``python -m blockdraft.training.make_builtin_pair --preset h200``; see ``MODEL_CARD.md`` here.

Layout::

    target/            Hugging Face Qwen3ForCausalLM + its BPE tokenizer
    drafter-b8/        DFlash drafter, block size 8 (the default)
    drafter-b16/       DFlash drafter, block size 16
    heldout_prompts.json   prompts from files held out of training (token ids and text)
    build_report.json  every number the build measured
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent
TARGET_DIR = ROOT / "target"
DEFAULT_BLOCK_SIZE = 8


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


def builtin_pair(
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[Any, Any, Any]:
    """Load ``(target, drafter, tokenizer)`` of the shipped pair.

    Args:
        device: default CUDA when present, else CPU.
        dtype: default bf16 on CUDA, fp32 elsewhere (the files are bf16; CPUs compute fp32).
        block_size: 8 or 16.
    Raises:
        FileNotFoundError: the pair (or that drafter) is not installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockdraft.checkpoint import load_drafter

    if not available(block_size):
        raise FileNotFoundError(f"the built-in pair with a B={block_size} drafter is not installed under {ROOT}")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    model: Any = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=dt)
    target = model.to(dev).eval()
    drafter = load_drafter(drafter_dir(block_size), device=dev, dtype=dt)
    log.info("built-in pair: target %s, drafter B=%d, %s on %s", TARGET_DIR, block_size, dt, dev)
    return target, drafter, tokenizer
