"""Write a random-weight target + drafter pair to disk, servable by `blockdraft serve`:

    python benchmarks/random_pair.py DIR [--shape qwen3-8b] [--device cuda] [--dtype bfloat16]

Writes DIR/target (Hugging Face Qwen3 checkpoint and a tokenizer) and DIR/drafter (DFlash,
z-lab format), the pair `blockdraft bench` builds in memory. The tokenizer is a word-level one
whose every id decodes to a word ``t<id>``, so any token a random target emits streams as text;
prompt words it does not know encode as ``t0``. Random weights accept almost nothing (tau ~ 1):
a server on this pair measures the system's cost per step, not a speed-up.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch

from blockdraft import pair
from blockdraft.checkpoint import save_drafter

log = logging.getLogger("random_pair")


def word_tokenizer(vocab: int) -> Any:
    """A fast tokenizer with one word per id (``t0`` .. ``t<vocab-1>``), ``t0`` the unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder: ids decode to their words joined by spaces, so text grows word by word.
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(pair.SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    shape = pair.SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    out = Path(args.out)
    t0 = time.perf_counter()
    with torch.inference_mode():
        target = pair.random_target(shape, device, dtype, 0)
        target.save_pretrained(str(out / "target"))
        del target
        word_tokenizer(shape.vocab).save_pretrained(str(out / "target"))
        drafter = pair.random_drafter(shape, device, dtype, 1)
        save_drafter(drafter, shape.drafter.config_dict(), out / "drafter", args.dtype)
    log.info("wrote %s (%s, %s) in %.1f s", out, args.shape, args.dtype, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
